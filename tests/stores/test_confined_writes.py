"""A command writes only inside what it owns (rewind.stores.runguard): taking a run's lock looks over the run
directory, and a link anywhere in it leading out of the run, a FIFO or device, or a file where rewind keeps a
directory refuses the writer in one line, before it has written, moved or recorded anything. Files a run
appends to or reads back (metrics.jsonl, log segments) are opened only as regular files, never waited on.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rewind.states.admission import CACHE_DIR, ROLLOUTS_DIR
from rewind.stores import fsio, lock
from rewind.stores.checkpoints import CHECKPOINTS_DIR, ORPHANED_DIR
from rewind.stores.eventlog import EventLog
from rewind.stores.logread import EVENTS_DIR
from rewind.stores.metrics import JSONL_NAME, TB_DIR_NAME, MetricsProjection
from rewind.stores.runguard import RUN_DIRECTORIES, RUN_FILES, NotWritable, check_writable, write_problems
from rewind.stores.snapshots import SNAPSHOTS_DIR
from rewind.stores.trunks import TRUNKS_DIR
from tests.engine.test_loop import run_cli
from tests.tools.rundir_forgery import nine_step_run, tree_state


def _problems(run: Path) -> list[str]:
    return write_problems(fsio.filesystem(str(run)))


# --- the look over the run directory ------------------------------------------------------------------


def test_the_directories_named_are_the_stores_own():
    from rewind.engine.data.rundata import (
        DATA_DIR,  # (here: the stores' tests need no engine to be collected)
    )

    names = {CHECKPOINTS_DIR, f"{CHECKPOINTS_DIR}/{ORPHANED_DIR}", SNAPSHOTS_DIR, ROLLOUTS_DIR, TB_DIR_NAME}
    names |= {EVENTS_DIR, CACHE_DIR, TRUNKS_DIR, DATA_DIR, "plots"}  # (plots: tools/train_cmd.py's)
    assert set(RUN_DIRECTORIES) == names and set(RUN_FILES) == {JSONL_NAME}
    assert lock.RUN_LOG_DIR == EVENTS_DIR


WRITTEN = [
    *("checkpoints/orphaned", "snapshots", "tb", "rollouts", "metrics.jsonl"),  # what a resume writes
    *("events", "checkpoints", "plots", "data", "cache", "trunks"),
]


@pytest.mark.parametrize("name", WRITTEN)
def test_a_link_out_of_the_run_is_a_problem(tmp_path, name):
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    (run / name).parent.mkdir(parents=True)
    (run / name).symlink_to(outside)
    (problem,) = _problems(run)
    assert problem.startswith(f"{run}/{name} leads outside the run directory (to {outside})"), problem
    assert "\n" not in problem


def test_links_that_stay_inside_the_run_and_the_run_itself_a_link_are_fine(tmp_path):
    run = tmp_path / "run"
    (run / "elsewhere" / "tb").mkdir(parents=True)
    (run / "tb").symlink_to(run / "elsewhere" / "tb")
    (run / "snapshots").symlink_to("elsewhere")  # relative, inside
    (run / "metrics.jsonl").symlink_to(run / "elsewhere" / "m.jsonl")  # dangling, but inside
    (tmp_path / "alias").symlink_to(run)
    assert _problems(run) == [] and _problems(tmp_path / "alias") == []


def test_a_link_out_deep_in_the_run_and_a_chain_of_links_are_found(tmp_path):
    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    (run / "checkpoints" / "00000008-0123abcd").mkdir(parents=True)
    (run / "checkpoints" / "00000008-0123abcd" / "model.safetensors").symlink_to("/dev/zero")
    (run / "hop").symlink_to(outside)
    (run / "tb").symlink_to(run / "hop")  # inside, to a link that leads out
    problems = _problems(run)
    assert [p.split(" ", 1)[0] for p in problems] == [
        f"{run}/checkpoints/00000008-0123abcd/model.safetensors",
        f"{run}/hop",
        f"{run}/tb",
    ]
    assert all("leads outside the run directory" in p for p in problems)


@pytest.mark.parametrize("name", ["metrics.jsonl", "events/00000000.log", "tb/events.out.tfevents.1"])
def test_a_fifo_anywhere_in_the_run_is_a_problem(tmp_path, name):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    assert _problems(tmp_path) == [
        f"{path} is a FIFO, not a regular file: no file of a run is one (opening it can block); remove it"
    ]


@pytest.mark.parametrize("name", ["checkpoints/orphaned", "snapshots", "tb", "rollouts"])
def test_a_file_where_rewind_keeps_a_directory_says_what_it_is_and_what_to_do(tmp_path, name):
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_text("mine")
    (problem,) = _problems(tmp_path)
    assert problem == f"{tmp_path}/{name} is a file, {RUN_DIRECTORIES[name]}: move it away"


def test_a_directory_where_rewind_appends_to_a_file_says_what_it_is_and_what_to_do(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    (problem,) = _problems(tmp_path)
    assert problem == f"{tmp_path}/metrics.jsonl is a directory, {RUN_FILES['metrics.jsonl']}: move it away"


def test_the_refusal_is_one_line_naming_the_first_problem_and_counting_the_others(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).symlink_to("/")
    with pytest.raises(NotWritable) as refused:
        check_writable(fsio.filesystem(str(tmp_path)))
    message = str(refused.value)
    assert message.startswith(f"{tmp_path}/a leads outside the run directory (to /)") and "\n" not in message
    assert message.endswith(f" (and 2 more: `rewind verify {tmp_path}` lists them); nothing was written")


def test_an_object_store_run_has_nothing_to_look_at():
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/confined/run/tb/orphaned", b"x")
    run = fsio.filesystem("memory://confined/run")
    assert write_problems(run) == []
    check_writable(run)


# --- the writer's lock ---------------------------------------------------------------------------------


def _written_run(run: Path) -> None:
    with EventLog.open(str(run), "w") as log:
        log.append(_event())
        log.commit()


def _event():
    from tests.stores.samples import sample_events

    return sample_events(1)[0]


@pytest.mark.parametrize("name", ["checkpoints/orphaned", "snapshots", "tb", "rollouts", "metrics.jsonl"])
def test_the_writer_lock_of_a_run_with_a_link_out_is_refused_with_the_run_as_it_was(tmp_path, name):
    run, outside = tmp_path / "run", tmp_path / "outside"
    _written_run(run)
    outside.mkdir()
    (run / name).parent.mkdir(parents=True, exist_ok=True)
    (run / name).symlink_to(outside)
    before = tree_state(run)
    with pytest.raises(NotWritable, match="leads outside the run directory"):
        EventLog.open(str(run), "w")
    assert tree_state(run) == before and os.listdir(outside) == []
    (run / name).unlink()
    EventLog.open(str(run), "w").close()  # the lock was given back


def test_a_lone_lock_file_is_not_a_run(tmp_path):
    """A lock file outside a run's events/ (a tool's own): nothing around it is looked at."""
    (tmp_path / "link").symlink_to("/")
    held = lock.WriterLock.acquire(fsio.filesystem(str(tmp_path / "LOCK")))
    held.release()


# --- files opened to append or to read back: regular files only, never waited on ------------------------


def _in_time(action, seconds: float = 20.0):
    """What `action()` returns or raises, run in a thread: a blocking open fails the test, not hangs it."""
    outcome: list = []

    def target():
        try:
            outcome.append(("returned", action()))
        except BaseException as exc:  # handed to the test
            outcome.append(("raised", exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still blocked after {seconds} s"
    return outcome[0]


def test_appending_to_a_fifo_is_refused_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "segment")
    how, exc = _in_time(lambda: fsio.open_appending(str(tmp_path / "segment")))
    assert how == "raised" and isinstance(exc, fsio.RefusedFile) and "a FIFO, not a regular file" in str(exc)
    how, exc = _in_time(lambda: fsio.filesystem(str(tmp_path / "segment")).open_append(create=False))
    assert how == "raised" and isinstance(exc, fsio.RefusedFile)


def test_appending_creates_a_missing_file_and_appends_to_a_regular_one(tmp_path):
    path = tmp_path / "m.jsonl"
    for data in (b"a\n", b"b\n"):
        fd = fsio.open_appending(str(path))
        try:
            fsio.write_all(fd, data)
        finally:
            os.close(fd)
    assert path.read_bytes() == b"a\nb\n"
    with pytest.raises(FileExistsError):
        fsio.open_appending(str(path), exclusive=True)


def test_a_fifo_as_metrics_jsonl_is_refused_by_a_resume_of_the_projection_and_by_its_appends(tmp_path):
    os.mkfifo(tmp_path / JSONL_NAME)
    how, exc = _in_time(lambda: MetricsProjection(tmp_path).resume(5, 6))
    assert how == "raised" and isinstance(exc, fsio.RefusedFile), exc
    projection = MetricsProjection(tmp_path)
    projection._pending.append(b"{}\n")  # a line observed, to be written
    how, exc = _in_time(projection.flush)
    assert how == "raised" and isinstance(exc, fsio.RefusedFile), exc


# --- end to end: a resume of a real run -----------------------------------------------------------------


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    return nine_step_run(tmp_path_factory.mktemp("confined"))


@pytest.fixture
def run(base_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(base_run, copy, symlinks=True)
    # A checkpoint the log does not name: the resume would move it under checkpoints/orphaned/.
    name = sorted(os.listdir(copy / "checkpoints"))[-1]
    shutil.copytree(copy / "checkpoints" / name, copy / "checkpoints" / f"{name[:8]}-00000000")
    return copy


@pytest.mark.parametrize("name", ["checkpoints/orphaned", "snapshots", "tb", "rollouts", "metrics.jsonl"])
def test_a_resume_through_a_link_out_of_the_run_is_refused_and_nothing_is_moved_or_written(
    run, tmp_path, name
):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "theirs").write_text("not the run's")
    target = run / name
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    target.symlink_to(outside)
    before, before_outside = tree_state(run), tree_state(outside)
    code, out, err = run_cli("resume", run, "--no-progress")
    assert code == 1 and out == "", err
    assert err.count("\n") == 1 and err.startswith(f"rewind: {target} leads outside the run directory"), err
    assert tree_state(run) == before and tree_state(outside) == before_outside


def test_a_resume_with_checkpoints_orphaned_a_file_is_refused_saying_what_to_do(run):
    (run / "checkpoints" / "orphaned").write_text("my notes")
    before = tree_state(run)
    code, _, err = run_cli("resume", run, "--no-progress")
    assert code == 1 and err == (
        f"rewind: {run}/checkpoints/orphaned is a file, where rewind keeps checkpoints no record names: "
        "move it away; nothing was written\n"
    )
    assert tree_state(run) == before


def test_a_resume_with_a_fifo_as_metrics_jsonl_ends_in_one_line_and_does_not_hang(run):
    (run / "metrics.jsonl").unlink()
    os.mkfifo(run / "metrics.jsonl")
    before = tree_state(run)
    done = subprocess.run(
        [sys.executable, "-m", "rewind.tools.cli", "resume", str(run), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert (
        done.stderr == f"rewind: {run}/metrics.jsonl is a FIFO, not a regular file: no file of a run is one "
        "(opening it can block); remove it; nothing was written\n"
    )
    assert tree_state(run) == before


@pytest.mark.parametrize("name", ["tb", "metrics.jsonl"])
def test_export_tensorboard_through_a_link_out_is_refused_and_nothing_is_written(run, tmp_path, name):
    """`rewind export tensorboard RUN` rewrites tb/ and metrics.jsonl without the lock: it looks first too."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "theirs").write_text("not the run's")
    target = run / name
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    target.symlink_to(outside if name == "tb" else outside / "theirs")
    before, before_outside = tree_state(run), tree_state(outside)
    code, out, err = run_cli("export", "tensorboard", run)
    assert code == 1 and out == "", err
    assert err.count("\n") == 1 and err.startswith(f"rewind: {target} leads outside the run directory"), err
    assert tree_state(run) == before and tree_state(outside) == before_outside


@pytest.mark.parametrize("name", ["tb", "snapshots", "checkpoints/orphaned"])
def test_verify_names_what_would_lead_a_writer_out_of_the_run(run, tmp_path, name):
    """The two links out a clean verify used to pass over (tb/, snapshots/), and checkpoints/orphaned a file."""
    target = run / name
    if name == "checkpoints/orphaned":
        target.write_text("my notes")
        expect = f"PROBLEM run directory: {target} is a file, where rewind keeps checkpoints no record names"
    else:
        shutil.copytree(target, tmp_path / "outside")
        shutil.rmtree(target)
        target.symlink_to(tmp_path / "outside")
        expect = f"PROBLEM run directory: {target} leads outside the run directory"
    code, out, _ = run_cli("verify", run)
    assert code == 1 and expect in out, out
