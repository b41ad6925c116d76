"""The writer's lease on an object store (memory://): expiry, takeover, renewal, and the fence that
keeps a writer that lost its lease from ever committing after its successor."""

from __future__ import annotations

import os
import socket
import time
import warnings

import msgspec
import pytest

from rewind.stores import fsio, lease
from rewind.stores.codec import FrameEncoder
from rewind.stores.eventlog import (
    EVENTS_DIR,
    LOCK_NAME,
    EventLog,
    LogCorruptError,
    LogLockedError,
    LogWriteError,
    StaleLockBroken,
    read_events,
    segment_name,
)
from rewind.stores.lease import Lease, epoch_name, epochs, read_lease
from tests.stores.samples import sample_events

EVENTS = sample_events(8)


@pytest.fixture
def memory_run(tmp_path):
    from tests.stores.conftest import fresh_run_url, remove_memory_root

    url, root = fresh_run_url("memory", tmp_path)
    yield url
    remove_memory_root(root)


@pytest.fixture
def short_lease(monkeypatch):
    """Leases that expire 20 ms after they are taken or renewed (the module constant, for tests)."""
    monkeypatch.setattr(lease, "LEASE_SECONDS", 0.02)


def events_dir(run_url: str) -> fsio.Location:
    return fsio.filesystem(run_url).join(EVENTS_DIR)


def commit(log: EventLog, *events) -> None:
    for event in events:
        log.append(event)
    log.commit()


def plant_lease(run_url: str, *, expires_in: float, epoch: int = 3, host: str = "gpu-node-17") -> Lease:
    """The lease of a writer on another host, as it left it (its epoch object too)."""
    planted = Lease(
        host=host,
        pid=4242,
        since="2026-01-02T03:04:05+00:00",
        token="planted",
        epoch=epoch,
        expires_at=time.time() + expires_in,
    )
    events = events_dir(run_url)
    events.makedirs()
    events.join(LOCK_NAME).write_atomic(msgspec.json.encode(planted))
    events.join(epoch_name(epoch)).write_atomic(msgspec.json.encode(planted))
    return planted


def wait_out(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(seconds / 4)


def test_a_successor_takes_an_expired_lease_and_the_old_writer_can_never_commit_again(
    memory_run, short_lease
):
    first = EventLog.open(memory_run, "w")
    commit(first, *EVENTS[:2])
    first.append(EVENTS[2])  # buffered when it loses the lease
    wait_out(0.05)
    with pytest.warns(StaleLockBroken, match=f"expired lease of pid {os.getpid()} .*lease epoch 1"):
        second = EventLog.open(memory_run, "w")
    assert second._lock.lease.epoch == 2 and epochs(events_dir(memory_run)) == [2]
    with pytest.raises(LogWriteError, match=r"lost the lease to pid \d+ on host .*lease epoch 2"):
        first.commit()
    commit(second, *EVENTS[2:5])
    with pytest.raises(LogWriteError, match="lost the lease"):  # and every later commit
        first.commit()
    first.close()  # leaves the successor's lock alone
    assert read_lease(events_dir(memory_run).join(LOCK_NAME)).token == second._lock.info.token
    commit(second, EVENTS[5])
    second.close()
    assert read_events(memory_run) == EVENTS[:6]


def test_a_paused_writer_that_trusts_its_lease_is_fenced_by_the_claimed_segment(memory_run, short_lease):
    """The writer checked its lease, then stalled (or its clock lags): its next object name is the one
    the successor claimed, so the put fails and nothing of it lands after the successor's records."""
    first = EventLog.open(memory_run, "w")
    commit(first, EVENTS[0])
    frozen = first._lock.renewed_at
    first._lock.clock = lambda: frozen  # its lease looks fresh to it forever
    wait_out(0.05)
    with pytest.warns(StaleLockBroken, match="expired lease"):
        second = EventLog.open(memory_run, "w")
    claimed = events_dir(memory_run).join(segment_name(1))
    assert claimed.read_bytes() == b""  # the epoch's claim: an empty segment after the last one
    with pytest.raises(
        LogWriteError, match=rf"lost the lease to pid {os.getpid()}.*epoch 2.*{segment_name(1)}"
    ):
        commit(first, EVENTS[1])
    assert claimed.read_bytes() == b""  # not overwritten
    commit(second, *EVENTS[1:3])
    with pytest.raises(LogWriteError, match="lost the lease"):
        first.commit()
    first.close()
    second.close()
    assert read_events(memory_run) == EVENTS[:3]
    with EventLog.open(memory_run) as reader:
        assert [record.seq for record in reader.records()] == [0, 1, 2]


def test_the_expired_lease_of_a_dead_job_on_another_host_is_taken_over(memory_run):
    with EventLog.open(memory_run, "w") as log:  # what the job committed before its node went away
        commit(log, *EVENTS[:2])
    plant_lease(memory_run, expires_in=-1)
    with pytest.warns(StaleLockBroken, match=r"expired lease of pid 4242 on host gpu-node-17 .*epoch 3"):
        log = EventLog.open(memory_run, "w")
    with log:
        assert log._lock.lease.epoch == 4 and log.next_seq == 2
        commit(log, *EVENTS[2:4])
    assert read_events(memory_run) == EVENTS[:4]
    assert epochs(events_dir(memory_run)) == [4]


def test_a_live_lease_refuses_naming_its_holder_and_expiry(memory_run):
    planted = plant_lease(memory_run, expires_in=30)
    with pytest.raises(
        LogLockedError, match=r"pid 4242 on host gpu-node-17 .*lease epoch 3, expires 20.*taken over once"
    ):
        EventLog.open(memory_run, "w")
    assert read_lease(events_dir(memory_run).join(LOCK_NAME)) == planted  # untouched


def test_an_epoch_taken_without_its_lock_file_written_holds_until_it_expires(memory_run):
    """A taker that created its epoch object but had not yet written the lock file (or died there)."""
    plant_lease(memory_run, expires_in=-5, epoch=1)
    taker = plant_lease(memory_run, expires_in=30, epoch=2, host="gpu-node-18")
    events_dir(memory_run).join(LOCK_NAME).write_atomic(
        msgspec.json.encode(
            msgspec.structs.replace(taker, host="gpu-node-17", epoch=1, expires_at=time.time() - 5)
        )
    )
    with pytest.raises(LogLockedError, match=r"gpu-node-18 .*epoch 2"):
        EventLog.open(memory_run, "w")
    events_dir(memory_run).join(epoch_name(2)).write_atomic(
        msgspec.json.encode(msgspec.structs.replace(taker, expires_at=time.time() - 1))
    )
    with pytest.warns(StaleLockBroken, match="gpu-node-18"), EventLog.open(memory_run, "w") as log:
        assert log._lock.lease.epoch == 3


def test_commits_renew_the_lease_once_a_third_has_passed(memory_run):
    now = [1_000_000.0]
    with EventLog.open(memory_run, "w") as log:
        log._lock.clock = lambda: now[0]
        log._lock.renewed_at = now[0]
        lock = events_dir(memory_run).join(LOCK_NAME)
        before = read_lease(lock).expires_at
        now[0] += lease.LEASE_SECONDS / 4
        commit(log, EVENTS[0])
        assert read_lease(lock).expires_at == before  # not due yet: no extra write
        now[0] += lease.LEASE_SECONDS  # even past its expiry: nobody took over, so renewing is safe
        commit(log, EVENTS[1])
        assert read_lease(lock).expires_at == now[0] + lease.LEASE_SECONDS
        assert read_lease(lock).epoch == 1
    assert read_events(memory_run) == EVENTS[:2]


def test_a_clean_release_is_taken_without_warning_or_fence_and_epochs_grow(memory_run):
    for expected_epoch in (1, 2, 3):
        with EventLog.open(memory_run, "w") as log:
            assert log._lock.lease.epoch == expected_epoch
            commit(log, EVENTS[expected_epoch])
        assert not events_dir(memory_run).join(LOCK_NAME).exists()
    names = events_dir(memory_run).list_names()
    assert sorted(n for n in names if n.endswith(".log")) == [segment_name(i) for i in range(3)]  # no claims


def test_a_reader_refuses_a_stale_writers_object_after_its_successors(memory_run, short_lease):
    """Where a store lacks exclusive create and the fence could be raced: an object with records of
    an older epoch after the successor's carries seqs that do not continue the log, so it is refused
    as corruption, never read as if it belonged there."""
    with EventLog.open(memory_run, "w") as log:
        commit(log, *EVENTS[:3])
    stale = bytearray()
    FrameEncoder().append(stale, 1, EVENTS[6])  # what an old writer at seq 1 would have put
    last = max(int(n[:8]) for n in events_dir(memory_run).list_names() if n.endswith(".log"))
    events_dir(memory_run).join(segment_name(last + 1)).write_atomic(stale)
    with pytest.raises(LogCorruptError, match="seq"):
        read_events(memory_run)


def test_a_lease_that_is_not_a_lease_refuses_on_an_object_store(memory_run):
    events = events_dir(memory_run)
    events.makedirs()
    for junk in (
        b"\x00" * (1 << 20),
        msgspec.json.encode({"host": "h", "pid": 1 << 40, "since": "s", "token": "t"}),
    ):
        events.join(LOCK_NAME).write_atomic(junk)
        with pytest.raises(LogLockedError, match="unreadable lock file"):
            EventLog.open(memory_run, "w")


def test_a_dead_holder_on_this_host_is_taken_over_before_expiry_without_a_fence(memory_run, dead_pid):
    with EventLog.open(memory_run, "w") as log:
        commit(log, EVENTS[0])
    plant_lease(memory_run, expires_in=30, epoch=1, host=socket.gethostname())
    lock = events_dir(memory_run).join(LOCK_NAME)
    lock.write_atomic(msgspec.json.encode(msgspec.structs.replace(read_lease(lock), pid=dead_pid)))
    with pytest.warns(StaleLockBroken, match=f"dead pid {dead_pid}"), EventLog.open(memory_run, "w") as log:
        assert log._lock.lease.epoch == 2
        commit(log, EVENTS[1])
    assert sorted(n for n in events_dir(memory_run).list_names() if n.endswith(".log")) == [
        segment_name(0),
        segment_name(1),
    ]


def test_a_writer_that_loses_the_race_for_the_lock_file_leaves_no_epoch_behind(memory_run, monkeypatch):
    """Found in review: the loser's epoch object outranked the winner's lease and stopped the winner at
    its next renewal."""
    events = events_dir(memory_run)
    events.makedirs()
    real = fsio.Location.create_exclusive

    def lock_file_taken_first(self, data):
        if self.name == LOCK_NAME:
            real(self, b"")  # another writer made the lock file between our epoch and our lock
            raise FileExistsError(self.path)
        return real(self, data)

    monkeypatch.setattr(fsio.Location, "create_exclusive", lock_file_taken_first)
    with pytest.raises(LogLockedError):
        EventLog.open(memory_run, "w")
    assert epochs(events) == []  # every epoch this writer took was removed again


def test_cutting_a_torn_tail_on_an_object_store_fetches_only_the_prefix(memory_run, monkeypatch):
    with EventLog.open(memory_run, "w") as log:
        commit(log, *EVENTS[:3])
    segment = events_dir(memory_run).join(segment_name(0))
    intact = segment.read_bytes()
    segment.write_atomic(intact + b"\x00" * 100_000)  # a torn write's tail
    fetched: list[tuple] = []
    fs = segment.fs
    real_cat = type(fs).cat_file

    def recording_cat(self, path, start=None, end=None, **kwargs):
        fetched.append((start, end))
        return real_cat(self, path, start=start, end=end, **kwargs)

    monkeypatch.setattr(type(fs), "cat_file", recording_cat)
    segment.truncate(len(intact))
    assert segment.read_bytes() == intact and fetched[0] == (0, len(intact))


@pytest.mark.parametrize("when", ["before the lock file is read", "between the epochs and the lock file"])
def test_a_takeover_completed_while_another_writer_looks_is_seen_and_refuses_it(memory_run, monkeypatch, when):
    """Found in review: B read no lock file, then A took the lease whole, then B listed A's epoch and took
    the next one over A's live lease, unfenced. The epochs are now listed first, and a live epoch without
    its lock file holds the log."""
    events = events_dir(memory_run)
    events.makedirs()
    lock = events.join(LOCK_NAME)
    real_epochs, holders = lease.epochs, []

    def epochs_with_a_slipping_in(directory):
        if holders:  # A's own calls
            return real_epochs(directory)
        holders.append(None)
        found = real_epochs(directory) if when != "before the lock file is read" else None
        holders[0] = lease.ObjectLease.acquire(lock)  # A takes the lease whole, between B's looks
        return found if found is not None else real_epochs(directory)

    monkeypatch.setattr(lease, "epochs", epochs_with_a_slipping_in)
    with pytest.raises(LogLockedError):
        lease.ObjectLease.acquire(lock)  # B
    assert holders[0].lease.epoch == 1 and read_lease(lock).epoch == 1 and real_epochs(events) == [1]


def test_an_epoch_released_cleanly_frees_the_log_even_before_its_lock_file_goes(memory_run):
    with EventLog.open(memory_run, "w") as log:
        commit(log, EVENTS[0])
        taken = log._lock.lease.epoch
    released = lease.epoch_lease(events_dir(memory_run), taken)
    assert released is not None and released.released  # said so in its epoch object
    # As if the release died between the epoch object and the lock file: the log is free all the same.
    events_dir(memory_run).join(LOCK_NAME).write_atomic(
        msgspec.json.encode(msgspec.structs.replace(released, released=False))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no takeover warning, no fence: a free log
        log = EventLog.open(memory_run, "w")
    with log:
        assert log._lock.lease.epoch == taken + 1
