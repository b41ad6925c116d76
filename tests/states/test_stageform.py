"""A stage as a `[[stages]]` record, and the flat per-stage lists it replaced: both forms read as the same
Config with the same identity, a flat config's problems name the entries written, mixing is one problem."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings

from rewind.states.config import Config, ConfigError, dumps_config
from rewind.states.config_identity import config_differences, config_hash, identity
from rewind.states.config_reading import config_from_dict, loads_config
from rewind.states.overrides import apply_overrides
from rewind.states.stageform import flat_for_overrides
from rewind.states.strategies import configs
from rewind.states.tomlwrite import dumps

RECORDS = """
[training]
batch_size = 4

[[stages]]
tokens = 1000
datasets = [{ name = "grammar" }]

[[stages]]
tokens = 2000
datasets = [{ name = "sort", rate = 0.5 }, { name = "add", rate = 0.5 }]
beta = 0.1
refresh_reference = true

[[stages]]
tokens = 500
datasets = [{ name = "reverse" }]
reset_optimizer = true
"""
FLAT = """
[training]
batch_size = 4
tokens = [1000, 2000, 500]
datasets = [[{ name = "grammar" }], [{ name = "sort", rate = 0.5 }, { name = "add", rate = 0.5 }], [{ name = "reverse" }]]

[optimization]
reset_optimizer_stages = [2]

[optimization.kl]
betas = [0.0, 0.1, 0.0]
reference_update_stages = [1]
"""


def problems_of(text: str, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        loads_config(text, overrides=overrides)
    return caught.value.problems


def as_flat(config: Config) -> dict[str, Any]:
    """The config written with the flat per-stage lists, derived here as a user of rewind 0.3 wrote them."""
    raw = msgspec.to_builtins(config)
    stages = raw.pop("stages")
    training, opt = raw["training"], raw["optimization"]
    training["tokens"] = [s["tokens"] for s in stages]
    training["datasets"] = [s["datasets"] for s in stages]
    if any(s.get("beta") is not None for s in stages):
        opt["kl"]["betas"] = [s.get("beta") or 0.0 for s in stages]
    opt["kl"]["reference_update_stages"] = [i for i, s in enumerate(stages) if s["refresh_reference"]]
    opt["reset_optimizer_stages"] = [i for i, s in enumerate(stages) if s["reset_optimizer"]]
    if any(s.get("overlap") is not None for s in stages[:-1]):
        overlap = training["fade"]["overlap"]
        training["fade"]["per_boundary_overlap"] = [
            overlap if s.get("overlap") is None else s["overlap"] for s in stages[:-1]
        ]
    return raw


@settings(max_examples=150, deadline=None)
@given(configs())
def test_the_flat_and_the_record_form_of_a_config_are_one_config_with_one_hash(config):
    flat = config_from_dict(as_flat(config))
    records = loads_config(dumps_config(config))
    assert flat == records == config
    assert config_hash(flat) == config_hash(records) == config_hash(config)
    # The identity holds the stages as the flat lists, each only where the flat form had it non-empty.
    written = identity(flat)
    assert "stages" not in written
    assert written["training"]["tokens"] == [s.tokens for s in config.stages]
    betas = written.get("optimization", {}).get("kl", {}).get("betas")
    assert (betas is None) == all(s.beta is None for s in config.stages)


@settings(max_examples=50, deadline=None)
@given(configs())
def test_a_flat_override_on_a_record_config_means_what_it_meant_on_a_flat_one(config):
    budgets = [s.tokens + 1 for s in config.stages]
    by_records = loads_config(dumps_config(config), overrides=[f"training.tokens={budgets}"])
    by_lists = loads_config(dumps(as_flat(config)), overrides=[f"training.tokens={budgets}"])
    assert [s.tokens for s in by_records.stages] == budgets
    assert by_records == by_lists
    # As `rewind fork --set` applies it: to the parent's logged config, as builtins (None where left out).
    sets = [f"training.tokens={budgets}"]
    forked = config_from_dict(apply_overrides(flat_for_overrides(msgspec.to_builtins(config), sets), sets))
    assert forked == by_records


def test_the_two_forms_read_as_one_config():
    assert loads_config(RECORDS) == loads_config(FLAT)
    assert config_hash(loads_config(RECORDS)) == config_hash(loads_config(FLAT))
    assert config_differences(loads_config(FLAT), loads_config(RECORDS)) == []


def test_a_beta_left_out_is_zero_once_any_stage_gives_one_and_none_otherwise():
    config = loads_config(RECORDS)
    assert [s.beta for s in config.stages] == [0.0, 0.1, 0.0]
    no_kl = loads_config(RECORDS.replace("beta = 0.1\n", ""))
    assert [s.beta for s in no_kl.stages] == [None, None, None]
    # betas = [] and betas of zeros were two configs (two hashes) before records, and stay two.
    zeros = loads_config(RECORDS.replace("beta = 0.1", "beta = 0.0"))
    assert config_hash(zeros) != config_hash(no_kl)


def test_an_overlap_left_out_is_the_fades_once_any_stage_gives_one():
    fade = "\n[training.fade]\noverlap = 0.3\n"
    text = RECORDS.replace("refresh_reference = true", "refresh_reference = true\noverlap = 0.5")
    config = loads_config(text.replace("batch_size = 4\n", "batch_size = 4\n" + fade))
    assert [s.overlap for s in config.stages] == [0.3, 0.5, None]
    flat = FLAT + fade + "per_boundary_overlap = [0.3, 0.5]\n"
    assert loads_config(flat) == config and config_hash(loads_config(flat)) == config_hash(config)


def test_a_stage_name_or_strategy_is_part_of_the_identity_only_when_set():
    plain = loads_config(RECORDS)
    assert config_hash(
        loads_config(RECORDS.replace("tokens = 500", 'strategy = "pretrain"\ntokens = 500'))
    ) == config_hash(plain)
    named = loads_config(RECORDS.replace("tokens = 500", 'name = "C"\ntokens = 500'))
    assert config_hash(named) != config_hash(plain)
    assert identity(named)["stages"] == [{}, {}, {"name": "C"}]


def test_growth_may_name_the_stage_it_joins_at():
    growth = '\n[[growth]]\nat_stage = "C"\n'
    named = loads_config(RECORDS.replace("tokens = 500", 'name = "C"\ntokens = 500') + growth)
    assert named.growth[0].at_stage == 2
    (problem,) = problems_of(RECORDS + growth)
    assert problem.startswith("growth[0].at_stage: no stage is named 'C'")


def test_both_forms_in_one_file_are_one_problem():
    (problem,) = problems_of(RECORDS + "\n[optimization.kl]\nbetas = [0.0, 0.1, 0.2]\n")
    assert problem.startswith("stages: the stages are given twice") and "optimization.kl.betas" in problem


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (("tokens = 500", "tokens = 0"), "stages[2].tokens: stage budget must be positive, got 0"),
        (("beta = 0.1", "beta = -0.1"), "stages[1].beta: must be >= 0, got -0.1"),
        (('{ name = "reverse" }', '{ name = "nope" }'), "stages[2].datasets[0].name: unknown dataset 'nope'"),
        (
            ("reset_optimizer = true", "reset_optimizer = true\noverlap = 0.5"),
            "stages[2].overlap: the last stage",
        ),
        (
            ("tokens = 1000", "tokens = 1000\nreset_optimizer = true"),
            "stages[0].reset_optimizer: stage 0 has",
        ),
        (("tokens = 500", 'name = "x"\ntokens = 500'), None),
        (("tokens = 1000", "tokens = 1000\nrate = 1.0"), "stages[0].rate: unknown key"),
    ],
)
def test_each_record_is_checked_by_its_path(edit, expected):
    text = RECORDS.replace(*edit)
    if expected is None:
        assert loads_config(text).stages[2].name == "x"
        (problem,) = problems_of(text.replace("tokens = 1000", 'name = "x"\ntokens = 1000'))
        assert problem.startswith("stages[2].name: 'x' names an earlier stage too")
        return
    (problem,) = problems_of(text)
    assert problem.startswith(expected), problem


def test_a_flat_configs_problems_name_the_entries_written_all_at_once():
    text = FLAT.replace("tokens = [1000, 2000, 500]", "tokens = [1000, 0, 500]").replace(
        "betas = [0.0, 0.1, 0.0]", "betas = [0.0, -0.1, 0.0]"
    )
    problems = problems_of(text.replace('{ name = "reverse" }', '{ name = "nope" }'))
    assert {p.split(":")[0] for p in problems} == {
        "training.tokens[1]",
        "optimization.kl.betas[1]",
        "training.datasets[2][0].name",
    }


def test_a_flat_override_on_named_records_is_refused_in_one_line():
    text = RECORDS.replace("tokens = 500", 'name = "C"\ntokens = 500')
    with pytest.raises(ConfigError) as caught:
        loads_config(text, overrides=["training.tokens=[1, 2, 3]"])
    (problem,) = caught.value.problems
    assert caught.value.source == "override" and "set stages[i] fields instead" in problem


def test_differences_name_the_stage_field():
    a = loads_config(RECORDS)
    b = loads_config(
        RECORDS,
        overrides=[
            "stages[1].beta=0.3",
            "stages[1].datasets[0].rate=0.25",
            "stages[1].datasets[1].rate=0.75",
        ],
    )
    assert config_differences(a, b) == [
        "stages[1].datasets[0].rate: 0.5 -> 0.25",
        "stages[1].datasets[1].rate: 0.5 -> 0.75",
        "stages[1].beta: 0.1 -> 0.3",
    ]


def test_dumps_writes_each_stage_as_a_record():
    text = dumps_config(loads_config(FLAT))
    assert text.count("[[stages]]") == 3 and "tokens = [" not in text and "beta" in text
