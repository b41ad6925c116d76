"""Config: TOML round trip, every problem named by its dotted path (all at once), `--set` overrides."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings

from rewind.states.config import Config, ConfigError, RunSection, dumps_config
from rewind.states.config_identity import canonical, config_hash
from rewind.states.config_reading import loads_config
from rewind.states.overrides import apply_overrides, parse_override
from rewind.states.strategies import configs

GOOD = """
[training]
batch_size = 4
tokens = [1000, 2000]
datasets = [[{ name = "grammar" }], [{ name = "sort", rate = 0.5 }, { name = "add", rate = 0.5 }]]

[training.fade]
overlap = 0.5

[optimization.kl]
betas = [0.0, 0.1]
reference_update_stages = [1]
"""


def problems_of(text: str, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        loads_config(text, overrides=overrides)
    return info.value.problems


def only_problem(text: str) -> str:
    problems = problems_of(text)
    assert len(problems) == 1, problems
    return problems[0]


# --- round trip ------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(configs(max_steps=200))
def test_dumps_then_loads_gives_back_the_same_config(config):
    text = dumps_config(config)
    assert loads_config(text) == config
    assert config_hash(loads_config(text)) == config_hash(config)


def test_the_good_example_loads_with_its_values():
    config = loads_config(GOOD)
    assert config.num_stages == 2
    assert config.tokens_per_step == 4 * 64
    assert config.stages[1].datasets[0].rate == 0.5
    assert [s.refresh_reference for s in config.stages] == [False, True]


def test_round_trip_of_a_name_outside_the_basic_multilingual_plane():
    config = msgspec.structs.replace(loads_config(GOOD), run=RunSection(name="run 😀"))
    assert loads_config(dumps_config(config)) == config


def test_round_trip_of_a_non_ascii_dataset_name():
    text = (
        GOOD.replace('name = "grammar"', 'name = "données"')
        + '\n[data."données"]\nkind = "tokens"\npath = "d.bin"\n'
    )
    config = loads_config(text)
    assert loads_config(dumps_config(config)) == config


# --- every problem names its dotted path -------------------------------------------------------------


def test_unknown_keys_are_named_with_their_path():
    problem = only_problem(GOOD.replace("[training.fade]\n", "[training.fade]\novrlap = 0.3\n"))
    assert problem.startswith("training.fade.ovrlap: unknown key")
    assert "overlap" in problem  # the message lists what was meant
    assert only_problem(GOOD + "\n[trainer]\nx = 1\n").startswith("trainer: unknown key")


@pytest.mark.parametrize(
    ("line", "path"),
    [
        ('batch_size = "eight"', "training.batch_size"),
        ("validation_steps = 1.5", "training.validation_steps"),
        ('evaluations = "sort"', "training.evaluations"),
        ("on_nonfinite = 3", "training.on_nonfinite"),
    ],
)
def test_wrong_types_are_named_with_their_path(line, path):
    key = line.split(" = ")[0]
    text = GOOD.replace(f"{key} = 4\n", "") if key == "batch_size" else GOOD
    problem = only_problem(text.replace("[training]\n", f"[training]\n{line}\n"))
    assert problem.startswith(f"{path}: ")


def test_a_wrong_type_deep_inside_a_list_is_named_with_indices():
    problem = only_problem(GOOD.replace('{ name = "sort", rate = 0.5 }', '{ name = "sort", rate = "half" }'))
    assert problem.startswith("training.datasets[1][0].rate: ")


@pytest.mark.parametrize(
    ("edit", "path"),
    [
        (("betas = [0.0, 0.1]", "betas = [0.0, 0.1, 0.2]"), "optimization.kl.betas: expected 2 entries"),
        (
            ("overlap = 0.5", "overlap = 0.5\nper_boundary_overlap = [0.1, 0.2]"),
            "training.fade.per_boundary_overlap",
        ),
        (('datasets = [[{ name = "grammar" }], ', "datasets = ["), "training.datasets: expected 2 entries"),
    ],
)
def test_list_lengths_must_match_the_number_of_stages(edit, path):
    assert only_problem(GOOD.replace(*edit)).startswith(path)


@pytest.mark.parametrize("overlap", ["-0.1", "1.5"])
def test_overlap_must_be_in_the_unit_interval(overlap):
    assert only_problem(GOOD.replace("overlap = 0.5", f"overlap = {overlap}")).startswith(
        "training.fade.overlap: "
    )
    text = GOOD.replace("overlap = 0.5", f"per_boundary_overlap = [{overlap}]")
    assert only_problem(text).startswith("training.fade.per_boundary_overlap[0]: ")


@pytest.mark.parametrize("budget", ["0", "-5"])
def test_stage_budgets_must_be_positive(budget):
    problem = only_problem(GOOD.replace("tokens = [1000, 2000]", f"tokens = [1000, {budget}]"))
    assert problem.startswith("training.tokens[1]: ") and "positive" in problem


def test_no_stages_at_all_is_a_problem():
    problems = problems_of(GOOD.replace("tokens = [1000, 2000]", "tokens = []"))
    assert any(p.startswith("training.tokens: ") for p in problems)


def test_unknown_curve_and_schedule_names_list_the_choices():
    curve = only_problem(GOOD.replace("overlap = 0.5", 'overlap = 0.5\ncurve = "smooth"'))
    assert curve.startswith("training.fade.curve: ") and "linear" in curve and "'smooth'" in curve
    schedule = only_problem(GOOD + '\n[optimization]\nschedule = "onecycle"\n')
    assert schedule.startswith("optimization.schedule: ") and "wsds" in schedule


def test_reference_stages_must_exist():
    problem = only_problem(GOOD.replace("reference_update_stages = [1]", "reference_update_stages = [1, 2]"))
    assert problem.startswith("optimization.kl.reference_update_stages[1]: ") and "out of range" in problem


def test_mixture_rates_must_sum_to_one():
    problem = only_problem(GOOD.replace('{ name = "add", rate = 0.5 }', '{ name = "add", rate = 0.25 }'))
    assert problem.startswith("training.datasets[1]: rates must sum to 1")


def test_unknown_dataset_names_are_named_with_indices_and_the_known_ones():
    problem = only_problem(GOOD.replace('name = "add"', 'name = "ad"'))
    assert problem.startswith("training.datasets[1][1].name: unknown dataset 'ad'")
    assert "grammar" in problem


def test_a_user_dataset_makes_its_name_known():
    text = (
        GOOD.replace('name = "add"', 'name = "corpus"') + '\n[data.corpus]\nkind = "tokens"\npath = "c.bin"\n'
    )
    assert "corpus" in loads_config(text).dataset_names()


def test_invalid_toml_is_one_problem():
    assert only_problem("[training\n").startswith("not valid TOML")
    assert "inline table" not in only_problem("[training\n")


# The shape docs/posttraining.md once showed (before 2ace565): grpo's settings as an inline table over lines.
MULTILINE_GRPO = """
[[stages]]
strategy = "grpo"
tokens = 12_800
datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]
refresh_reference = true    # needed when kl_beta > 0
grpo = { group_size = 4, temperature = 1.0, max_new_tokens = 16, num_iterations = 2, loss_type = "dapo",
         epsilon_low = 0.2, epsilon_high = 0.2, kl_beta = 0.05, kl_estimator = "k3",
         scale_rewards = "group", mask_truncated_completions = false,
         rewards = [{ function = "exact_match", weight = 1.0 }] }
"""


def test_an_inline_table_over_several_lines_gets_a_hint_naming_the_table_to_write():
    problem = only_problem(MULTILINE_GRPO)
    assert problem.startswith(
        "not valid TOML: Invalid initial character for a key part (at line 7, column 105); "
    ), problem
    assert problem.endswith(
        "; line 7 leaves an inline table open, and an inline table must be on one line: "
        "write a [stages.grpo] table instead"
    ), problem
    entries = only_problem('[[stages]]\ndatasets = [{ name = "sort",\n  rate = 1.0 }]\n')
    assert entries.endswith("line 2 leaves an inline table open, and an inline table must be on one line: "
                            "write a [[stages.datasets]] entry for each instead"), entries  # fmt: skip
    nested = only_problem('[data.mine]\nkind = "jsonl"\nsplit = { a = "{", # }\n b = 2 }\n')
    assert nested.endswith("line 3 leaves an inline table open, and an inline table must be on one line: "
                           "write a [data.mine.split] table instead"), nested  # fmt: skip
    # Braces inside strings, comments, and a multi-line array of one-line tables are no such thing.
    for fine in ('a = "{"  # {\nb = = 1\n', "x = [\n  { a = 1 },\n  { b = 2 },\n]\ny = = 1\n"):
        assert "inline table" not in only_problem(fine)


def test_every_problem_is_reported_at_once():
    text = (
        GOOD.replace("overlap = 0.5", 'overlap = 2.0\ncurve = "smooth"')
        .replace("tokens = [1000, 2000]", "tokens = [1000, -1]")
        .replace("reference_update_stages = [1]", "reference_update_stages = [5]")
        .replace('name = "add"', 'name = "ad"')
    )
    problems = problems_of(text + "\n[logging]\nkeep_last = 2\n")
    paths = {p.split(":")[0] for p in problems}
    # The type problems (curve, unknown key) and the cross-field ones (checked on what is left) together.
    assert {
        "training.fade.curve",
        "logging.keep_last",
        "training.tokens[1]",
        "training.fade.overlap",
        "optimization.kl.reference_update_stages[0]",
        "training.datasets[1][1].name",
    } <= paths
    error = ConfigError(problems, "my.toml")
    assert error.lines() == [f"my.toml: {p}" for p in problems]
    assert str(error).startswith("my.toml: ")


def test_a_mistyped_field_is_not_reported_twice():
    problems = problems_of(GOOD.replace("tokens = [1000, 2000]", 'tokens = [1000, "lots"]'))
    # The length rules need the stage count, which is unknown once `tokens` is wrong: one problem only.
    assert problems == [p for p in problems if p.startswith("training.tokens[1]: ")] and len(problems) == 1


# --- --set overrides ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "path", "value"),
    [
        ("training.fade.overlap=0.25", ["training", "fade", "overlap"], 0.25),
        ("training.batch_size = 16", ["training", "batch_size"], 16),
        ("training.tokens=[10, 20]", ["training", "tokens"], [10, 20]),
        ('run.name="a b"', ["run", "name"], "a b"),
        ("run.name=plain-word", ["run", "name"], "plain-word"),  # bare words fall back to strings
        ("architecture.activation_checkpointing=true", ["architecture", "activation_checkpointing"], True),
        ("run.name=x=y", ["run", "name"], "x=y"),  # only the first '=' separates
    ],
)
def test_parse_override(text, path, value):
    assert parse_override(text) == (path, value)


@pytest.mark.parametrize("text", ["no-equals", "=3", "a..b=1", ".a=1", "a.=1"])
def test_malformed_overrides_are_config_errors(text):
    with pytest.raises(ConfigError) as info:
        parse_override(text)
    assert info.value.source == "override" and "dotted.key=VALUE" in info.value.problems[0]


def test_apply_overrides_creates_tables_and_leaves_the_input_alone():
    raw = {"training": {"fade": {"overlap": 0.5}, "tokens": [1]}, "run": "not a table"}
    merged = apply_overrides(raw, ["training.fade.curve=cosine", "optimization.kl.betas=[0.1]", "run.seed=3"])
    assert merged["training"]["fade"] == {"overlap": 0.5, "curve": "cosine"}
    assert merged["optimization"] == {"kl": {"betas": [0.1]}}
    assert merged["run"] == {"seed": 3}  # a non-table in the way is replaced
    assert raw == {"training": {"fade": {"overlap": 0.5}, "tokens": [1]}, "run": "not a table"}


def test_later_overrides_win():
    assert apply_overrides({}, ["a.b=1", "a.b=2"]) == {"a": {"b": 2}}


@pytest.mark.parametrize(
    ("text", "path"),
    [
        ("training.tokens[1]=5", ["training", "tokens", 1]),
        ("training.datasets[2][0].name=sort", ["training", "datasets", 2, 0, "name"]),
        ("optimization.kl.betas[0] = 0.5", ["optimization", "kl", "betas", 0]),
    ],
)
def test_parse_override_reads_the_indexed_paths_that_problems_print(text, path):
    assert parse_override(text)[0] == path


@pytest.mark.parametrize("text", ["a[x]=1", "a[-1]=1", "a[1=1", "[0]=1", "a.[0]=1", "a[0]b=1", "a b=1"])
def test_malformed_indexed_paths_are_config_errors(text):
    with pytest.raises(ConfigError) as info:
        parse_override(text)
    assert "[i]" in info.value.problems[0]


def test_indexed_overrides_set_list_entries_the_problems_name():
    """A path printed by a problem can be pasted into --set to fix exactly that entry."""
    text = GOOD.replace('{ name = "add", rate = 0.5 }', '{ name = "nope", rate = 0.5 }')
    problem = only_problem(text)
    path = problem.split(":")[0]
    assert path == "training.datasets[1][1].name"
    config = loads_config(text, overrides=[f"{path}=add", "training.tokens[1]=3000", "optimization.kl.betas[1]=0.25"])
    assert config.stages[1].datasets[1].name == "add"
    assert [s.tokens for s in config.stages] == [1000, 3000]
    assert [s.beta for s in config.stages] == [0.0, 0.25]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("training.tokens[2]=5", "training.tokens[2]: index out of range (training.tokens has 2 entries)"),
        ("training.datasets[0][3].name=add", "training.datasets[0][3]: index out of range"),
        ("training.batch_size[0]=1", "training.batch_size is not a list"),
        ("training.tokens.first=1", "training.tokens is not a table"),
        ("optimization.kl.betas[0]=0.5", "optimization.kl.betas is not set"),
    ],
)
def test_an_index_that_names_no_entry_is_one_problem_naming_the_path(override, needle):
    problems = problems_of(GOOD.replace("betas = [0.0, 0.1]", ""), overrides=[override])
    assert len(problems) == 1 and needle in problems[0] and problems[0].startswith(f"--set {override!r}: ")


def test_every_bad_override_is_reported_at_once_and_the_input_is_left_alone():
    raw = {"training": {"tokens": [1]}}
    with pytest.raises(ConfigError) as info:
        apply_overrides(raw, ["training.tokens[5]=1", "no-equals", "training.tokens[0]=2"])
    assert len(info.value.problems) == 2 and info.value.source == "override"
    assert raw == {"training": {"tokens": [1]}}


def test_overrides_are_validated_like_the_file():
    config = loads_config(GOOD, overrides=["training.fade.overlap=0.0", "training.batch_size=2"])
    assert config.training.fade.overlap == 0.0 and config.training.batch_size == 2
    problems = problems_of(GOOD, overrides=["training.fade.overlap=3", "training.batchsize=2"])
    assert {p.split(":")[0] for p in problems} == {"training.fade.overlap", "training.batchsize"}


def test_config_hash_changes_with_any_field():
    config = loads_config(GOOD)
    assert config_hash(config) == config_hash(loads_config(GOOD))
    changed = loads_config(GOOD, overrides=["run.seed=1"])
    assert config_hash(changed) != config_hash(config)
    assert isinstance(config, Config)


def test_config_hash_ignores_fields_left_at_their_default():
    """A release that adds a field with a default must not change any existing config's identity; a
    field set explicitly to its default is the same config as one that leaves it out."""
    assert config_hash(loads_config(GOOD)) == config_hash(loads_config(GOOD, overrides=["architecture.rope_base=10000.0"]))

    class Before(msgspec.Struct, frozen=True, kw_only=True):
        lr: float = 3e-4
        layers: list[int] = []

    class After(msgspec.Struct, frozen=True, kw_only=True):  # the next release adds a field
        lr: float = 3e-4
        layers: list[int] = []
        mlp: str = "gelu"

    assert canonical(Before(lr=0.1, layers=[2])) == canonical(After(lr=0.1, layers=[2])) == {"lr": 0.1, "layers": [2]}
    # A changed default is a changed config for exactly the configs that relied on it.
    assert canonical(After(mlp="swiglu")) != canonical(Before())


@given(configs())
def test_config_hash_is_the_hash_of_the_canonical_form_and_round_trips(config):
    assert config_hash(config) == config_hash(loads_config(dumps_config(config)))
    assert config_hash(msgspec.convert(canonical(config), Config)) == config_hash(config)


def test_config_identity_tells_non_finite_floats_apart_and_ignores_the_sign_of_zero_and_field_order():
    base = loads_config(GOOD)

    def with_(**fields):
        return msgspec.structs.replace(base, optimization=msgspec.structs.replace(base.optimization, **fields))

    hashes = {config_hash(with_(grad_clip=v)) for v in (float("nan"), float("inf"), float("-inf"), 1.0)}
    assert len(hashes) == 4
    assert config_hash(with_(min_lr_ratio=-0.0)) == config_hash(with_(min_lr_ratio=0.0))
    assert config_hash(with_(weight_decay=-0.0)) == config_hash(base)  # -0.0 is the default 0.0
    assert list(canonical(base)) == sorted(canonical(base))
    assert all(list(v) == sorted(v) for v in canonical(base).values() if isinstance(v, dict))


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("optimization.lr=nan", "optimization.lr: must be a finite number, got nan"),
        ("optimization.weight_decay=inf", "optimization.weight_decay: must be a finite number, got inf"),
        ("training.fade.steepness=nan", "training.fade.steepness: must be a finite number, got nan"),
        ("architecture.dropout=nan", "architecture.dropout: must be a finite number, got nan"),
        ("optimization.kl.betas=[0.0, nan]", "optimization.kl.betas[1]: must be a finite number, got nan"),
        ("optimization.beta1=1.5", "optimization.beta1: must be in [0, 1), got 1.5"),
        ("optimization.beta2=1.0", "optimization.beta2: must be in [0, 1), got 1.0"),
        ("optimization.eps=-1", "optimization.eps: must be positive, got -1"),
        ("architecture.rope_base=0", "architecture.rope_base: must be positive, got 0"),
        ("run.seed=18446744073709551616", "run.seed: must be in [0, 2**64), got 18446744073709551616"),
        ("run.seed=-1", "run.seed: must be in [0, 2**64), got -1"),
    ],
)
def test_every_numeric_field_is_checked_nan_and_infinity_included(override, expected):
    """Found by adversarial runs: these passed validation and died later with a traceback (or, for a
    NaN rate in a later stage, 80 steps into the run). Each is one problem, said once."""
    problems = problems_of(GOOD, overrides=[override])
    assert [p.split(": ", 1)[0] for p in problems] == [expected.split(": ", 1)[0]]
    assert problems[0].startswith(expected.rsplit(" ", 1)[0])


def test_a_nan_mixture_rate_is_caught_although_the_rates_sum_rule_cannot_see_it():
    text = GOOD.replace('{ name = "add", rate = 0.5 }', '{ name = "add", rate = nan }')
    assert text != GOOD
    assert any(".rate: must be a finite number, got nan" in p for p in problems_of(text))
