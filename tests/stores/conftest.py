"""Fixtures for the event-log tests: a run directory on every backend, and a simulated kill -9."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import fsspec
import msgspec
import pytest

from rewind.stores import fsio
from rewind.stores.eventlog import EVENTS_DIR, LOCK_NAME, EventLog
from rewind.stores.lease import ObjectLease, epoch_name
from rewind.stores.lock import LockInfo, read_lock

BACKENDS = ("local", "memory")


def fresh_run_url(backend: str, tmp_dir) -> tuple[str, str | None]:
    """A run URL that no other test uses, and the memory:// root to remove afterwards (or None)."""
    if backend == "local":
        return str(tmp_dir / f"run-{uuid.uuid4().hex[:8]}"), None
    root = f"/rewind-tests/{uuid.uuid4().hex}"
    return f"memory://{root}/run", root


def remove_memory_root(root: str | None) -> None:
    # fsspec's MemoryFileSystem keeps one global store: leave nothing behind for the next test.
    fs = fsspec.filesystem("memory")
    if root is not None and fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=BACKENDS)
def run_url(request, tmp_path):
    """A fresh run directory, on the local filesystem and on memory:// (object-store semantics)."""
    url, root = fresh_run_url(request.param, tmp_path)
    yield url
    remove_memory_root(root)


@pytest.fixture
def local_run(tmp_path) -> str:
    return str(tmp_path / "run")


def skip_syncs() -> dict:
    """Make fdatasync / directory fsync no-ops; returns what to put back. For tests that simulate
    by hand what a crash leaves on disk: real syncs add nothing there but seconds on a busy disk."""
    saved = {name: getattr(fsio, name) for name in ("sync_fd", "fsync_dir")}
    for name in saved:
        setattr(fsio, name, lambda fd_or_path: None)
    return saved


@pytest.fixture
def no_syncs():
    saved = skip_syncs()
    yield
    for name, function in saved.items():
        setattr(fsio, name, function)


@pytest.fixture(scope="session")
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped on this host."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def abandon(log: EventLog, dead_pid: int) -> None:
    """Simulate kill -9 of the writer: its fds close without any further write, sync or unlock,
    and its lock file is left behind naming a dead process (so the next writer must break it)."""
    if log._fd is not None:
        os.close(log._fd)
        log._fd = None
    if log._lock is not None and log._lock.fd is not None:
        os.close(log._lock.fd)  # a dead process's descriptors close, and its kernel lock with them
        log._lock.fd = None
    log._closed = True
    lock = log.run.join(EVENTS_DIR, LOCK_NAME)
    holder = read_lock(lock)
    assert holder is not None
    if isinstance(log._lock, ObjectLease):  # an object store: the lease and its epoch object name the dead
        dead = msgspec.structs.replace(log._lock.lease, pid=dead_pid)
        for place in (lock, log.run.join(EVENTS_DIR, epoch_name(dead.epoch))):
            place.write_atomic(msgspec.json.encode(dead))
        return
    lock.write_atomic(
        msgspec.json.encode(LockInfo(host=holder.host, pid=dead_pid, since=holder.since, token="x"))
    )


@pytest.fixture
def crash(dead_pid):
    return lambda log: abandon(log, dead_pid)
