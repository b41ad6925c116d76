"""At most MAX_STAGES stages: a config with more is one line by field path (exit 2) before any schedule is
built, and a log whose RunStarted (or a fork's seed) carries more is refused by the trust checks in one
line (exit 1) by every command that reads it. Before the bound, 4,000 stages in a 170 KB log cost
`log --steps 1:2` 43 s, `state` 177 s and `verify` 85 s; the config is refused here before its schedule
is built, whatever the cost of building it."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec
import pytest

from rewind.states import schedule as schedule_module
from rewind.states.check_stages import MAX_STAGES
from rewind.states.config import Config
from rewind.states.config_identity import config_hash
from rewind.states.events import RUN_FEATURES, RunResumed, RunStarted, StageEntered, StepCommitted
from rewind.states.stageform import to_stage_form
from rewind.states.state import ForkSeed
from rewind.stores.eventlog import EventLog
from rewind.stores.trust import RecordChecker
from tests.engine.test_loop import run_cli

TOO_MANY = MAX_STAGES + 1


def config_text(num_stages: int) -> str:
    stages = ", ".join(["64"] * num_stages)
    mixtures = ", ".join(['[{ name = "grammar" }]'] * num_stages)
    return f"""
[architecture]
block_size = 8
[training]
batch_size = 4
tokens = [{stages}]
datasets = [{mixtures}]
"""


@pytest.fixture
def no_schedule(monkeypatch):
    """Building a schedule fails the test: the bound is said before one is built."""

    def refuse(self, *args, **kwargs):
        raise AssertionError("a schedule was built")

    monkeypatch.setattr(schedule_module.Schedule, "__init__", refuse)


def test_a_config_with_too_many_stages_is_one_line_by_field_path(tmp_path, no_schedule):
    (tmp_path / "many.toml").write_text(config_text(TOO_MANY))
    for command in (["schedule"], ["schedule", "--check"], ["train", "--run-dir", tmp_path / "run"]):
        code, out, err = run_cli(command[0], tmp_path / "many.toml", *command[1:])
        assert code == 2 and out == "", err
        assert (
            err
            == f"rewind: {tmp_path / 'many.toml'}: training.tokens: at most 1,000 stages (one budget each), got 1,001\n"
        )
    assert not (tmp_path / "run").exists()


def forged_run(run: Path, num_stages: int) -> None:
    """A log written by rewind's own writer whose RunStarted carries a config of `num_stages` stages
    (decoded without the config check, as a log's record is), a stage entered and two steps."""
    config = msgspec.convert(to_stage_form(tomllib.loads(config_text(num_stages)))[0], Config)
    tps = config.tokens_per_step
    with EventLog.open(run, "w") as log:
        log.append(
            RunStarted(
                step=0, tokens=0, config=config, config_hash=config_hash(config), features=list(RUN_FEATURES)
            )
        )
        log.append(StageEntered(step=0, tokens=0, stage=0))
        for k in (1, 2):
            rows = [4] + [0] * (num_stages - 1)
            log.append(
                StepCommitted(
                    step=k,
                    tokens=k * tps,
                    stage=0,
                    lr=1e-3,
                    beta=0.0,
                    loss=2.0,
                    rows=rows,
                    cursors={"grammar": 4 * k},
                )
            )
        log.commit()


def test_a_forged_log_with_too_many_stages_is_refused_by_every_reader_in_one_line(tmp_path, no_schedule):
    forged_run(tmp_path / "run", TOO_MANY)
    expect = "its config is not one rewind accepts: stages: at most 1,000 stages (one budget each), got 1,001"
    for command in (["log", "--steps", "1:2"], ["state"], ["timeline"], ["resume", "--no-progress"]):
        code, out, err = run_cli(command[0], tmp_path / "run", *command[1:])
        assert code == 1 and len(err.strip().splitlines()) == 1, (command, out, err)
        assert f"event log record 0 (RunStarted at step 0): {expect}" in err
    code, out, err = run_cli("verify", tmp_path / "run")
    assert (
        code == 1
        and err == ""
        and any(line.startswith("PROBLEM") and expect in line for line in out.splitlines())
    )


def test_a_run_at_the_bound_is_read_as_any_other(tmp_path):
    forged_run(tmp_path / "run", MAX_STAGES)
    for command in (["log", "--steps", "1:2"], ["state"], ["verify"]):
        code, _, err = run_cli(command[0], tmp_path / "run", *command[1:])
        assert code == 0, (command, err)


@pytest.mark.parametrize("field", ["num_stages", "fades_started", "pending_refreshes"])
def test_a_fork_seed_with_more_stages_than_a_config_may_have_is_refused(field):
    config = msgspec.convert(to_stage_form(tomllib.loads(config_text(3)))[0], Config)
    checker = RecordChecker(config)
    value = TOO_MANY if field == "num_stages" else list(range(TOO_MANY))
    seed = ForkSeed(stage=0, num_stages_entered=1, **{field: value})
    resumed = RunResumed(
        step=0, tokens=0, checkpoint="", superseded_first_seq=2, superseded_last_seq=1, seed=seed
    )
    assert (
        checker.problem(resumed) == "the fork seed holds more than 1,000 stages (the most a config may have)"
    )
    assert (
        checker.problem(msgspec.structs.replace(resumed, seed=ForkSeed(stage=0, num_stages_entered=1))) == ""
    )
