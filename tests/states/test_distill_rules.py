"""The distill stage kind's rules (rewind.states.stagekinds.distill): what a distill stage must hold (a
reference refreshed at or before it when the teacher is the reference, no fade into or out of it, no
token-level beta, a group size that divides the batch, a usable temperature and completion length, a
window of at least one update), a [stages.distill] table only on a distill stage, and a config with a
distill stage that keeps its identity through its TOML form. DISTILL is also the small run the engine's
distill tests train (tests/engine/test_distill.py)."""

from __future__ import annotations

import pytest

from rewind.states.config import dumps_config
from rewind.states.config_error import ConfigError
from rewind.states.config_identity import config_hash
from rewind.states.config_reading import loads_config
from rewind.states.plan import rollout_settings
from rewind.states.stagekinds import rules_of
from rewind.states.stages import DistillSettings, DistillStage

# 2 pretraining steps, 2 sft steps on sort (entering it refreshes the reference: the teacher), then 6
# distill steps (4 prompts x 2 completions each, windows of 2 at steps 4, 6 and 8); a checkpoint every 3.
DISTILL = """\
[run]
name = "distill-test"
seed = 7

[architecture]
block_size = 32
vocab_size = 256
num_layers = 2
num_heads = 2
d_model = 32

[training]
batch_size = 8

[training.fade]
overlap = 0.0

[optimization]
lr = 3e-3
schedule = "constant"

[logging]
report_interval = 3
checkpoint_interval = 3

[[stages]]
tokens = 512
datasets = [{ name = "grammar", rate = 1.0 }]

[[stages]]
strategy = "sft"
tokens = 512
datasets = [{ name = "sort", rate = 1.0 }]
refresh_reference = true

[[stages]]
strategy = "distill"
tokens = 1_536
datasets = [{ name = "sort", rate = 1.0 }]
distill = { group_size = 2, max_new_tokens = 8, num_iterations = 2 }
"""
SETTINGS = "distill = { group_size = 2, max_new_tokens = 8, num_iterations = 2 }"


def _with(settings: str, text: str = DISTILL) -> str:
    return text.replace(SETTINGS, settings)


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        loads_config(text)
    return caught.value.problems


def test_the_small_run_loads_as_a_distill_stage_with_its_settings():
    stage = loads_config(DISTILL).stages[2]
    assert isinstance(stage, DistillStage) and stage.strategy == "distill"
    assert stage.distill == DistillSettings(teacher="reference", group_size=2, max_new_tokens=8, num_iterations=2)
    rules = rules_of(stage)
    assert rules.reads == "prompts" and not rules.mixes and rules.rollout_window(stage) == 2
    tie = rules.reference_tie(stage)  # the loss is the tie: no KL penalty on top
    assert (tie.setting, tie.value, tie.penalty) == ("distill.teacher", 1.0, 0.0)
    assert tie.text() == "distill.teacher 1 (its loss; no KL penalty added)"
    assert rules.loss_label(stage) == "reverse KL to the teacher"


def test_a_teacher_from_a_file_is_not_tied_to_the_reference_and_needs_no_refresh():
    text = _with('distill = { teacher = "teachers/expert", group_size = 2 }').replace(
        "refresh_reference = true\n", ""
    )
    stage = loads_config(text).stages[2]
    assert stage.distill.teacher == "teachers/expert"
    tie = rules_of(stage).reference_tie(stage)
    assert (tie.setting, tie.value, tie.penalty, tie.text()) == ("beta", 0.0, 0.0, "beta 0")


def test_the_reference_as_teacher_without_a_refresh_at_or_before_the_stage_is_a_problem():
    text = DISTILL.replace("refresh_reference = true\n", "")
    assert _problems(text) == [
        "stages[2].refresh_reference: a distill stage compares the policy with the KL reference; refresh it on "
        "entering this stage (or an earlier one)"
    ]
    at_the_stage = text.replace(SETTINGS, f"refresh_reference = true\n{SETTINGS}")
    assert loads_config(at_the_stage).stages[2].refresh_reference  # at the stage itself: enough


def test_no_fade_into_or_out_of_a_distill_stage():
    into = DISTILL.replace("[training.fade]\noverlap = 0.0", "[training.fade]\noverlap = 0.5")
    after = 'overlap = 0.5\n\n[[stages]]\ntokens = 512\ndatasets = [{ name = "grammar", rate = 1.0 }]\n'
    out_of = DISTILL.replace(SETTINGS, f"{SETTINGS}\n{after}")
    assert [p for p in _problems(into) if "fade" in p] == [
        "stages[1].overlap: no fade into a distill stage (its rows are its own), got 0.5; set overlap = 0 on stages[1]"
    ]
    assert _problems(out_of) == [
        "stages[2].overlap: no fade out of a distill stage (its rows are its own), got 0.5; set overlap = 0 on stages[2]"
    ]


def test_a_token_level_beta_on_a_distill_stage_is_a_problem():
    assert _problems(_with(f"beta = 0.1\n{SETTINGS}")) == [
        "stages[2].beta: a distill stage's loss is the KL to its teacher; its token-level KL beta must be 0"
    ]


def test_a_group_size_must_divide_the_batch_and_be_at_least_one():
    assert _problems(_with("distill = { group_size = 3 }")) == [
        "stages[2].distill.group_size: training.batch_size 8 (completions a step) is not a multiple of group_size 3"
    ]
    assert _problems(_with("distill = { group_size = 0 }")) == ["stages[2].distill.group_size: at least 1, got 0"]
    assert loads_config(_with("distill = { group_size = 8 }")).stages[2].distill.group_size == 8


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        ("temperature = 0.0", "stages[2].distill.temperature: must be positive (the log-probs are the sampled "
         "distribution's), got 0.0"),
        ("temperature = -1.0", "stages[2].distill.temperature: must be positive (the log-probs are the sampled "
         "distribution's), got -1.0"),
        ("temperature = 0.001", "stages[2].distill.temperature: must be at least 0.01 (the log-probs and the "
         "importance ratio move 1/T times as fast as the float32 logits), got 0.001"),
        ("max_new_tokens = 0", "stages[2].distill.max_new_tokens: must be in [1, block_size - 1 = 31] (the prompt "
         "needs a token), got 0"),
        ("max_new_tokens = 32", "stages[2].distill.max_new_tokens: must be in [1, block_size - 1 = 31] (the prompt "
         "needs a token), got 32"),
        ("num_iterations = 0", "stages[2].distill.num_iterations: must be >= 1, got 0"),
        ('teacher = " "', 'stages[2].distill.teacher: "reference" or the directory of a model.safetensors of this '
         "architecture"),
    ],
)  # fmt: skip
def test_each_setting_out_of_its_range_is_one_problem_naming_it(settings, problem):
    assert _problems(_with(f"distill = {{ group_size = 2, {settings} }}")) == [problem]


@pytest.mark.parametrize("settings", ["temperature = 0.01", "max_new_tokens = 1", "max_new_tokens = 31"])
def test_the_edges_of_the_ranges_load(settings):
    loads_config(_with(f"distill = {{ group_size = 2, {settings} }}"))


def test_a_distill_table_on_a_pretrain_stage_is_a_problem():
    text = DISTILL.replace(
        'tokens = 512\ndatasets = [{ name = "grammar", rate = 1.0 }]',
        'tokens = 512\ndatasets = [{ name = "grammar", rate = 1.0 }]\ndistill = { group_size = 2 }',
    )
    assert _problems(text) == ["stages[0].distill: settings of a distill stage, but this stage's strategy is 'pretrain'"]


def test_a_distill_stage_reads_prompts_with_answers_and_predicts_left_to_right():
    grammar = DISTILL.replace(
        'strategy = "distill"\ntokens = 1_536\ndatasets = [{ name = "sort", rate = 1.0 }]',
        'strategy = "distill"\ntokens = 1_536\ndatasets = [{ name = "grammar", rate = 1.0 }]',
    )
    assert _problems(grammar) == [
        "stages[2].datasets[0].name: a distill stage trains on prompts with answers; 'grammar' has none (use a "
        "task, or a jsonl / parquet dataset with prompt_field and answer_field)"
    ]
    mlm = DISTILL + '\n[objective]\nkind = "mlm"\n'
    assert any(p.startswith("stages[2].strategy: a distill stage predicts its responses left to right") for p in _problems(mlm))


def test_every_problem_of_a_distill_stage_is_said_at_once():
    text = DISTILL.replace("refresh_reference = true\n", "")
    problems = _problems(_with("beta = 0.2\ndistill = { group_size = 3, temperature = 0.0, num_iterations = 0 }", text))
    assert [p.split(":")[0] for p in problems] == [
        "stages[2].refresh_reference", "stages[2].beta", "stages[2].distill.group_size",
        "stages[2].distill.temperature", "stages[2].distill.num_iterations",
    ]  # fmt: skip


def test_a_config_with_a_distill_stage_keeps_its_identity_through_its_toml():
    for text in (DISTILL, _with('distill = { teacher = "expert", group_size = 4, temperature = 0.7 }')):
        config = loads_config(text)
        again = loads_config(dumps_config(config))
        assert again == config and config_hash(again) == config_hash(config)
    base = loads_config(DISTILL)
    others = [
        _with('distill = { teacher = "expert", group_size = 2, max_new_tokens = 8, num_iterations = 2 }'),
        _with("distill = { group_size = 4, max_new_tokens = 8, num_iterations = 2 }"),
        _with("distill = { group_size = 2, max_new_tokens = 8, num_iterations = 1 }"),
    ]
    assert len({config_hash(base), *(config_hash(loads_config(t)) for t in others)}) == 4
    spelled = _with('[stages.distill]\nteacher = "reference"\ngroup_size = 2\nmax_new_tokens = 8\nnum_iterations = 2\n'
                    "temperature = 1.0")  # fmt: skip
    assert config_hash(loads_config(spelled)) == config_hash(base)  # the defaults spelled out: the same run


def test_what_shapes_a_batch_is_its_sampling_and_its_teacher_not_the_number_of_updates():
    digest = rollout_settings(loads_config(DISTILL), 2)
    for settings in (
        "group_size = 4, max_new_tokens = 8",
        "group_size = 2, max_new_tokens = 6",
        "group_size = 2, max_new_tokens = 8, temperature = 0.5",
        'group_size = 2, max_new_tokens = 8, teacher = "expert"',  # its log-probs and rewards are the teacher's
    ):
        assert rollout_settings(loads_config(_with(f"distill = {{ {settings} }}")), 2) != digest, settings
    updates = loads_config(_with("distill = { group_size = 2, max_new_tokens = 8, num_iterations = 3 }"))
    assert rollout_settings(updates, 2) == digest
