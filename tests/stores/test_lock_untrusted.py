"""A lock file is untrusted input: whatever sits at events/LOCK ends in one clean outcome, never a
hang, a MemoryError or an OverflowError, and nothing outside the run is read or changed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import msgspec
import pytest

from rewind.states.events import StageEntered
from rewind.stores.eventlog import (
    EVENTS_DIR,
    LOCK_NAME,
    EventLog,
    LogLockedError,
    StaleLockBroken,
    read_events,
)
from rewind.stores.fsio import filesystem
from rewind.stores.lock import MAX_LOCK_BYTES, LockInfo, read_lock

EVENT = StageEntered(step=0, tokens=0, stage=0)


def lock_path(run: str) -> str:
    os.makedirs(os.path.join(run, EVENTS_DIR), exist_ok=True)
    return os.path.join(run, EVENTS_DIR, LOCK_NAME)


def open_in_child(run: str) -> subprocess.CompletedProcess:
    """Open the writer in another process, with a deadline: a lock file that hangs the open (a FIFO
    opened blocking) must fail the test, not the suite."""
    code = (
        "import sys; from rewind.stores.eventlog import EventLog\n"
        "try:\n"
        f"    EventLog.open({run!r}, 'w').close()\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc, file=sys.stderr); sys.exit(3)\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("kind", ["symlink-to-dev-zero", "fifo", "directory", "symlink-to-outside-file"])
def test_a_lock_that_is_not_a_regular_file_refuses_in_one_line(tmp_path, kind):
    run = str(tmp_path / "run")
    path = lock_path(run)
    outside = tmp_path / "precious.txt"
    outside.write_bytes(b"not yours\n")
    if kind == "symlink-to-dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    else:
        os.symlink(outside, path)
    done = open_in_child(run)
    assert done.returncode == 3, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("LogLockedError event log lock ")
    expected = {"symlink-to-dev-zero": "symbolic link", "fifo": "FIFO", "directory": "directory"}
    assert expected.get(kind, "symbolic link") in lines[0]
    assert outside.read_bytes() == b"not yours\n" and os.stat(outside).st_nlink == 1
    assert read_lock(filesystem(run).join(EVENTS_DIR, LOCK_NAME)) is None  # readers of it do not hang either


def test_a_hard_link_to_another_file_is_never_written_through(tmp_path):
    run = str(tmp_path / "run")
    outside = tmp_path / "precious.txt"
    outside.write_bytes(b"not yours\n")
    os.link(outside, lock_path(run))
    with pytest.raises(LogLockedError, match="hard links"):
        EventLog.open(run, "w")
    assert outside.read_bytes() == b"not yours\n"


@pytest.mark.parametrize(
    "content",
    [
        pytest.param({"pid": 1 << 40}, id="pid-2**40"),
        pytest.param({"pid": -1}, id="negative-pid"),
        pytest.param({"pid": 0}, id="pid-0"),
        pytest.param({"host": "a\nb"}, id="host-with-newline"),
        pytest.param({"host": "h" * 10_000}, id="host-10k"),
        pytest.param(b"\x00junk" * (2 << 20), id="10MB-junk"),
    ],
)
def test_a_lock_with_garbage_is_an_unreadable_holder_taken_over(tmp_path, content):
    """No flock is held on it, so its writer is dead: taken over with a warning, never a traceback."""
    run = str(tmp_path / "run")
    if isinstance(content, dict):
        fields = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "since": "2026-01-01T00:00:00+00:00",
            "token": "t",
        }
        data = msgspec.json.encode({**fields, **content})
    else:
        data = content
    with open(lock_path(run), "wb") as handle:
        handle.write(data)
    assert read_lock(filesystem(run).join(EVENTS_DIR, LOCK_NAME)) is None
    with pytest.warns(StaleLockBroken, match="unreadable holder"), EventLog.open(run, "w") as log:
        log.append(EVENT)
        log.commit()
        assert os.path.getsize(lock_path(run)) < MAX_LOCK_BYTES  # ours replaced it whole
    assert read_events(run) == [EVENT]


def test_a_valid_holder_is_still_named(tmp_path):
    """The range checks accept what rewind writes (a real pid, a real host name)."""
    run = str(tmp_path / "run")
    info = LockInfo(host=socket.gethostname(), pid=os.getppid(), since="2026-01-01T00:00:00+00:00", token="t")
    with open(lock_path(run), "wb") as handle:
        handle.write(msgspec.json.encode(info))
    assert read_lock(filesystem(run).join(EVENTS_DIR, LOCK_NAME)) == info
    with pytest.raises(LogLockedError, match=f"pid {os.getppid()}"):  # a 0.1 lock of a live process
        EventLog.open(run, "w")
