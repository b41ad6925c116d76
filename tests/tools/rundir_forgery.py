"""Helpers that forge run directories for the tests of untrusted input: rewrite a log through the
stores' own EventLog writer, hash a directory tree without following anything out of it, and watch
which files a command opens."""

from __future__ import annotations

import builtins
import contextlib
import hashlib
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from rewind.states.events import Event
from rewind.stores.eventlog import EventLog
from rewind.stores.runs import read_seq_events


def rewrite_log(run: Path, change: Callable[[int, Event], Event]) -> None:
    """Replace the run's log by one holding change(seq, event) for every record, written by the real
    writer (so framing and CRCs are right: only the content is forged). Snapshots go: they are caches
    of the old log."""
    records = read_seq_events(run)
    shutil.rmtree(run / "events")
    shutil.rmtree(run / "snapshots", ignore_errors=True)
    with EventLog.open(run, "w") as log:
        for seq, event in records:
            log.append(change(seq, event))
        log.commit()


def tree_state(root: Path) -> dict[str, tuple]:
    """Every entry under `root`: a regular file by content, a link by its target, anything else by its
    type. Never follows a link or opens a FIFO."""
    found: dict[str, tuple] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            info = os.lstat(path)
            key = os.path.relpath(path, root)
            if stat.S_ISLNK(info.st_mode):
                found[key] = ("link", os.readlink(path))
            elif stat.S_ISREG(info.st_mode):
                found[key] = ("file", hashlib.sha256(Path(path).read_bytes()).hexdigest())
            else:
                found[key] = ("other", stat.S_IFMT(info.st_mode))
    return found


@contextlib.contextmanager
def opened_paths() -> Iterator[list[str]]:
    """The real path of every file opened (os.open and open) while the block runs."""
    seen: list[str] = []
    real_os_open, real_open = os.open, builtins.open

    def note(path) -> None:
        if isinstance(path, str | bytes | os.PathLike):
            with contextlib.suppress(OSError, ValueError, TypeError):
                seen.append(os.path.realpath(os.fsdecode(path)))

    def os_open(path, *args, **kwargs):
        note(path)
        return real_os_open(path, *args, **kwargs)

    def open_(file, *args, **kwargs):
        note(file)
        return real_open(file, *args, **kwargs)

    os.open, builtins.open = os_open, open_
    try:
        yield seen
    finally:
        os.open, builtins.open = real_os_open, real_open


def nine_step_run(directory: Path) -> Path:
    """A small real run in `directory`/base, stopped after 9 steps: the base the forgery tests copy."""
    from tests.engine.test_loop import run_cli, train_args

    run = directory / "base"
    code, _, err = run_cli(*train_args(run, "--max-steps", "9"))
    assert code == 0, err
    return run
