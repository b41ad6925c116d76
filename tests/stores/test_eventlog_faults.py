"""Faults: torn writes at every byte, bit flips anywhere, a full disk, a crash between write and sync."""

from __future__ import annotations

import errno
import os
import shutil
import uuid
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rewind.states.events import FadeEnded, RunFinished, StageEntered
from rewind.stores import fsio
from rewind.stores.codec import FRAME_OVERHEAD
from rewind.stores.eventlog import (
    EVENTS_DIR,
    EventLog,
    LogCorruptError,
    LogWriteError,
    StaleLockBroken,
    TornTailTruncated,
    read_events,
    segment_name,
    verify_log,
)
from tests.stores.conftest import remove_memory_root
from tests.stores.samples import sample_events

# The last records are small ones, so that cutting at every byte inside them stays quick.
SMALL_TAIL = [StageEntered(step=40, tokens=20480, stage=1), FadeEnded(step=41, tokens=20992, boundary=0)]


def write_log(run_url: str, events: list, segment_bytes: int = 64 << 20) -> list[int]:
    """Commit each event on its own; returns the end offset of every record in its segment."""
    ends = []
    with EventLog.open(run_url, "w", segment_bytes=segment_bytes) as log:
        for event in events:
            log.append(event)
            log.commit()
            ends.append(log._last_size)
    return ends


def test_a_cut_at_any_byte_of_the_last_records_loses_only_the_torn_record(tmp_path, no_syncs):
    events = [*sample_events(5), *SMALL_TAIL]
    pristine = tmp_path / "pristine"
    ends = write_log(str(pristine), events)
    data = (pristine / EVENTS_DIR / segment_name(0)).read_bytes()
    first_cut = ends[-4]
    for cut in range(first_cut, len(data)):
        run = tmp_path / f"cut-{cut}"
        (run / EVENTS_DIR).mkdir(parents=True)
        (run / EVENTS_DIR / segment_name(0)).write_bytes(data[:cut])
        num_kept = sum(end <= cut for end in ends)
        if cut in ends:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                log = EventLog.open(str(run), "w")
        else:
            with pytest.warns(TornTailTruncated, match=f"{cut - ends[num_kept - 1]} bytes"):
                log = EventLog.open(str(run), "w")
        with log:
            assert log.next_seq == num_kept
            assert log.events() == events[:num_kept]
            assert log.append(RunFinished(step=99, tokens=0)) == num_kept
            log.commit()
        assert read_events(str(run)) == [*events[:num_kept], RunFinished(step=99, tokens=0)]
        shutil.rmtree(run)


FLIP_EVENTS = [*sample_events(6), *SMALL_TAIL]


@pytest.fixture(scope="module")
def flip_log(tmp_path_factory):
    """A pristine log over three segments, and where each record starts and ends."""
    run = tmp_path_factory.mktemp("flip") / "run"
    write_log(str(run), FLIP_EVENTS, segment_bytes=450)
    records = list(EventLog.open(str(run)).records())
    segments = {r.segment: (run / EVENTS_DIR / r.segment).read_bytes() for r in records}
    assert len(segments) >= 3
    spans = {
        r.seq: (r.segment, r.offset, r.offset + FRAME_OVERHEAD + _length(segments[r.segment], r))
        for r in records
    }
    return segments, spans


def _length(data: bytes, record) -> int:
    return int.from_bytes(data[record.offset + 4 : record.offset + 8], "little")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_a_flipped_bit_anywhere_is_detected_where_it_is(flip_log, position, bit):
    segments, spans = flip_log
    total = sum(len(d) for d in segments.values())
    target = int(position * total)
    names = sorted(segments)
    for name in names:
        if target < len(segments[name]):
            break
        target -= len(segments[name])
    seq = next(s for s, (seg, start, end) in spans.items() if seg == name and start <= target < end)
    damaged = bytearray(segments[name])
    damaged[target] ^= 1 << bit

    root = f"/rewind-flips/{uuid.uuid4().hex}"
    run_url = f"memory://{root}/run"
    try:
        events_dir = fsio.filesystem(run_url).join(EVENTS_DIR)
        for segment_file, data in segments.items():
            events_dir.join(segment_file).write_atomic(bytes(damaged) if segment_file == name else data)
        # Every record was acknowledged (each commit returned), the last one too: its end-of-group
        # mark, or its payload checked against its own CRC, says so. So a flip anywhere is damage,
        # raised where it is; never a torn tail cut off.
        with pytest.raises(LogCorruptError) as info:
            read_events(run_url)
        assert (info.value.segment, info.value.offset) == (name, spans[seq][1])
        with pytest.raises(LogCorruptError):
            EventLog.open(run_url, "w").close()  # the writer refuses too, and cuts nothing
        assert events_dir.join(name).read_bytes() == bytes(damaged)
        report = verify_log(run_url)
        assert report.torn_tail is None
        assert (report.problems[0].segment, report.problems[0].offset) == (name, spans[seq][1])
    finally:
        remove_memory_root(root)


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_during_write_commits_nothing_and_a_retry_works(local_run, monkeypatch):
    events = sample_events(6)
    real_write = os.write

    def short_then_full(fd, data):
        real_write(fd, bytes(data[: len(data) // 2]))  # some bytes land, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    with EventLog.open(local_run, "w") as log:
        for e in events[:3]:
            log.append(e)
        log.commit()
        size = log._last_size
        for e in events[3:]:
            log.append(e)
        monkeypatch.setattr(os, "write", short_then_full)
        with pytest.raises(LogWriteError, match=r"No space left.*can be retried"):
            log.commit()
        monkeypatch.undo()
        assert (log.num_committed, log.next_seq) == (3, 6)
        assert os.path.getsize(os.path.join(local_run, EVENTS_DIR, segment_name(0))) == size
        assert log.events() == events[:3]
        assert log.commit() == 3
    assert read_events(local_run) == events


def test_a_failed_sync_while_rolling_over_removes_the_new_segment(local_run, monkeypatch):
    events = sample_events(8)
    with EventLog.open(local_run, "w", segment_bytes=600) as log:
        log.append(events[0])
        log.commit()
        for e in events[1:]:
            log.append(e)
        calls = []
        real_sync = fsio.sync_fd

        def second_sync_fails(fd):
            calls.append(fd)
            if len(calls) == 2:
                _enospc()
            real_sync(fd)

        monkeypatch.setattr(fsio, "sync_fd", second_sync_fails)
        with pytest.raises(LogWriteError):
            log.commit()
        monkeypatch.undo()
        assert sorted(os.listdir(os.path.join(local_run, EVENTS_DIR))) == [segment_name(0), "LOCK"]
        assert log.events() == events[:1]
        assert log.commit() == 7
    assert read_events(local_run) == events
    assert verify_log(local_run).num_segments > 1


def test_a_failed_rollback_makes_the_writer_refuse_until_reopened(local_run, monkeypatch):
    events = sample_events(4)
    real_write = os.write
    with EventLog.open(local_run, "w") as log:
        log.append(events[0])
        log.commit()
        log.append(events[1])
        monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])) and _enospc())
        monkeypatch.setattr(os, "truncate", _enospc)
        with pytest.raises(LogWriteError, match="rolling back a failed commit failed too"):
            log.commit()
        monkeypatch.undo()
        with pytest.raises(LogWriteError, match="close and reopen"):
            log.append(events[2])
    with pytest.warns(TornTailTruncated, match="7 bytes"), EventLog.open(local_run, "w") as log:
        assert log.events() == events[:1]


class SimulatedCrash(BaseException):
    """The process dies here: no handler runs."""


@pytest.mark.parametrize("survives", [False, True], ids=["unsynced-bytes-lost", "unsynced-bytes-kept"])
def test_a_crash_between_write_and_sync_loses_no_committed_record(local_run, monkeypatch, crash, survives):
    events = sample_events(6)
    segment_path = os.path.join(local_run, EVENTS_DIR, segment_name(0))
    log = EventLog.open(local_run, "w")
    for e in events[:4]:
        log.append(e)
    log.commit()
    synced_size = os.path.getsize(segment_path)
    for e in events[4:]:
        log.append(e)
    monkeypatch.setattr(fsio, "sync_fd", lambda fd: (_ for _ in ()).throw(SimulatedCrash()))
    with pytest.raises(SimulatedCrash):
        log.commit()
    monkeypatch.undo()
    crash(log)
    assert os.path.getsize(segment_path) > synced_size  # written, never synced
    if not survives:
        os.truncate(segment_path, synced_size)  # power loss: the page cache never reached the disk
    with pytest.warns(StaleLockBroken), EventLog.open(local_run, "w") as log:
        assert log.events() == (events if survives else events[:4])


def test_a_full_object_store_commits_nothing_and_a_retry_works(monkeypatch):
    root = f"/rewind-full/{uuid.uuid4().hex}"
    run_url = f"memory://{root}/run"
    events = sample_events(4)
    try:
        with EventLog.open(run_url, "w") as log:
            log.append(events[0])
            log.commit()
            log.append(events[1])
            log.append(events[2])
            for put in ("write_atomic", "create_exclusive"):  # however a commit puts its objects
                monkeypatch.setattr(fsio.Location, put, lambda self, data: _enospc())
            with pytest.raises(LogWriteError, match="can be retried"):
                log.commit()
            monkeypatch.undo()
            assert log.events() == events[:1] and log.num_committed == 1
            assert log.commit() == 2
        assert read_events(run_url) == events[:3]
    finally:
        remove_memory_root(root)
