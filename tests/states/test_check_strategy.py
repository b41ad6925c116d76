"""The strategy rules of a stage: the settings table belongs to its strategy, an sft stage trains on
prompt/response examples and a dpo stage on prompt/chosen/rejected ones, both with a causal objective;
a dpo stage has a reference, no fade and no token-level KL; a config without strategies keeps its
identity."""

from __future__ import annotations

import pytest

from rewind.states.config_error import ConfigError
from rewind.states.config_identity import config_hash
from rewind.states.config_reading import loads_config
from tests.conftest import EXAMPLES

TINY = (EXAMPLES / "tiny.toml").read_text()
SECOND = 'tokens = 12_800\ndatasets = [{ name = "reverse", rate = 1.0 }]'


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        loads_config(text)
    return caught.value.problems


def test_an_sft_stage_on_examples_loads_with_its_settings():
    config = loads_config(TINY.replace(SECOND, f'strategy = "sft"\n{SECOND}\nsft = {{ packing = true }}'))
    assert config.stages[1].strategy == "sft"
    assert config.stages[1].sft is not None and config.stages[1].sft.packing
    assert not hasattr(config.stages[0], "sft")  # a pretrain stage has nowhere to hold sft settings


def test_the_strategy_and_its_settings_are_part_of_the_identity_only_when_given():
    plain = loads_config(TINY)
    sft = loads_config(TINY.replace(SECOND, f'strategy = "sft"\n{SECOND}'))
    packed = loads_config(TINY.replace(SECOND, f'strategy = "sft"\n{SECOND}\nsft = {{ packing = true }}'))
    defaults = loads_config(TINY.replace(SECOND, f'strategy = "sft"\n{SECOND}\nsft = {{ packing = false }}'))
    assert len({config_hash(plain), config_hash(sft), config_hash(packed)}) == 3
    # an empty table is the defaults: the same run as leaving it out
    assert config_hash(defaults) == config_hash(sft)


def test_every_strategy_problem_is_said_at_once_with_its_field():
    text = TINY.replace(SECOND, 'strategy = "sft"\ntokens = 12_800\ndatasets = [{ name = "grammar", rate = 1.0 }]')
    text = text.replace('refresh_reference = true\n', 'refresh_reference = true\n', 1)
    text = text.replace(
        'datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]',
        'datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]\nsft = { packing = true }',
    )
    problems = _problems(text)
    assert problems == [  # (a table on another kind is a type problem: said first)
        "stages[2].sft: settings of an sft stage, but this stage's strategy is 'pretrain'",
        "stages[1].datasets[0].name: an sft stage trains on prompt/response examples; 'grammar' has none "
        "(use a task, or a jsonl / parquet dataset with prompt_field and response_field)",
    ]


def test_an_sft_stage_needs_a_causal_objective():
    text = TINY.replace(SECOND, f'strategy = "sft"\n{SECOND}') + '\n[objective]\nkind = "mlm"\n'
    assert any(
        p.startswith("stages[1].strategy: an sft stage predicts its responses left to right") for p in _problems(text)
    )


def test_a_jsonl_dataset_is_examples_only_with_its_prompt_and_response_fields(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"q": "a", "a": "b", "text": "ab"}\n')
    data = f'\n[data.qa]\nkind = "jsonl"\npath = "{rows}"\nprompt_field = "q"\nresponse_field = "a"\n'
    data += f'\n[data.prose]\nkind = "jsonl"\npath = "{rows}"\n'
    ok = TINY.replace(SECOND, 'strategy = "sft"\ntokens = 12_800\ndatasets = [{ name = "qa", rate = 1.0 }]') + data
    assert loads_config(ok).stages[1].strategy == "sft"
    bad = ok.replace('datasets = [{ name = "qa", rate = 1.0 }]', 'datasets = [{ name = "prose", rate = 1.0 }]')
    assert [p.split(";")[0] for p in _problems(bad)] == [
        "stages[1].datasets[0].name: an sft stage trains on prompt/response examples"
    ]


def test_an_unknown_strategy_is_a_type_error_naming_the_choices():
    problems = _problems(TINY.replace(SECOND, f'strategy = "rlhf"\n{SECOND}'))
    assert problems == ["stages[1].strategy: expected one of distill, dpo, grpo, pretrain, sft, got 'rlhf'"]


THIRD = 'datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]\nbeta = 0.2'
DPO_THIRD = 'strategy = "dpo"\ndatasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]'


def test_a_dpo_stage_with_a_reference_and_no_fade_loads_and_its_settings_count_in_the_identity():
    text = TINY.replace(THIRD, f"{DPO_THIRD}\nrefresh_reference = true").replace(
        "[training.fade]\noverlap = 0.5", "[training.fade]\noverlap = 0.0"
    )
    config = loads_config(text)
    assert config.stages[2].strategy == "dpo" and config.stages[2].dpo.beta == 0.1
    tuned = loads_config(text.replace(DPO_THIRD, f'{DPO_THIRD}\ndpo = {{ loss = "ipo" }}'))
    assert config_hash(tuned) != config_hash(config)


def test_every_dpo_problem_is_said_at_once():
    text = TINY.replace(THIRD, f'{DPO_THIRD}\nbeta = 0.2\ndpo = {{ beta = 0.0, loss = "hinge", label_smoothing = 0.1, sft_weight = -1 }}')
    text = text.replace("refresh_reference = true\n", "")
    assert _problems(text) == [
        "stages[2].refresh_reference: a dpo stage compares the policy with the KL reference; refresh it on "
        "entering this stage (or an earlier one)",
        "stages[2].beta: a dpo stage's loss is its tie to the reference; its token-level KL beta must be 0",
        "stages[1].overlap: no fade into a dpo stage (its rows are its own), got 0.5; set overlap = 0 on stages[1]",
        "stages[2].dpo.beta: must be positive, got 0.0",
        "stages[2].dpo.label_smoothing: the hinge loss has no label smoothing (sigmoid or robust do)",
        "stages[2].dpo.sft_weight: must be >= 0, got -1.0",
    ]


def test_a_dpo_stage_reads_preferences_and_a_jsonl_dataset_gives_them_with_its_chosen_and_rejected_fields(tmp_path):
    rows = tmp_path / "prefs.jsonl"
    rows.write_text('{"q": "a", "good": "b", "bad": "c"}\n')
    data = f'\n[data.prefs]\nkind = "jsonl"\npath = "{rows}"\nprompt_field = "q"\nchosen_field = "good"\nrejected_field = "bad"\n'
    base = TINY.replace("[training.fade]\noverlap = 0.5", "[training.fade]\noverlap = 0.0")
    ok = base.replace(THIRD, 'strategy = "dpo"\ndatasets = [{ name = "prefs", rate = 1.0 }]') + data
    assert loads_config(ok).stages[2].datasets[0].name == "prefs"
    grammar = base.replace(THIRD, 'strategy = "dpo"\ndatasets = [{ name = "grammar", rate = 1.0 }]')
    assert [p.split(";")[0] for p in _problems(grammar)] == [
        "stages[2].datasets[0].name: a dpo stage trains on prompt/chosen/rejected examples"
    ]
    half = ok.replace('rejected_field = "bad"\n', "")
    assert _problems(half) == ["data.prefs.rejected_field: chosen_field and rejected_field go together"]
    twice = ok.replace('rejected_field = "bad"', 'rejected_field = "good"')
    assert _problems(twice) == ["data.prefs.rejected_field: must differ from the other fields ('good' is named twice)"]


GRPO_THIRD = 'strategy = "grpo"\ndatasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]'
NO_FADE = ("[training.fade]\noverlap = 0.5", "[training.fade]\noverlap = 0.0")


def test_a_grpo_stage_loads_with_its_defaults_and_its_settings_count_in_the_identity():
    text = TINY.replace(THIRD, GRPO_THIRD).replace(*NO_FADE)
    config = loads_config(text)
    settings = config.stages[2].grpo
    assert (settings.group_size, settings.num_iterations, settings.loss_type) == (4, 1, "dapo")
    assert [r.function for r in settings.rewards] == ["exact_match"]
    tuned = loads_config(text.replace(GRPO_THIRD, f"{GRPO_THIRD}\ngrpo = {{ num_iterations = 2 }}"))
    assert config_hash(tuned) != config_hash(config)


def test_every_grpo_problem_is_said_at_once():
    settings = (
        "grpo = { group_size = 3, temperature = 0.0, max_new_tokens = 32, num_iterations = 0, epsilon_low = 1.5, "
        "epsilon_high = -0.1, kl_beta = 0.1, rewards = [{ function = \"exact_match\", weight = 0.0 }] }"
    )
    text = TINY.replace(THIRD, f"{GRPO_THIRD}\n{settings}").replace("refresh_reference = true\n", "").replace(*NO_FADE)
    assert _problems(text) == [
        "stages[2].refresh_reference: a grpo stage compares the policy with the KL reference; refresh it on "
        "entering this stage (or an earlier one)",
        "stages[2].grpo.group_size: training.batch_size 8 (completions a step) is not a multiple of group_size 3",
        "stages[2].grpo.temperature: must be positive (the log-probs are the sampled distribution's), got 0.0",
        "stages[2].grpo.max_new_tokens: must be in [1, block_size - 1 = 31] (the prompt needs a token), got 32",
        "stages[2].grpo.num_iterations: must be >= 1, got 0",
        "stages[2].grpo.epsilon_low: must be in [0, 1], got 1.5",
        "stages[2].grpo.epsilon_high: must be >= 0, got -0.1",
        "stages[2].grpo.rewards[0].weight: must be positive, got 0.0",
    ]


def test_a_grpo_stage_samples_prompts_with_answers(tmp_path):
    rows = tmp_path / "prompts.jsonl"
    rows.write_text('{"q": "1+1=", "a": "2"}\n')
    data = f'\n[data.maths]\nkind = "jsonl"\npath = "{rows}"\nprompt_field = "q"\nanswer_field = "a"\n'
    base = TINY.replace(*NO_FADE)
    ok = base.replace(THIRD, 'strategy = "grpo"\ndatasets = [{ name = "maths", rate = 1.0 }]') + data
    assert loads_config(ok).data["maths"].answer_field == "a"
    grammar = base.replace(THIRD, 'strategy = "grpo"\ndatasets = [{ name = "grammar", rate = 1.0 }]')
    assert [p.split(";")[0] for p in _problems(grammar)] == [
        "stages[2].datasets[0].name: a grpo stage trains on prompts with answers"
    ]


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ("sft = []", "stages[1].sft: expected a table, got a list"),
        ("sft = 3", "stages[1].sft: expected a table, got an integer"),
        ("sft = { packing = 2 }", "stages[1].sft.packing: expected `bool`, got `int`"),
        ("grpo = { rewards = [{ function = 3 }] }", "stages[1].grpo.rewards[0].function: expected `str`, got `int`"),
        ("dpo = { margin = 1.0 }", "stages[1].dpo.margin: unknown key (expected one of: beta, label_smoothing, loss, sft_weight)"),
    ],
)
def test_a_settings_table_of_the_wrong_type_is_one_line_with_its_path(table, problem):
    kind = table.split()[0]  # on a stage of its own kind (another kind's table is said as such: above)
    problems = _problems(TINY.replace(SECOND, f'strategy = "{kind}"\n{SECOND}\n{table}'))
    assert problems[0] == problem
    assert not [p for p in problems[1:] if p.startswith(f"stages[1].{kind}")]  # said once, its path whole


@pytest.mark.parametrize("function", ["judge", "my module:f", "mod:", ":f", "a..b:f", "mod:f(x)"])
def test_a_reward_function_is_a_built_in_or_module_colon_function(function):
    text = TINY.replace(THIRD, f'{GRPO_THIRD}\ngrpo = {{ rewards = [{{ function = "{function}" }}] }}').replace(*NO_FADE)
    assert _problems(text) == [
        f"stages[2].grpo.rewards[0].function: {function!r} is neither a built-in reward (exact_match) nor "
        '"module:function"'
    ]
    fine = text.replace(function, "my_rewards.judge:score")
    assert loads_config(fine).stages[2].grpo.rewards[0].function == "my_rewards.judge:score"
