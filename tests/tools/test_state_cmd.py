"""`rewind state`: the folded control state now, after a step (effective records) or after a log record
(raw records), with the schedule's plan for the next step; resumes, stops and forks; bad input.

The runs with resumes are built once per test session (see `cached_run`); test_timeline_cmd uses them too.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from rewind.states.events import ConfigChanged, RunResumed, RunStarted, RunStopped, StepCommitted
from rewind.states.fold import fold
from rewind.states.history import effective
from rewind.states.schedule import Schedule
from rewind.stores.eventlog import EventLog
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import (
    OVERRIDES,
    config_of,
    events_of,
    interrupt_before,
    one_line,
    run_cli,
    train_args,
)

# --- runs shared with test_timeline_cmd ---------------------------------------------------------------


def cached_run(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """A run built once per test session (like `straight_run`). Copy it before changing it."""
    base = tmp_path_factory.getbasetemp()
    run, done = base / name, base / f"{name}.done"
    if not done.exists():
        shutil.rmtree(run, ignore_errors=True)  # a previous attempt that failed half way
        build(run)
        done.touch()
    return run


def superseded_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ctrl-C twice just before the step with index 6 (steps 5 and 6 committed after the step-4
    checkpoint, then a hard stop), resumed to the end: the records of steps 5 and 6 are superseded."""

    def build(run: Path) -> None:
        overrides = (*OVERRIDES, "logging.report_interval=1")  # commit the log at every step
        with pytest.MonkeyPatch.context() as patch:
            interrupt_before(patch, step_index=6, times=2)
            code, _, err = run_cli(*train_args(run, overrides=overrides))
        assert code == 130, err
        code, _, err = run_cli(*train_args(run, overrides=overrides))
        assert code == 0, err

    return cached_run(tmp_path_factory, "superseded-run", build)


def stopped_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Stopped cleanly by --max-steps 6 (a stop checkpoint at step 6, then RunStopped)."""

    def build(run: Path) -> None:
        code, _, err = run_cli(*train_args(run, "--max-steps", "6"))
        assert code == 0, err

    return cached_run(tmp_path_factory, "stopped-run", build)


FORK_LR = 1e-3


def forked_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stopped run resumed to the end under a config with another peak LR (RunResumed, ConfigChanged)."""
    stopped = stopped_run(tmp_path_factory)

    def build(run: Path) -> None:
        shutil.copytree(stopped, run)
        code, _, err = run_cli(
            *train_args(run, "--fork", overrides=(*OVERRIDES, f"optimization.lr={FORK_LR}"))
        )
        assert code == 0, err

    return cached_run(tmp_path_factory, "forked-run", build)


@pytest.fixture(scope="module")
def superseded(tmp_path_factory) -> Path:
    return superseded_run(tmp_path_factory)


@pytest.fixture(scope="module")
def forked(tmp_path_factory) -> Path:
    return forked_run(tmp_path_factory)


def state_json(run: Path, *args: object) -> dict:
    code, out, err = run_cli("state", run, "--json", *args)
    assert code == 0, err
    return json.loads(out)


def fold_json(state) -> dict:
    """The fold as `state --json` shows it: without the fold's own bookkeeping (its restore anchor)."""
    shown = json.loads(msgspec.json.encode(state))
    return {k: v for k, v in shown.items() if k not in ("anchor", "anchor_open")}


def without_extras(shown: dict) -> dict:
    """The State part of `state --json` (it adds the run name, the point, the status and the next step)."""
    return {k: v for k, v in shown.items() if k not in ("run", "run_dir", "as_of", "status", "next_step")}


# --- the current state --------------------------------------------------------------------------------


def test_state_json_is_the_fold_of_the_whole_log(straight):
    events = events_of(straight)
    state = fold(events)
    shown = state_json(straight)
    assert without_extras(shown) == fold_json(state)
    last_step = [e for e in events if isinstance(e, StepCommitted)][-1]
    assert shown["step"] == last_step.step == Schedule(config_of(straight)).num_steps
    assert shown["cursors"] == last_step.cursors
    assert shown["last_checkpoint"]["checkpoint"] == state.last_checkpoint.checkpoint
    assert shown["run"] == config_of(straight).run.name
    assert shown["status"] == "finished" and shown["next_step"] is None and shown["as_of"] is None


def test_state_text_shows_the_folded_values_on_aligned_lines(straight):
    code, out, err = run_cli("state", straight)
    assert code == 0, err
    state = fold(events_of(straight))
    lines = {line[:18].strip(): line[19:] for line in out.splitlines() if line[:18].strip()}
    assert lines["run"].startswith(config_of(straight).run.name)
    assert lines["config"] == state.config_hash[:12]
    assert lines["status"] == "finished"
    assert lines["step"] == f"{state.step} of {state.num_steps}"
    assert lines["next step"].startswith("none")
    assert lines["data cursors"] == ", ".join(f"{name} {count}" for name, count in state.cursors.items())
    assert lines["last checkpoint"].startswith(state.last_checkpoint.checkpoint)
    assert lines["reference"].endswith(state.reference.checkpoint)
    num_layers = config_of(straight).architecture.num_layers
    assert lines["stacks"] == f"none: the initial model only ({num_layers} layers)"
    assert lines["resumes"] == "none" and lines["parent run"] == "none"
    # One line per live checkpoint: the first under the key, the others with the key column blank.
    text = out.splitlines()
    first = next(i for i, line in enumerate(text) if line.startswith("live checkpoints"))
    num_live = 1 + next(i for i, line in enumerate(text[first + 1 :]) if line[:18].strip())
    shown = [line[19:] for line in text[first : first + num_live]]
    assert len(state.live_checkpoints) >= 2
    assert shown == [f"{c.checkpoint} (step {c.step}, {c.reason})" for c in state.live_checkpoints]


# --- --at-step: effective records up to a step ------------------------------------------------------------


@pytest.mark.parametrize("step", [0, 1, 9, 11, 16, 19])
def test_state_at_step_gives_that_steps_cursors_and_the_schedule_of_the_next(straight, step):
    shown = state_json(straight, "--at-step", step)
    committed = {e.step: e for e in events_of(straight) if isinstance(e, StepCommitted)}
    schedule = Schedule(config_of(straight))
    assert shown["step"] == step and shown["tokens"] == schedule.tokens_of(step)
    assert shown["cursors"] == (committed[step].cursors if step else {})
    # The stage entered at or before step N (its StageEntered has step <= N): the last entry step <= N.
    assert shown["stage"] == max(i for i, entry in enumerate(schedule.entry_steps) if entry <= step)
    plan = schedule.step_plan(step)
    assert shown["next_step"] == {
        "step": step,
        "tokens": plan.tokens,
        "stage": plan.stage,
        "weights": list(plan.weights),
        "rows": list(plan.rows),
        "lr": plan.lr,
        "beta": plan.beta,
        "kl": {"setting": "beta", "value": plan.beta, "penalty": plan.beta},  # tiny.toml: pretrain stages
    }
    if step + 1 in committed:  # what the run then did is what the plan said
        done = committed[step + 1]
        assert (done.stage, done.lr, done.beta, done.rows) == (
            plan.stage,
            plan.lr,
            plan.beta,
            list(plan.rows),
        )
    assert shown["status"] == "not finished" and shown["as_of"] == {"step": step}


@pytest.fixture(scope="module")
def posttrained(tmp_path_factory) -> Path:
    from tests.tools.small_posttrain import train_small_posttrain

    return train_small_posttrain(tmp_path_factory.mktemp("posttrained") / "run")


@pytest.mark.parametrize(
    ("step", "line", "kl"),
    [
        (5, "  beta             0", {"setting": "beta", "value": 0.0, "penalty": 0.0}),
        (
            6,
            "  dpo.beta         0.1 (its loss; no KL penalty added)",
            {"setting": "dpo.beta", "value": 0.1, "penalty": 0.0},
        ),
        (8, "  grpo.kl_beta     0.02", {"setting": "grpo.kl_beta", "value": 0.02, "penalty": 0.02}),
    ],
)
def test_the_next_step_says_what_ties_its_stage_to_the_reference(posttrained, step, line, kl):
    """examples/posttrain.toml made small (steps 0-1 pretrain, 2-5 sft, 6-7 dpo, 8-13 grpo): every beta is
    0, the rule in dpo and grpo stages, whose tie to the reference is their own setting: the next step's
    line names it (an sft step keeps its beta), and --json adds it beside the folded beta."""
    code, out, err = run_cli("state", posttrained, "--at-step", step)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[lines.index(next(x for x in lines if x.startswith("  lr "))) + 1] == line
    shown = state_json(posttrained, "--at-step", step)["next_step"]
    assert shown["beta"] == 0.0 and shown["kl"] == kl


def test_state_at_the_last_step_is_the_finished_state(straight):
    assert state_json(straight, "--at-step", 20) == {**state_json(straight), "as_of": {"step": 20}}


def test_state_at_step_folds_the_effective_records(superseded):
    records = read_seq_events(superseded)
    (resume,) = [e for _, e in records if isinstance(e, RunResumed)]
    assert resume.superseded_last_seq >= resume.superseded_first_seq  # the run really lost records
    kept = effective(records)
    for step in (5, 6, 7):
        shown = state_json(superseded, "--at-step", step)
        expected = fold(e for _, e in kept if e.step <= step)
        assert without_extras(shown) == fold_json(expected)
        assert shown["step"] == step
        assert len(shown["resumes"]) == 1  # the resume (at step 4) counts from step 4 on
    assert state_json(superseded, "--at-step", 3)["resumes"] == []


def test_state_at_step_uses_the_config_in_force_then(forked):
    records = read_seq_events(forked)
    started = records[0][1]
    (change,) = [e for _, e in records if isinstance(e, ConfigChanged)]
    assert isinstance(started, RunStarted) and change.step == 6
    before, after = Schedule(started.config), Schedule(change.config)
    early, late = state_json(forked, "--at-step", 3), state_json(forked, "--at-step", 10)
    assert early["config_hash"] == started.config_hash and late["config_hash"] == change.config_hash
    assert early["next_step"]["lr"] == before.lr(3) and late["next_step"]["lr"] == after.lr(10)
    assert after.lr(10) != before.lr(10)  # the fork did change the LR there


# --- --at-seq: raw records up to a log record ----------------------------------------------------------


def test_state_at_seq_is_the_fold_of_the_raw_records_up_to_it(superseded):
    records = read_seq_events(superseded)
    (resume,) = [e for _, e in records if isinstance(e, RunResumed)]
    seqs = [
        0,
        resume.superseded_first_seq,
        resume.superseded_last_seq,
        resume.superseded_last_seq + 1,
        len(records) - 1,
    ]
    for seq in seqs:
        shown = state_json(superseded, "--at-seq", seq)
        assert without_extras(shown) == fold_json(fold(e for _, e in records[: seq + 1]))
        assert shown["as_of"] == {"seq": seq}
    # Before the resume, the superseded steps still counted: the run stood at step 6.
    assert state_json(superseded, "--at-seq", resume.superseded_last_seq)["step"] == 6
    assert state_json(superseded, "--at-seq", resume.superseded_last_seq + 1)["step"] == resume.step == 4


def test_state_at_the_stop_record_says_stopped_and_why(forked):
    records = read_seq_events(forked)
    (seq, stop) = next((s, e) for s, e in records if isinstance(e, RunStopped))
    code, out, err = run_cli("state", forked, "--at-seq", seq)
    assert code == 0, err
    assert f"stopped: {stop.reason}" in out and "6 of 20" in out
    assert "next step          index 6," in out  # a stopped run still has a next step


def test_state_shows_resumes_with_their_superseded_records(superseded, forked):
    for run in (superseded, forked):
        code, out, err = run_cli("state", run)
        assert code == 0, err
        resumes = [e for e in events_of(run) if isinstance(e, RunResumed)]
        (line,) = [line for line in out.splitlines() if line.startswith("resumes")]
        (resume,) = resumes
        assert f"from {resume.checkpoint} at step {resume.step}" in line
        assert f"records {resume.superseded_first_seq}..{resume.superseded_last_seq} superseded" in line
    assert state_json(forked)["resumes"][0]["step"] == 6


# --- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--at-step", "-1"], ["--at-step -1", "step 20"]),
        (["--at-step", "21"], ["--at-step 21", "step 20"]),
        (["--at-seq", "-1"], ["--at-seq -1", "0..LAST"]),
        (["--at-seq", "LAST+1"], ["0..LAST"]),
        (["--at-step", "x"], ["--at-step", "'x'"]),
        (["--at-step", "3", "--at-seq", "3"], ["not allowed"]),
    ],
)
def test_bad_points_exit_2_with_one_line(straight, args, needles):
    last = str(read_seq_events(straight)[-1][0])
    args = [a.replace("LAST+1", str(int(last) + 1)) for a in args]
    code, out, err = run_cli("state", straight, *args)
    assert code == 2 and not out
    line = one_line(err)
    for needle in needles:
        assert needle.replace("LAST", last) in line


def test_state_of_a_missing_run(tmp_path):
    code, out, err = run_cli("state", tmp_path / "nothing")
    assert code == 2 and not out
    assert "no run here" in one_line(err)


def test_state_of_an_empty_log(tmp_path):
    with EventLog.open(tmp_path, "w"):
        pass
    code, out, err = run_cli("state", tmp_path)
    assert code == 1 and not out
    assert "empty" in one_line(err)


def test_state_of_a_damaged_log_is_one_line_naming_the_damage(straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    segment = run / "events" / "00000000.log"
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF
    segment.write_bytes(data)
    code, out, err = run_cli("state", run)
    assert code == 1 and not out
    line = one_line(err)
    assert "00000000.log" in line and "Traceback" not in err


@pytest.mark.parametrize("build", [superseded_run, forked_run])
def test_state_is_the_same_with_or_without_the_snapshots_beside_the_log(build, tmp_path_factory, tmp_path):
    """Snapshots are a cache: with them the fold starts near the point asked for, without them it
    starts at the beginning, and the answer is the same for every step and for the end."""
    run = build(tmp_path_factory)
    assert any((run / "snapshots").iterdir())
    bare = tmp_path / "bare"
    shutil.copytree(run, bare)
    shutil.rmtree(bare / "snapshots")
    last = fold(events_of(run)).step
    for args in [(), *(("--at-step", step) for step in range(0, last + 1, 3)), ("--at-seq", 9)]:
        cached, folded = state_json(run, *args), state_json(bare, *args)
        assert without_extras(cached) == without_extras(folded), args
        assert cached["next_step"] == folded["next_step"]
