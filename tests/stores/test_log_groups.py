"""Commit-group end marks: a tail that was never acknowledged is cut, damage to what was is not; old
(format-1) frames read as before, also followed by new ones; segments are read in bounded pieces and
only when they are regular files of the run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import msgspec
import pytest

from rewind.states.events import SCHEMA_VERSION
from rewind.stores.codec import (
    CHECKED_HEADER,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    MAGIC,
    MAX_PAYLOAD,
    RESIDUE,
    TRAILER,
    BadFrame,
    LogCorruptError,
    LogError,
    UnreadableSegmentError,
    crc_extend,
    encode_frame,
    parse_header,
)
from rewind.stores.eventlog import (
    EVENTS_DIR,
    EventLog,
    TornTailTruncated,
    read_events,
    segment_name,
    verify_log,
)
from rewind.stores.runguard import NotWritable
from tests.stores.samples import sample_events


def write(run: str, groups: list[list]) -> list[int]:
    """Commit each group; returns the segment size after each commit."""
    sizes = []
    with EventLog.open(run, "w") as log:
        for group in groups:
            for event in group:
                log.append(event)
            log.commit()
            sizes.append(log._last_size)
    return sizes


def segment_path(run: str, index: int = 0) -> str:
    return os.path.join(run, EVENTS_DIR, segment_name(index))


def frame_starts(data: bytes, start: int) -> list[int]:
    starts = []
    while start < len(data):
        starts.append(start)
        start += FRAME_OVERHEAD + int.from_bytes(data[start + 4 : start + 8], "little")
    return starts


def test_a_zero_filled_hole_then_intact_frames_of_an_unacknowledged_commit_is_cut(local_run, no_syncs):
    events = sample_events(9)
    sizes = write(local_run, [events[:3], events[3:]])
    path = segment_path(local_run)
    data = bytearray(Path(path).read_bytes())
    starts = frame_starts(bytes(data), sizes[0])
    # The second commit never returned: its last frame (the end mark) never reached the disk, and a
    # block in the middle of it reads as zeros -- yet frames after the hole are intact.
    del data[starts[-1] :]
    data[starts[1] : starts[2]] = bytes(starts[2] - starts[1])
    Path(path).write_bytes(data)
    with EventLog.open(local_run) as log:
        assert log.events() == events[:3]
        torn = log.torn_tail
        assert (torn.offset, torn.num_bytes, torn.certain) == (sizes[0], len(data) - sizes[0], True)
        assert "never acknowledged" in torn.reason
    report = verify_log(local_run)
    assert report.ok and report.torn_tail == torn and report.num_records == 3
    with pytest.warns(TornTailTruncated, match=f"{len(data) - sizes[0]} bytes at offset {sizes[0]}"):
        EventLog.open(local_run, "w").close()
    assert os.path.getsize(path) == sizes[0]
    assert read_events(local_run) == events[:3]


def test_a_hole_before_an_intact_end_mark_is_damage(local_run, no_syncs):
    events = sample_events(9)
    sizes = write(local_run, [events[:3], events[3:]])
    path = segment_path(local_run)
    data = bytearray(Path(path).read_bytes())
    starts = frame_starts(bytes(data), sizes[0])
    data[starts[1] : starts[2]] = bytes(starts[2] - starts[1])  # the end mark after it is intact
    Path(path).write_bytes(data)
    with pytest.raises(LogCorruptError, match="intact records follow") as info:
        read_events(local_run)
    assert info.value.offset == starts[1]
    with pytest.raises(LogCorruptError):
        EventLog.open(local_run, "w")
    assert Path(path).read_bytes() == bytes(data)  # nothing cut


@pytest.mark.parametrize("where", ["payload", "trailer", "flags", "length", "magic"])
def test_a_flipped_bit_in_the_last_acknowledged_record_is_damage_not_a_torn_tail(local_run, where):
    events = sample_events(4)
    write(local_run, [events[:2], events[2:]])
    path = segment_path(local_run)
    data = bytearray(Path(path).read_bytes())
    last = frame_starts(bytes(data), 0)[-1]
    position = {"payload": last + 30, "trailer": len(data) - 2, "flags": last + 18, "length": last + 5}
    data[position.get(where, last + 2)] ^= 0x08
    Path(path).write_bytes(data)
    with pytest.raises(LogCorruptError) as info:
        read_events(local_run)
    assert info.value.offset == last and "damage" in info.value.reason
    report = verify_log(local_run)
    assert report.torn_tail is None and [(p.segment, p.offset) for p in report.problems] == [
        (segment_name(0), last)
    ]


def test_an_ordinary_torn_tail_is_cut_with_a_warning(local_run, no_syncs):
    events = sample_events(5)
    sizes = write(local_run, [events[:2], events[2:]])
    path = segment_path(local_run)
    os.truncate(path, sizes[1] - 7)  # the second commit's last frame, cut short
    report = verify_log(local_run)
    assert report.ok and (report.torn_tail.offset, report.torn_tail.num_bytes) == (
        sizes[0],
        sizes[1] - 7 - sizes[0],
    )
    with pytest.warns(TornTailTruncated, match=f"at offset {sizes[0]}"), EventLog.open(local_run, "w") as log:
        assert log.events() == events[:2]
        log.append(events[2])
        log.commit()
    assert read_events(local_run) == [*events[:2], events[2]]


def test_a_lost_last_partial_sector_of_an_unacknowledged_commit_is_a_torn_tail(tmp_path, no_syncs):
    """The last sector a commit wrote may be partial (the segment ends mid-sector) and never reach the
    disk while the closing frame's header, in the sector before, did: zeros from the sector boundary to
    the end, however few bytes that is (here under 64), are a torn write, not damage."""
    events = sample_events(160)
    for n in range(1, len(events) - 1):  # a first commit whose second commit's end lands 4..63 bytes into a sector
        run = str(tmp_path / f"run{n}")
        sizes = write(run, [events[:n], [events[n]]])
        boundary = sizes[1] // 512 * 512
        if sizes[0] + HEADER_SIZE <= boundary and 4 <= sizes[1] - boundary < 64:
            break
    else:
        pytest.fail("no commit ends 4..63 bytes into a sector: change the sample sizes")
    path = segment_path(run)
    data = bytearray(Path(path).read_bytes())
    data[boundary:] = bytes(len(data) - boundary)
    Path(path).write_bytes(bytes(data))
    with pytest.warns(TornTailTruncated, match=f"at offset {sizes[0]}"), EventLog.open(run, "w") as log:
        assert log.events() == events[:n]


def test_old_frames_read_as_before_and_new_ones_follow_them(local_run, no_syncs):
    events = sample_events(6)
    encode = msgspec.msgpack.encode
    old = [encode_frame(seq, encode(event), frame_format=1) for seq, event in enumerate(events[:3])]
    os.makedirs(os.path.join(local_run, EVENTS_DIR))
    Path(segment_path(local_run)).write_bytes(b"".join(old))
    with EventLog.open(local_run, "w") as log:  # a log of rewind before end marks, appended to
        assert log.events() == events[:3]
        for event in events[3:]:
            log.append(event)
        log.commit()
    data = Path(segment_path(local_run)).read_bytes()
    assert data.startswith(b"".join(old)) and data[len(b"".join(old)) :].startswith(b"\x89RLG")
    assert read_events(local_run) == events
    assert verify_log(local_run).ok
    # The rule for old frames: damage with nothing intact after it is a torn tail, as it always was.
    Path(segment_path(local_run)).write_bytes(b"".join(old)[:-3])
    with EventLog.open(local_run) as log:
        assert log.events() == events[:2]
        assert log.torn_tail.offset == len(old[0]) + len(old[1]) and not log.torn_tail.certain


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink-out"])
def test_a_segment_that_is_no_regular_file_of_the_run_is_one_error_and_nothing_read(
    local_run, tmp_path, kind
):
    write(local_run, [sample_events(2)])
    path = segment_path(local_run, 1)
    if kind == "directory":
        os.mkdir(path)
    elif kind == "fifo":
        os.mkfifo(path)  # opening it to read would block forever
    else:
        outside = tmp_path / "elsewhere.log"
        outside.write_bytes(b"x")
        os.symlink(outside, path)
    with pytest.raises(UnreadableSegmentError, match="nothing read"):
        read_events(local_run)
    # A writer looks over the run before it reads its log (rewind.stores.runguard): a FIFO or a link out
    # refuses it there, a directory when the log is read.
    with pytest.raises(UnreadableSegmentError if kind == "directory" else NotWritable):
        EventLog.open(local_run, "w")
    assert any("nothing read" in p.message for p in verify_log(local_run).problems)


def test_an_events_path_that_is_a_regular_file_is_one_error(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / EVENTS_DIR).write_bytes(b"not a directory")
    for mode in ("r", "w"):
        with pytest.raises(LogError, match="not a directory"):
            EventLog.open(str(run), mode)
    with pytest.raises(LogError, match="not a directory"):
        verify_log(str(run))


def test_an_events_directory_that_is_a_symlink_out_of_the_run_is_refused_and_nothing_there_touched(tmp_path):
    """Found in review: through a linked events/, the writer would lock, append and cut a "torn tail"
    off a file outside the run (here someone else's 00000000.log, 2,000 bytes of text)."""
    victim, run = tmp_path / "victim", tmp_path / "run"
    victim.mkdir()
    run.mkdir()
    (victim / segment_name(0)).write_text("someone else's file\n" * 100)
    before = sorted((p.name, p.read_bytes()) for p in victim.iterdir())
    (run / EVENTS_DIR).symlink_to(victim)
    for mode in ("r", "w"):
        with pytest.raises(LogError, match="a symlink"):
            EventLog.open(str(run), mode)
    with pytest.raises(LogError, match="a symlink"):
        verify_log(str(run))
    assert sorted((p.name, p.read_bytes()) for p in victim.iterdir()) == before  # no LOCK, nothing cut


def test_an_oversized_index_file_is_ignored(local_run):
    events = sample_events(30)
    with EventLog.open(local_run, "w", segment_bytes=1_000) as log:
        for event in events:
            log.append(event)
            log.commit()
    index = os.path.join(local_run, EVENTS_DIR, "00000000.idx")
    with open(index, "r+b") as f:
        f.truncate(64 << 20)  # sparse: costs nothing to make, would cost 64 MiB to read whole
    assert read_events(local_run) == events
    assert any("more than an index file" in p.message for p in verify_log(local_run).index_problems)


_BOUNDED = textwrap.dedent(
    """
    import resource, sys, warnings
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
    from rewind.stores.eventlog import EventLog, TornTailTruncated, verify_log
    run = sys.argv[1]
    with EventLog.open(run) as log:
        print(len(log.events()), log.torn_tail.num_bytes)
    report = verify_log(run)
    print(report.ok, report.torn_tail.num_bytes)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        EventLog.open(run, "w").close()
    print(sum(issubclass(w.category, TornTailTruncated) for w in caught))
    """
)


def test_a_16_gib_sparse_zero_tail_is_a_torn_tail_read_in_bounded_memory(local_run):
    events = sample_events(5)
    sizes = write(local_run, [events])
    path = segment_path(local_run)
    os.truncate(path, sizes[-1] + (16 << 30))  # what a crash can leave: a size, and no data
    limit = 1 << 30  # address space for the interpreter and its imports, far less than the segment
    result = subprocess.run(
        [sys.executable, "-c", _BOUNDED, local_run, str(limit)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["5", str(16 << 30), "True", str(16 << 30), "1"]
    assert os.path.getsize(path) == sizes[-1]


def test_a_garbage_tail_with_a_huge_claimed_length_is_cut_without_reading_it(local_run, no_syncs):
    events = sample_events(3)
    sizes = write(local_run, [events])
    path = segment_path(local_run)
    frame = bytearray(encode_frame(3, msgspec.msgpack.encode(events[0]), end_of_group=False))
    frame[4:8] = (0xFFFFFFF0).to_bytes(4, "little")  # a length no frame may have
    frame[HEADER_SIZE:] = b"garbage!" * 40  # and no payload either: a write that went wrong
    with open(path, "ab") as f:
        f.write(frame)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TornTailTruncated)
        with EventLog.open(local_run, "w") as log:
            assert log.events() == events
    assert os.path.getsize(path) == sizes[-1]


def test_a_tail_dense_with_false_magics_is_judged_in_a_few_reads(local_run, no_syncs, monkeypatch):
    """Found in review: every false start re-read a whole window and searched it to its end, so a
    crafted tail of magics took hours. Counted in reads and bytes searched, not timed."""
    from rewind.stores import segsource

    events = sample_events(3)
    sizes = write(local_run, [events])
    with open(segment_path(local_run), "ab") as f:
        f.write(MAGIC * (64 << 10))  # 256 KiB: 65,536 false starts
    reads: list[int] = []
    real_read = segsource.LocalSource._read
    monkeypatch.setattr(segsource.LocalSource, "_read", lambda self, o, n: reads.append(n) or real_read(self, o, n))
    with EventLog.open(local_run) as log:
        assert log.events() == events and log.torn_tail.offset == sizes[-1]
    assert len(reads) < 100 and sum(reads) < 16 * (256 << 10), (len(reads), sum(reads))


def test_a_header_that_checks_out_but_claims_a_huge_length_is_never_believed(local_run, no_syncs):
    """A hostile (or insane) length under a header CRC that matches it: refused by the length guard
    itself, before anything of that size is read."""
    events = sample_events(3)
    sizes = write(local_run, [events])
    head = CHECKED_HEADER.pack(MAGIC, MAX_PAYLOAD + 1, SCHEMA_VERSION, len(events), 1)
    frame = head + TRAILER.pack(crc_extend(RESIDUE, head)) + b"garbage!" * 40
    with pytest.raises(BadFrame, match=f"implausible record length {MAX_PAYLOAD + 1}"):
        parse_header(frame, 0)
    path = segment_path(local_run)
    with open(path, "ab") as f:
        f.write(frame)
    report = verify_log(local_run)
    assert report.ok and report.torn_tail is not None and report.torn_tail.offset == sizes[-1]
    assert "implausible record length" in report.torn_tail.reason


def test_a_read_that_starts_mid_log_says_nothing_about_where_the_log_ends(local_run, no_syncs):
    """Found in review: a read from record 6 of a log with 3 acknowledged records and 4 of a commit that
    never returned left next_seq at 6 and no torn tail; only a read from the start may set them."""
    events = sample_events(7)
    sizes = write(local_run, [events[:3]])
    with open(segment_path(local_run), "ab") as f:  # the frames of a commit that never returned: no end mark
        for seq, event in enumerate(events[3:], start=3):
            f.write(encode_frame(seq, msgspec.msgpack.encode(event), end_of_group=False))
    with EventLog.open(local_run) as log:
        for start in (6, 100):
            list(log.records(start_seq=start))
        assert (log.next_seq, log.torn_tail.offset) == (3, sizes[0])  # as a whole read says
