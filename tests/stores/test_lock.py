"""The single-writer lock: a second writer is refused naming the holder, dead holders are broken."""

from __future__ import annotations

import os
import socket

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
        assert info.value.holder == holder
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


def test_an_unreadable_lock_file_refuses_with_advice(run_url):
    fsio.filesystem(run_url).join(EVENTS_DIR).makedirs()
    lock_file(run_url).write_atomic(b"")  # a writer died between creating and filling it
    with pytest.raises(LogLockedError, match=r"unreadable lock file.*delete it"):
        EventLog.open(run_url, "w")


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
