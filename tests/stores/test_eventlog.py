"""Contract of the event log, run on every backend (local files and memory:// object semantics)."""

from __future__ import annotations

import threading
import time

import pytest

from rewind.states.events import SCHEMA_VERSION, RunFinished, StageEntered
from rewind.stores import fsio
from rewind.stores.codec import FRAME_OVERHEAD, HEADER_SIZE, encode_frame
from rewind.stores.eventlog import (
    EVENTS_DIR,
    EventLog,
    LogCorruptError,
    LogModeError,
    LogNotFoundError,
    TornTailTruncated,
    read_events,
    segment_name,
    verify_log,
)
from tests.stores.samples import sample_events


def segment(run_url: str, index: int) -> fsio.Location:
    return fsio.filesystem(run_url).join(EVENTS_DIR, segment_name(index))


def segment_indices(run_url: str) -> list[int]:
    names = fsio.filesystem(run_url).join(EVENTS_DIR).list_names()
    return sorted(int(n.split(".")[0]) for n in names if n.endswith(".log"))


def write_log(run_url: str, events: list, *, commit_every: int = 1, segment_bytes: int = 64 << 20) -> None:
    with EventLog.open(run_url, "w", segment_bytes=segment_bytes) as log:
        for i, event in enumerate(events):
            log.append(event)
            if (i + 1) % commit_every == 0:
                log.commit()
        log.commit()


def test_appends_return_contiguous_seqs_and_commit_makes_them_readable(run_url):
    events = sample_events(12)
    with EventLog.open(run_url, "w") as log:
        assert [log.append(e) for e in events[:5]] == [0, 1, 2, 3, 4]
        assert log.num_committed == 0
        assert log.events() == []  # buffered is not committed
        assert log.commit() == 5
        assert [log.append(e) for e in events[5:]] == list(range(5, 12))
        assert log.commit() == 7
        assert log.commit() == 0  # nothing buffered: no I/O, nothing to report
        assert log.next_seq == log.num_committed == 12
        records = list(log.records())
    assert [r.seq for r in records] == list(range(12))
    assert [r.event for r in records] == events
    assert {r.version for r in records} == {SCHEMA_VERSION}
    assert read_events(run_url) == events
    report = verify_log(run_url)
    assert report.ok and report.torn_tail is None and report.num_records == 12 and report.next_seq == 12


def test_record_locations_point_at_their_frames(run_url):
    events = sample_events(6)
    write_log(run_url, events, commit_every=2, segment_bytes=400)
    records = list(EventLog.open(run_url).records())
    assert len({r.segment for r in records}) > 2
    for record, after in zip(records, [*records[1:], None], strict=True):
        data = segment(run_url, int(record.segment.split(".")[0])).read_bytes()
        assert data[record.offset : record.offset + 4] == b"\x89RLG"  # frame format 2
        assert int.from_bytes(data[record.offset + 10 : record.offset + 18], "little") == record.seq
        flags = int.from_bytes(data[record.offset + 18 : record.offset + HEADER_SIZE - 4], "little")
        # END_OF_GROUP: the last record of each commit, and the last it wrote to each segment
        assert flags == (record.seq % 2 == 1 or after is None or after.segment != record.segment)


def test_segments_roll_over_at_the_size_limit(run_url):
    events = sample_events(40)
    limit = 600
    write_log(run_url, events, commit_every=7, segment_bytes=limit)
    indices = segment_indices(run_url)
    assert indices == list(range(len(indices))) and len(indices) > 3
    sizes = [segment(run_url, i).size() for i in indices]
    assert max(sizes) <= limit
    assert read_events(run_url) == events


def test_a_record_larger_than_the_limit_gets_a_segment_of_its_own(run_url):
    events = sample_events(3)
    write_log(run_url, events, commit_every=3, segment_bytes=10)
    assert len(segment_indices(run_url)) == 3
    assert read_events(run_url) == events


def test_object_stores_write_one_new_segment_per_commit_and_local_appends(run_url):
    write_log(run_url, sample_events(9), commit_every=3)
    # Four commits: three of three records, then an empty one that writes nothing.
    expected = 1 if fsio.filesystem(run_url).is_local else 3
    assert len(segment_indices(run_url)) == expected


def test_reopening_continues_the_sequence(run_url):
    events = sample_events(10)
    write_log(run_url, events[:4])
    write_log(run_url, events[4:], segment_bytes=500)
    with EventLog.open(run_url, "w") as log:
        assert log.next_seq == 10
    assert [r.seq for r in EventLog.open(run_url).records()] == list(range(10))
    assert read_events(run_url) == events


def test_close_drops_uncommitted_appends(run_url):
    events = sample_events(5)
    with EventLog.open(run_url, "w") as log:
        for e in events[:3]:
            log.append(e)
        log.commit()
        log.append(events[3])
    assert read_events(run_url) == events[:3]
    with EventLog.open(run_url, "w") as log:
        assert log.append(events[4]) == 3


def test_misuse_raises_named_errors(run_url):
    with pytest.raises(LogNotFoundError, match="no event log"):
        EventLog.open(run_url)
    write_log(run_url, sample_events(2))
    reader = EventLog.open(run_url)
    with pytest.raises(LogModeError, match="reading only"):
        reader.append(StageEntered(step=0, tokens=0, stage=0))
    with pytest.raises(LogModeError, match="reading only"):
        reader.commit()
    reader.close()
    with pytest.raises(LogModeError, match="closed"):
        reader.events()
    with pytest.raises(ValueError, match="mode"):
        EventLog.open(run_url, "a")  # type: ignore[arg-type]


def test_reading_reports_a_torn_tail_without_touching_it(run_url):
    events = sample_events(4)
    write_log(run_url, events)
    last = segment(run_url, segment_indices(run_url)[-1])
    torn = last.read_bytes() + encode_frame(4, b"\x81\xa4type\xa7ignored")[:-5]
    last.write_atomic(torn)
    with EventLog.open(run_url) as log:
        assert log.events() == events
        assert log.torn_tail is not None
        assert (log.torn_tail.segment, log.torn_tail.num_bytes) == (last.name, FRAME_OVERHEAD + 14 - 5)
        assert log.next_seq == 4
    assert last.read_bytes() == torn  # reading never repairs
    assert verify_log(run_url).torn_tail == log.torn_tail
    assert verify_log(run_url).ok

    with (
        pytest.warns(TornTailTruncated, match=f"{FRAME_OVERHEAD + 9} bytes"),
        EventLog.open(run_url, "w") as log,
    ):
        assert log.append(RunFinished(step=9, tokens=0)) == 4
        log.commit()
    assert read_events(run_url) == [*events, RunFinished(step=9, tokens=0)]


def test_damage_before_the_end_raises_with_its_location(run_url):
    events = sample_events(6)
    write_log(run_url, events, segment_bytes=500)
    first = segment(run_url, 0)
    data = bytearray(first.read_bytes())
    data[HEADER_SIZE + 3] ^= 0x10  # inside the first payload
    first.write_atomic(bytes(data))
    with pytest.raises(LogCorruptError, match=r"00000000\.log at byte 0: payload CRC mismatch") as info:
        read_events(run_url)
    assert (info.value.segment, info.value.offset) == ("00000000.log", 0)
    with pytest.raises(LogCorruptError):
        EventLog.open(run_url, "w")
    assert first.read_bytes() == bytes(data)  # a damaged log is never rewritten
    report = verify_log(run_url)
    assert not report.ok and (report.problems[0].segment, report.problems[0].offset) == ("00000000.log", 0)
    # The writer's refusal released the lock: after a repair by hand, writing works again.
    data[HEADER_SIZE + 3] ^= 0x10
    first.write_atomic(bytes(data))
    with EventLog.open(run_url, "w") as log:
        assert log.next_seq == 6


def test_a_missing_segment_is_corruption(run_url):
    write_log(run_url, sample_events(6), segment_bytes=300)
    assert len(segment_indices(run_url)) >= 3
    segment(run_url, 1).remove()
    with pytest.raises(LogCorruptError, match=r"00000001\.log at byte 0: segment file is missing"):
        read_events(run_url)
    assert verify_log(run_url).problems[0].message == "segment file is missing"


def test_sequence_gaps_and_duplicates_are_corruption(run_url):
    events = sample_events(3)
    write_log(run_url, events)
    last = segment(run_url, segment_indices(run_url)[-1])
    original = last.read_bytes()
    payload = b"\x83\xa4type\xacStageEntered\xa4step\x00\xa6tokens\x00"
    for bad_seq, kind in ((5, "gap"), (1, "duplicate")):
        last.write_atomic(original + encode_frame(bad_seq, payload) + encode_frame(bad_seq + 1, payload))
        with pytest.raises(LogCorruptError, match=f"sequence {kind}"):
            read_events(run_url)
        assert any(f"sequence {kind}" in p.message for p in verify_log(run_url).problems)


def test_an_intact_frame_that_is_not_an_event_is_corruption(run_url):
    write_log(run_url, sample_events(2))
    last = segment(run_url, segment_indices(run_url)[-1])
    last.write_atomic(last.read_bytes() + encode_frame(2, b"\x81\xa4type\xa9NoSuchOne"))
    with pytest.raises(LogCorruptError, match="undecodable payload of record 2"):
        read_events(run_url)
    assert "undecodable" in verify_log(run_url).problems[0].message


def test_follow_sees_every_record_once_in_order_while_a_writer_commits(run_url):
    events = sample_events(120)
    done = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            with EventLog.open(run_url, "w", segment_bytes=1500) as log:
                for i, event in enumerate(events):
                    log.append(event)
                    if i % 7 == 6:
                        log.commit()
                        time.sleep(0.001)
                log.commit()
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)
        finally:
            done.set()

    with EventLog.open(run_url, "w"):  # create the log so the reader can open it
        pass
    thread = threading.Thread(target=writer)
    thread.start()
    reader = EventLog.open(run_url)
    seen = list(reader.follow(poll_s=0.002, stop=done.is_set))
    thread.join()
    assert not errors
    assert [r.seq for r in seen] == list(range(len(events)))
    assert [r.event for r in seen] == events


def test_follow_waits_at_a_torn_tail_and_resumes_after_recovery(run_url):
    events = sample_events(5)
    write_log(run_url, events[:3])
    last = segment(run_url, segment_indices(run_url)[-1])
    last.write_atomic(last.read_bytes() + b"\x89RWL\x00\x01")  # a writer died mid-record
    written: list[bool] = []
    follower = EventLog.open(run_url).follow(poll_s=0.0, stop=lambda: bool(written))
    assert [next(follower).seq for _ in range(3)] == [0, 1, 2]
    with pytest.warns(TornTailTruncated):
        write_log(run_url, events[3:])
    written.append(True)
    assert [r.event for r in follower] == events[3:]
