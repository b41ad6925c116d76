"""Filesystem trouble from every command is one line naming the path, exit 1, never a traceback: parts
of a run directory that are the wrong kind of file, and the system calls that fail (a full disk, a
read-only mount, no permission). Also what `rewind train` says about a finished run given another
config, and what its summary says about files a run directory given as a URL did not get."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from tests.engine.test_loop import OVERRIDES, train_args
from tests.tools.test_cli_input import refused


@pytest.fixture
def run_copy(straight, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    return run


def segment_bytes(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "events").glob("*.log"))}


# --- parts of a run directory that are the wrong kind of file ----------------------------------------

READERS = [["log"], ["state"], ["timeline"], ["replay", "--no-progress"], ["resume", "--no-progress"]]


@pytest.mark.parametrize("command", READERS, ids=lambda c: c[0])
def test_a_segment_that_is_a_directory_is_one_line(rewind_cli, run_copy, command):
    segment = sorted((run_copy / "events").glob("*.log"))[0]
    segment.unlink()
    segment.mkdir()
    line = refused(rewind_cli(command[0], run_copy, *command[1:]), 1)
    assert str(run_copy) in line


def test_a_diff_against_a_run_with_a_directory_for_a_segment_is_one_line(rewind_cli, run_copy, straight):
    segment = sorted((run_copy / "events").glob("*.log"))[0]
    segment.unlink()
    segment.mkdir()
    assert str(run_copy) in refused(rewind_cli("diff", straight, run_copy), 1)


def test_events_that_is_a_file_is_one_line_for_train(rewind_cli, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "events").write_text("not a directory")
    code, _, err = rewind_cli(*train_args(run))
    assert code != 0 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and err.startswith("rewind: ") and str(run) in err
    assert (run / "events").read_text() == "not a directory"


def test_a_lock_that_is_a_directory_is_one_line(rewind_cli, run_copy):
    lock = run_copy / "events" / "LOCK"
    if lock.exists():
        lock.unlink()
    lock.mkdir()
    before = segment_bytes(run_copy)
    # (Its own config: another is refused before the log is opened for writing, by the entry's decision.)
    line = refused(rewind_cli(*train_args(run_copy)), 1)
    assert str(lock) in line
    assert segment_bytes(run_copy) == before


@pytest.mark.parametrize("command", [["export", "--to", "model.safetensors"], ["verify"]], ids=["export", "verify"])
def test_checkpoints_that_is_a_file_is_one_line(rewind_cli, run_copy, tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    shutil.rmtree(run_copy / "checkpoints")
    (run_copy / "checkpoints").write_text("not a directory")
    code, _, err = rewind_cli(command[0], run_copy, *command[1:])
    assert code == 1 and "Traceback" not in err
    assert err.startswith("rewind: ") and str(run_copy / "checkpoints") in err
    if command[0] == "export":
        assert not (tmp_path / "model.safetensors").exists()


# --- system calls that fail --------------------------------------------------------------------------

FAILURES = [errno.ENOSPC, errno.EROFS, errno.EACCES, errno.ENOTDIR, errno.EISDIR]


@pytest.mark.parametrize("code", FAILURES, ids=errno.errorcode.get)
def test_an_os_error_naming_a_file_is_one_line_naming_it(rewind_cli, run_copy, monkeypatch, code):
    """Whatever the stores let through (they turn most of these into their own errors): the command
    still ends with one line, the path and the reason."""
    from rewind.tools import log_cmd

    path = str(run_copy / "events" / "00000000.log")

    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), path)

    monkeypatch.setattr(log_cmd, "_read_selected", fail)
    refused(rewind_cli("log", run_copy), 1, f"rewind: {path}: {os.strerror(code)}")


def test_an_os_error_without_a_path_names_the_run(rewind_cli, run_copy, monkeypatch):
    from rewind.tools import state_cmd

    def fail(*args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(state_cmd, "next_step_plan", fail)
    refused(rewind_cli("state", run_copy), 1, f"rewind: {run_copy}: {os.strerror(errno.EIO)}")


def test_a_full_disk_while_training_is_one_line(rewind_cli, tmp_path, monkeypatch):
    from rewind.stores import fsio

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fsio, "write_all", full)
    code, _, err = rewind_cli(*train_args(tmp_path / "run", "--max-steps", "1"))
    assert code == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rewind: ") and "No space left on device" in lines[0]


# --- a finished run and another config ---------------------------------------------------------------


def test_a_finished_run_given_another_config_says_what_differs(rewind_cli, run_copy):
    before = segment_bytes(run_copy)
    line = refused(
        rewind_cli(*train_args(run_copy, overrides=(*OVERRIDES, "optimization.lr=1e-3", "run.seed=9"))),
        2,
        "already finished",
        "optimization.lr: 0.003 -> 0.001",
        "run.seed: 7 -> 9",
    )
    assert "logging" not in line and "training" not in line  # only what differs is named
    assert segment_bytes(run_copy) == before
    lock = run_copy / "events" / "LOCK"
    assert not lock.exists() or lock.stat().st_size == 0  # released


def test_a_finished_run_given_its_own_config_has_nothing_to_do(rewind_cli, run_copy):
    code, out, err = rewind_cli(*train_args(run_copy))
    assert code == 0, err
    assert "already finished" in out and "nothing to do" in out and not err


# --- the summary of a run directory given as a URL ---------------------------------------------------


def test_the_summary_of_a_file_url_says_which_projections_were_not_written(run_copy):
    from rewind.tools.train_cmd import summary

    url = f"file://{run_copy}"
    full = summary(url).splitlines()
    assert any(line.split()[:2] == ["metrics", f"{url}/metrics.jsonl"] for line in full)
    (run_copy / "metrics.jsonl").unlink()
    shutil.rmtree(run_copy / "tb")
    shutil.rmtree(run_copy / "plots")
    lines = {line.split()[0]: line for line in summary(url).splitlines()[3:6]}
    assert set(lines) == {"tensorboard", "metrics", "plots"}
    assert all("not written" in line for line in lines.values())
    assert f"rewind export tensorboard {run_copy}" in lines["metrics"]


def test_the_summary_of_an_object_store_url_never_lists_files_it_cannot_have():
    from rewind.tools.train_cmd import projection_lines

    lines = projection_lines("memory://runs/a")
    assert [line.split()[0] for line in lines] == ["tensorboard", "metrics", "plots"]
    assert all("not written" in line and "local run directory" in line for line in lines)
