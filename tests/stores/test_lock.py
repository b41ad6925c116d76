"""The single-writer lock: a second writer is refused naming the holder, dead holders are broken."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import msgspec
import pytest

from rewind.states.events import StageEntered
from rewind.stores import fsio
from rewind.stores.eventlog import (
    EVENTS_DIR,
    LOCK_NAME,
    EventLog,
    LogCorruptError,
    LogLockedError,
    StaleLockBroken,
    read_events,
)
from rewind.stores.lock import LockInfo, read_lock

EVENT = StageEntered(step=0, tokens=0, stage=0)


def lock_file(run_url: str) -> fsio.Location:
    return fsio.filesystem(run_url).join(EVENTS_DIR, LOCK_NAME)


def plant_lock(run_url: str, *, host: str, pid: int) -> LockInfo:
    info = LockInfo(host=host, pid=pid, since="2026-01-02T03:04:05+00:00", token="planted")
    fsio.filesystem(run_url).join(EVENTS_DIR).makedirs()
    lock_file(run_url).write_atomic(msgspec.json.encode(info))
    return info


def test_a_second_writer_is_refused_with_the_holder_named(run_url):
    with EventLog.open(run_url, "w") as log:
        holder = read_lock(lock_file(run_url))
        assert holder is not None and (holder.host, holder.pid) == (socket.gethostname(), os.getpid())
        with pytest.raises(
            LogLockedError, match=f"pid {os.getpid()} on host {socket.gethostname()} since 20"
        ) as info:
            EventLog.open(run_url, "w")
        refused_by = info.value.holder
        assert (refused_by.host, refused_by.pid, refused_by.token) == (holder.host, holder.pid, holder.token)
        log.append(EVENT)
        log.commit()  # the refused writer did not disturb the holder
    assert read_lock(lock_file(run_url)) is None  # closing released it
    with EventLog.open(run_url, "w") as log:
        assert log.next_seq == 1


def test_readers_need_no_lock(run_url):
    with EventLog.open(run_url, "w") as log:
        log.append(EVENT)
        log.commit()
        assert read_events(run_url) == [EVENT]
        with EventLog.open(run_url) as reader:
            assert reader.next_seq == 1
        assert read_lock(lock_file(run_url)).token == log._lock.info.token  # the reader left it alone


def test_a_lock_left_by_a_dead_process_on_this_host_is_broken_with_a_warning(run_url, dead_pid):
    plant_lock(run_url, host=socket.gethostname(), pid=dead_pid)
    with (
        pytest.warns(StaleLockBroken, match=f"dead pid {dead_pid} on host"),
        EventLog.open(run_url, "w") as log,
    ):
        assert read_lock(lock_file(run_url)).pid == os.getpid()
        log.append(EVENT)
        log.commit()
    assert read_events(run_url) == [EVENT]


def test_a_live_or_unknowable_holder_is_never_broken(run_url):
    planted = plant_lock(run_url, host="gpu-node-17", pid=4242)  # another host: cannot tell if alive
    with pytest.raises(LogLockedError, match=r"pid 4242 on host gpu-node-17.*delete the lock file"):
        EventLog.open(run_url, "w")
    plant_lock(run_url, host=socket.gethostname(), pid=os.getppid())  # alive on this host
    with pytest.raises(LogLockedError, match=f"pid {os.getppid()}"):
        EventLog.open(run_url, "w")
    assert read_lock(lock_file(run_url)).pid == os.getppid() != planted.pid


def test_an_unreadable_lock_file_refuses_with_advice_on_an_object_store(run_url):
    fsio.filesystem(run_url).join(EVENTS_DIR).makedirs()
    lock_file(run_url).write_atomic(b"")  # a writer died between creating and filling it
    if fsio.filesystem(run_url).is_local:
        # Locally the kernel lock decides: an empty file is a released lock, garbage a dead holder's.
        EventLog.open(run_url, "w").close()
        lock_file(run_url).write_atomic(b"\x00garbage")
        with pytest.warns(StaleLockBroken, match="unreadable holder"), EventLog.open(run_url, "w"):
            pass
        return
    with pytest.raises(LogLockedError, match=r"unreadable lock file.*delete it"):
        EventLog.open(run_url, "w")


def _killed_holder(run: str, legacy: bool) -> subprocess.Popen:
    """A process that takes the writer's lock (as rewind 0.2 does, or writes it as 0.1 did, with no
    kernel lock) and SIGKILLs itself; not reaped, so it stays a zombie for the caller to meet."""
    take = (
        "import msgspec, os, socket; from rewind.stores.lock import LockInfo; "
        f"open({os.path.join(run, EVENTS_DIR, 'LOCK')!r}, 'wb').write(msgspec.json.encode(LockInfo("
        "host=socket.gethostname(), pid=os.getpid(), since='2026-01-01T00:00:00+00:00', token='t')))"
        if legacy
        else f"from rewind.stores.eventlog import EventLog; log = EventLog.open({run!r}, 'w')"
    )
    code = f"{take}; import os, signal; print('locked', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert process.stdout.readline() == b"locked\n"
    for _ in range(500):  # until the kernel has made it a zombie
        with open(f"/proc/{process.pid}/stat", "rb") as handle:
            if handle.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                return process
        time.sleep(0.01)
    raise AssertionError("the holder did not become a zombie")


@pytest.mark.parametrize("legacy", [False, True], ids=["kernel-lock", "rewind-0.1-lock"])
def test_a_killed_writer_still_a_zombie_never_blocks_the_next_one(tmp_path, legacy):
    """Found by kill-and-restart loops: the killed writer's pid answers kill(pid, 0) until it is reaped,
    so a restart at once was refused. The kernel lock is gone with the process; a 0.1 lock naming a
    zombie is stale."""
    run = str(tmp_path / "run")
    os.makedirs(os.path.join(run, EVENTS_DIR))
    holder = _killed_holder(run, legacy)
    try:
        with pytest.warns(StaleLockBroken, match=f"dead pid {holder.pid}"), EventLog.open(run, "w") as log:
            log.append(EVENT)
            log.commit()
        assert read_events(run) == [EVENT]
    finally:
        holder.wait()
        holder.stdout.close()


def test_a_live_writer_holds_the_kernel_lock_against_another_process(tmp_path):
    run = str(tmp_path / "run")
    with EventLog.open(run, "w"):
        code = f"from rewind.stores.eventlog import EventLog; EventLog.open({run!r}, 'w')"
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert other.returncode != 0 and f"event log is locked by pid {os.getpid()}" in other.stderr
    with EventLog.open(run, "w"):  # released cleanly: no warning, no refusal
        pass


def test_releasing_leaves_a_successors_lock_alone(run_url):
    log = EventLog.open(run_url, "w")
    successor = plant_lock(run_url, host=socket.gethostname(), pid=os.getppid())  # broke ours meanwhile
    log.close()
    assert read_lock(lock_file(run_url)) == successor


def test_a_failed_writer_open_releases_the_lock(run_url):
    events_dir = fsio.filesystem(run_url).join(EVENTS_DIR)
    events_dir.makedirs()
    events_dir.join("00000001.log").write_atomic(b"")  # segment 0 is missing: corrupt
    with pytest.raises(LogCorruptError, match="segment file is missing"):
        EventLog.open(run_url, "w")
    assert read_lock(lock_file(run_url)) is None
