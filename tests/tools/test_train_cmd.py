"""`rewind train` and `rewind resume`: clean stops and resumes, finished runs, config changes and forks,
and every bad input ending as one line and an exit code, never a traceback."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from rewind.states.events import CheckpointCommitted, ConfigChanged, RunResumed, RunStopped, StepCommitted
from rewind.states.fold import fold
from rewind.states.history import effective
from rewind.states.schedule import Schedule
from rewind.stores.eventlog import EventLog
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import (
    OVERRIDES,
    TINY,
    assert_bitwise_equal,
    effective_steps,
    events_of,
    exported_weights,
    one_line,
    run_cli,
    train_args,
)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[Path, tuple[int, str, str]]:
    """A run stopped cleanly by --max-steps 7, and what that command returned. Copy before changing it."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    return run, run_cli(*train_args(run, "--max-steps", "7"))


@pytest.fixture
def stopped_copy(stopped, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(stopped[0], copy)
    return copy


def segment_bytes(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "events").glob("*.log"))}


# --- clean stop and resume --------------------------------------------------------------------------


def test_max_steps_stops_cleanly_with_a_stop_checkpoint(stopped):
    run, (code, _, err) = stopped
    assert code == 0, err
    assert "stopped after step 7" in one_line(err)
    events = events_of(run)
    assert isinstance(events[-1], RunStopped) and events[-1].step == 7 and "7" in events[-1].reason
    state = fold(events)
    assert not state.finished and state.step == 7
    assert state.last_checkpoint is not None and state.last_checkpoint.reason == "stop"
    assert state.last_checkpoint.step == 7
    assert (run / "checkpoints" / state.last_checkpoint.checkpoint / "model.safetensors").is_file()
    assert max(e.step for e in events if isinstance(e, StepCommitted)) == 7


@pytest.mark.parametrize("how", ["train", "resume"])
def test_resume_after_a_clean_stop_matches_a_straight_run_bitwise(
    how, stopped, stopped_copy, straight, tmp_path
):
    stop_checkpoint = fold(events_of(stopped_copy)).last_checkpoint
    args = train_args(stopped_copy) if how == "train" else ["resume", str(stopped_copy), "--no-progress"]
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert "resuming" in err and "run finished" in out
    events = events_of(stopped_copy)
    resumed = [e for e in events if isinstance(e, RunResumed)]
    assert [(e.step, e.checkpoint) for e in resumed] == [(7, stop_checkpoint.checkpoint)]
    assert fold(events).finished
    assert_bitwise_equal(
        exported_weights(straight, tmp_path / "straight.safetensors"),
        exported_weights(stopped_copy, tmp_path / "resumed.safetensors"),
    )
    assert effective_steps(stopped_copy) == effective_steps(straight)


# --- a finished run ---------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["train", "resume"])
def test_a_finished_run_is_left_alone(how, straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    before, metrics = segment_bytes(run), (run / "metrics.jsonl").read_bytes()
    args = train_args(run) if how == "train" else ["resume", str(run), "--no-progress"]
    code, out, err = run_cli(*args)
    assert code == 0, err
    assert "already finished" in one_line(out)
    assert segment_bytes(run) == before  # nothing appended, not even a RunResumed
    assert (run / "metrics.jsonl").read_bytes() == metrics
    lock = run / "events" / "LOCK"
    assert not lock.exists() or lock.stat().st_size == 0  # released (the file stays, emptied)


# --- config changes ---------------------------------------------------------------------------------


def test_a_changed_config_is_refused_with_one_line_naming_the_field(stopped_copy):
    before = segment_bytes(stopped_copy)
    code, _, err = run_cli(*train_args(stopped_copy, overrides=(*OVERRIDES, "optimization.lr=1e-3")))
    assert code == 2
    line = one_line(err)
    assert "optimization.lr" in line and "--fork" in line
    assert "logging" not in line and "training" not in line  # only what changed is named
    assert segment_bytes(stopped_copy) == before


def test_fork_continues_under_the_new_config(stopped_copy):
    code, _, err = run_cli(
        *train_args(stopped_copy, "--fork", overrides=(*OVERRIDES, "optimization.lr=1e-3"))
    )
    assert code == 0, err
    records = read_seq_events(stopped_copy)
    events = [e for _, e in records]
    changes = [e for e in events if isinstance(e, ConfigChanged)]
    assert len(changes) == 1 and changes[0].step == 7
    assert changes[0].config.optimization.lr == 1e-3
    assert isinstance(events[events.index(changes[0]) - 1], RunResumed)
    state = fold(events)
    assert state.finished and state.config_hash == changes[0].config_hash
    schedule = Schedule(changes[0].config)
    later = [e for _, e in effective(records) if isinstance(e, StepCommitted) and e.step > 7]
    assert [e.step for e in later] == list(range(8, 21))
    assert all(e.lr == schedule.lr(e.step - 1) for e in later)


def test_fork_that_changes_tokens_per_step_is_refused(stopped_copy):
    before = segment_bytes(stopped_copy)
    code, _, err = run_cli(
        *train_args(stopped_copy, "--fork", overrides=(*OVERRIDES, "training.batch_size=16"))
    )
    assert code == 2
    line = one_line(err)
    assert "tokens per step" in line and "256" in line and "512" in line
    assert "Traceback" not in err
    assert segment_bytes(stopped_copy) == before


# --- bad input --------------------------------------------------------------------------------------

DATASETS_OF = 'training.datasets=[[{name="mine",rate=1.0}],[{name="mine",rate=1.0}],[{name="mine",rate=1.0}]]'


def token_file_overrides(path: Path) -> tuple[str, ...]:
    return (*OVERRIDES, "data.mine.kind=tokens", f'data.mine.path="{path}"', DATASETS_OF)


def assert_one_clean_line(code: int, err: str, expected_code: int, *needles: str) -> str:
    assert code == expected_code, err
    assert "Traceback" not in err
    line = one_line(err)
    assert line.startswith("rewind: ")
    for needle in needles:
        assert needle in line
    return line


def test_the_end_tables_say_before_training_only_when_a_start_row_is_there(straight, tmp_path):
    """A run evaluates before training only when training.evaluations is set: without it the tables have
    no "(start)" row, and their titles no longer claim one."""
    from rewind.tools.train_cmd import summary

    with_start = summary(str(straight)).splitlines()
    title = "answer-token accuracy before training and at each stage boundary (rows: after stage; columns: task)"
    assert title in with_start
    assert any(line.split()[0] == "(start)" for line in with_start if line.strip())
    run = tmp_path / "run"
    code, _, err = run_cli(*train_args(run, "--set", "training.evaluations=[]"))
    assert code == 0, err
    lines = summary(str(run)).splitlines()
    titles = [line for line in lines if "at each stage boundary" in line]
    assert titles == [
        "answer-token accuracy at each stage boundary (rows: after stage; columns: task)",
        "held-out text: bits per byte at each stage boundary (columns: dataset)",
    ]
    assert not [line for line in lines if "(start)" in line or "before training" in line]


def test_missing_config_file(rewind_cli, tmp_path):
    code, _, err = rewind_cli("train", tmp_path / "nope.toml", "--run-dir", tmp_path / "run")
    assert_one_clean_line(code, err, 2, "nope.toml", "no such config file")
    assert not (tmp_path / "run").exists()


def test_invalid_config_reports_every_problem(rewind_cli, tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text(TINY.read_text() + "\n[run.extra]\n")
    code, _, err = rewind_cli(
        "train",
        config,
        "--run-dir",
        tmp_path / "run",
        "--set",
        "architecture.num_heads=3",
        "--set",
        "training.batch_size=0",
    )
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    for field in ("run.extra", "architecture.d_model", "training.batch_size"):
        assert sum(field in line for line in lines) == 1, (field, err)
    assert all(line.startswith(f"rewind: {config}: ") for line in lines)
    assert not (tmp_path / "run").exists()


def test_missing_token_file_fails_before_the_log_is_touched(rewind_cli, tmp_path):
    missing, run = tmp_path / "missing.bin", tmp_path / "run"
    code, _, err = rewind_cli(*train_args(run, overrides=token_file_overrides(missing)))
    assert_one_clean_line(code, err, 2, "'mine'", str(missing), "not found")
    assert not (run / "events").exists()


def test_too_small_token_file(rewind_cli, tmp_path):
    small, run = tmp_path / "small.bin", tmp_path / "run"
    np.arange(100, dtype=np.uint16).tofile(small)  # 3 windows of 33: none left for validation
    code, _, err = rewind_cli(*train_args(run, overrides=token_file_overrides(small)))
    assert_one_clean_line(code, err, 2, "'mine'", str(small), "too small")
    assert not (run / "events").exists()


def test_a_token_file_that_fits_trains(rewind_cli, tmp_path):
    """The control for the two tests above: the same overrides with a big enough file do train."""
    tokens, run = tmp_path / "tokens.bin", tmp_path / "run"
    np.random.default_rng(0).integers(0, 256, size=33 * 40, dtype=np.uint16).tofile(tokens)
    code, _, err = rewind_cli(*train_args(run, "--max-steps", "1", overrides=token_file_overrides(tokens)))
    assert code == 0, err
    steps = [e for e in events_of(run) if isinstance(e, StepCommitted)]
    assert [(e.step, e.cursors) for e in steps] == [(1, {"mine": 8})]


def test_run_directory_under_a_regular_file(rewind_cli, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, _, err = rewind_cli(*train_args(blocker / "run"))
    assert_one_clean_line(code, err, 2, str(blocker / "run"), "cannot create the run directory")
    assert blocker.read_text() == "not a directory"


def test_run_directory_that_is_a_regular_file(rewind_cli, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, _, err = rewind_cli(*train_args(blocker))
    assert_one_clean_line(code, err, 2, str(blocker), "not a directory")


def test_a_second_writer_is_refused_while_the_lock_is_held(rewind_cli, stopped_copy):
    before = segment_bytes(stopped_copy)
    with EventLog.open(stopped_copy, "w"):
        code, _, err = rewind_cli(*train_args(stopped_copy))
        assert_one_clean_line(code, err, 1, "locked", f"pid {os.getpid()}")
    assert segment_bytes(stopped_copy) == before
    assert not any(isinstance(e, CheckpointCommitted) and e.step > 7 for e in events_of(stopped_copy))


def test_resume_of_a_directory_without_a_run(rewind_cli, tmp_path):
    code, _, err = rewind_cli("resume", tmp_path)
    assert_one_clean_line(code, err, 2, str(tmp_path), "no run here")


# --- CPU threads ------------------------------------------------------------------------------------


def test_a_run_records_its_thread_count_and_a_resume_computes_with_it(stopped_copy, straight, tmp_path):
    """CPU float sums are split across threads, so their bits depend on the count: a resume in a process
    (or on a machine) with another default must still compute with the run's."""
    import contextlib
    import io

    import torch

    from rewind.tools.cli import main

    assert events_of(stopped_copy)[0].num_threads == 1  # every test trains with one thread
    err = io.StringIO()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["resume", str(stopped_copy), "--no-progress"])
    finally:
        torch.set_num_threads(before)
    assert code == 0, err.getvalue()
    assert "computing with 1 CPU thread(s)" in err.getvalue() and "had 2" in err.getvalue()
    assert_bitwise_equal(
        exported_weights(straight, tmp_path / "straight.safetensors"),
        exported_weights(stopped_copy, tmp_path / "resumed.safetensors"),
    )
