"""Readers decode a segment a chunk at a time (`DECODE_CHUNK_BYTES`): whatever the chunk size, every
reader returns exactly what a whole-segment read returns -- for random logs, with torn tails, with
damage anywhere (raised at the same segment and offset) -- and a streaming consumer holds about one
chunk of decoded records, not a segment."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rewind.states.events import StepCommitted
from rewind.stores import codec, fsio, segparse
from rewind.stores.codec import LogCorruptError, LogError
from rewind.stores.eventlog import EVENTS_DIR, EventLog, segment_name, verify_log
from tests.stores.conftest import skip_syncs
from tests.stores.samples import sample_events
from tests.stores.test_logindex import expected_ranges, logs, write

WHOLE = 1 << 40  # a chunk size that makes every segment one chunk: the whole-segment read


@contextlib.contextmanager
def chunk_size(size: int):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(segparse, "DECODE_CHUNK_BYTES", size)
        yield


def observe(read) -> tuple:
    """What a read gives: ("done", items, torn tail) or ("raised", segment, offset, reason), and
    separately the items a read that raised handed on before it did."""
    got: list = []
    try:
        for item in read():
            got.append(item)
    except LogCorruptError as exc:
        return ("raised", exc.segment, exc.offset, exc.reason), got
    except LogError as exc:  # UnsupportedSchemaError: same fields
        return ("raised", type(exc).__name__, str(exc)), got
    return ("done", got), got


def as_pairs(records) -> list:
    return [(r.seq, r.event, r.segment, r.offset, r.version) for r in records]


def every_read(url: str, start: int, stop: int | None, low: int, high: int, follow_from: int) -> dict:
    """Each reader's outcome on the log at `url`, and what the readers that raised handed on first."""
    outcomes: dict = {}
    handed_on: dict = {}

    def run(name, read, after=None):
        log = EventLog.open(url)
        with log:
            outcome, got = observe(lambda: read(log))
            if outcome[0] == "done" and after is not None:
                outcome = (*outcome, after(log))
        outcomes[name] = outcome
        if outcome[0] == "raised":
            handed_on[name] = got

    state = lambda log: (log.torn_tail, log._scanned_seq)  # noqa: E731
    run("records", lambda log: as_pairs(log.records()), state)
    run("part", lambda log: as_pairs(log.records(start, stop)), state)
    for effective in (False, True):
        run(
            f"steps-{effective}",
            lambda log, effective=effective: as_pairs(log.records_in_steps(low, high, effective=effective)),
        )
    run("events", lambda log: log.events(), state)
    run("summaries", lambda log: log.segment_summaries(), state)
    run("follow", lambda log: as_pairs(log.follow(poll_s=0.0, stop=lambda: True, start_seq=follow_from)))
    try:
        outcomes["verify"] = verify_log(url)
    except LogError as exc:
        outcomes["verify"] = str(exc)
    return outcomes, handed_on


def damage(events_dir: Path, how: str, data) -> None:
    """Spoil the segments on disk the way `how` says (positions drawn from `data`)."""
    names = sorted(n for n in os.listdir(events_dir) if n.endswith(".log"))
    if how == "none" or not names:
        return
    if how in ("torn", "cut"):  # cut the last segment (a torn tail), or any one (corruption if not last)
        name = names[-1] if how == "torn" else data.draw(st.sampled_from(names), label="segment")
        path = events_dir / name
        blob = path.read_bytes()
        path.write_bytes(blob[: data.draw(st.integers(0, len(blob)), label="cut")])
    elif how == "append":  # a partial frame after the last record, as a crash mid-write leaves
        path = events_dir / names[-1]
        frame = codec.encode_frame(10**6, b"\x81\xa4type\xa7ignored")
        path.write_bytes(path.read_bytes() + frame[: data.draw(st.integers(1, len(frame) - 1))])
    else:  # flip: one bit anywhere
        sizes = [(n, (events_dir / n).stat().st_size) for n in names]
        sizes = [(n, size) for n, size in sizes if size]
        if not sizes:
            return
        name, size = data.draw(st.sampled_from(sizes), label="segment")
        path = events_dir / name
        blob = bytearray(path.read_bytes())
        blob[data.draw(st.integers(0, size - 1), label="byte")] ^= 1 << data.draw(st.integers(0, 7))
        path.write_bytes(bytes(blob))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=logs(),
    commit_every=st.integers(1, 6),
    segment_bytes=st.sampled_from([300, 1_000, 64 << 20]),
    how=st.sampled_from(["none", "none", "torn", "append", "cut", "flip", "flip"]),
    tiny=st.sampled_from([1, 100, 250]),
    data=st.data(),
)
def test_every_reader_gives_what_a_whole_segment_read_gives(
    events, commit_every, segment_bytes, how, tiny, data
):
    root = Path(tempfile.mkdtemp(prefix="rewind-chunks-"))
    saved = skip_syncs()
    try:
        url = str(root / "run")
        write(url, events, commit_every, segment_bytes=segment_bytes)
        for index in (root / "run" / EVENTS_DIR).glob("*.idx"):
            if data.draw(st.booleans(), label=f"drop {index.name}"):
                index.unlink()  # as a log of rewind 0.1 has none: the readers scan the segment
        damage(root / "run" / EVENTS_DIR, how, data)
        n = len(events)
        start = data.draw(st.integers(0, n + 1), label="start")
        stop = data.draw(st.one_of(st.none(), st.integers(start, n + 2)), label="stop")
        low = data.draw(st.integers(-1, 50), label="low")
        high = data.draw(st.integers(low - 1, 60), label="high")
        follow_from = data.draw(st.integers(0, n + 1), label="follow from")
        args = (url, start, stop, low, high, follow_from)

        with chunk_size(WHOLE):
            whole, _ = every_read(*args)
        with chunk_size(tiny):
            chunked, handed_on = every_read(*args)
        assert chunked == whole
        event(f"{how}: a full read {whole['records'][0]}, a part {whole['part'][0]}")

        # A read that raised handed on only intact records, in order: a prefix of the records written
        # (it may hand on more of them than a whole-segment read, which raised before any of its segment).
        records = list(enumerate(events))
        ranges = expected_ranges(events)
        written = {
            "records": records,
            "part": records[start:stop],
            "steps-False": [(s, e) for s, e in records if low <= e.step <= high],
            "steps-True": [
                (s, e)
                for s, e in records
                if low <= e.step <= high and not any(a <= s <= b for a, b in ranges)
            ],
            "events": events,
            "follow": records[follow_from:],
        }
        for name, got in handed_on.items():
            if name == "summaries":
                continue
            mine = [item[:2] for item in got] if name != "events" else got
            assert mine == written[name][: len(mine)], name
        if how == "none":
            assert whole["records"][0] == "done" and [r[:2] for r in whole["records"][1]] == records
    finally:
        shutil.rmtree(root)
        for name, function in saved.items():
            setattr(fsio, name, function)


def same_size_step(i: int) -> StepCommitted:
    """Step records that all encode to the same size (msgpack ints of one width)."""
    step = 1_000 + i
    return StepCommitted(step=step, tokens=step * 512, stage=0, lr=1e-3, beta=0.0, loss=2.0, rows=[8])


def big_segment(url: str, num_records: int) -> list[int]:
    """One segment of identical-size step records; returns where each record starts."""
    events = [same_size_step(i) for i in range(num_records)]
    write(url, events, commit_every=num_records, segment_bytes=64 << 20)
    with EventLog.open(url) as log:
        return [r.offset for r in log.records()]


@pytest.mark.parametrize("where", [0.1, 0.6, 0.95])
def test_damage_in_a_later_chunk_raises_at_its_offset_after_the_chunks_before_it(local_run, where):
    starts = big_segment(local_run, 400)
    frame = starts[1] - starts[0]
    bad = int(where * 400)
    path = Path(local_run, EVENTS_DIR, segment_name(0))
    blob = bytearray(path.read_bytes())
    blob[starts[bad] + 30] ^= 0x04  # in the payload of record `bad`
    path.write_bytes(bytes(blob))
    with chunk_size(10 * frame), EventLog.open(local_run) as log:
        seen: list[int] = []
        with pytest.raises(LogCorruptError) as info:
            for record in log.records():
                seen.append(record.seq)
    assert (info.value.segment, info.value.offset) == (segment_name(0), starts[bad])
    assert "CRC mismatch, intact records follow" in info.value.reason
    assert seen == list(range(bad // 10 * 10))  # every chunk before the damaged one, and nothing of it
    with chunk_size(WHOLE), EventLog.open(local_run) as log, pytest.raises(LogCorruptError) as whole:
        list(log.records())
    assert (whole.value.segment, whole.value.offset, whole.value.reason) == (
        info.value.segment,
        info.value.offset,
        info.value.reason,
    )


@pytest.mark.parametrize("cut", [1, 17, -1])
def test_a_torn_tail_in_a_later_chunk_ends_the_read_before_it(local_run, cut):
    starts = big_segment(local_run, 299)
    with EventLog.open(local_run, "w") as log:  # a commit of its own, which a crash then cuts short
        log.append(same_size_step(299))
        log.commit()
        starts.append(log._last_size - (starts[1] - starts[0]))
    frame = starts[1] - starts[0]
    path = Path(local_run, EVENTS_DIR, segment_name(0))
    blob = path.read_bytes()
    path.write_bytes(blob[: starts[-1] + (cut % frame)])  # the last record, cut short
    for size in (1, 7 * frame, WHOLE):
        with chunk_size(size), EventLog.open(local_run) as log:
            assert [r.seq for r in log.records()] == list(range(299))
            assert (log.torn_tail.offset, log.torn_tail.num_bytes) == (starts[-1], cut % frame)
            assert [r.seq for r in log.records(250, 310)] == list(range(250, 299))


@pytest.mark.parametrize("cut", [1, 17, -1])
def test_a_commit_cut_short_is_a_torn_tail_from_its_first_record(local_run, cut):
    starts = big_segment(local_run, 100)  # one commit: the first 100 records
    frame = starts[1] - starts[0]
    with EventLog.open(local_run, "w") as log:  # a second commit of 200 records, cut short below
        for i in range(100, 300):
            log.append(same_size_step(i))
        log.commit()
    path = Path(local_run, EVENTS_DIR, segment_name(0))
    blob = path.read_bytes()
    path.write_bytes(blob[: 299 * frame + (cut % frame)])  # 199 records of it complete, no end mark
    for size in (1, 7 * frame, WHOLE):
        with chunk_size(size), EventLog.open(local_run) as log:
            assert [r.seq for r in log.records()] == list(range(100))
            assert (log.torn_tail.offset, log.torn_tail.num_bytes) == (100 * frame, 199 * frame + cut % frame)
            assert log.torn_tail.certain and "never acknowledged" in log.torn_tail.reason
            assert [r.seq for r in log.records(50, 310)] == list(range(50, 100))
            assert [r.seq for r in log.records(150, 310)] == []
            assert log.torn_tail.offset == 100 * frame  # a read from inside the group says the same


class Live:
    """A decoded event that counts how many of its kind are alive, and how many were ever made."""

    alive = made = peak = 0
    __slots__ = ("event",)

    def __init__(self, event) -> None:
        self.event = event
        Live.alive += 1
        Live.made += 1
        Live.peak = max(Live.peak, Live.alive)

    def __del__(self) -> None:
        Live.alive -= 1

    @property
    def step(self) -> int:
        return self.event.step


def counting(log: EventLog) -> EventLog:
    real = log._decoder.decode_current
    log._decoder.decode_current = lambda payload: Live(real(payload))
    Live.alive = Live.made = Live.peak = 0
    return log


@pytest.mark.parametrize("per_chunk", [1, 7, 40])
def test_a_streaming_consumer_holds_about_one_chunk(local_run, per_chunk):
    starts = big_segment(local_run, 500)
    frame = starts[1] - starts[0]
    with chunk_size(per_chunk * frame):
        with counting(EventLog.open(local_run)) as log:
            consumed = 0
            for _ in log.records():
                consumed += 1
                assert Live.made - consumed < per_chunk  # decoded ahead: the rest of this chunk
                assert Live.alive <= per_chunk
            assert consumed == 500
            # while a chunk decodes, the consumer still holds the last record of the one before
            assert Live.peak <= per_chunk + 1
        for read, chunks in (
            (lambda log: log.records(100, 400), 1),
            (lambda log: log.follow(poll_s=0.0, stop=lambda: True), 1),
            # the scan of the last segment may keep a chunk's worth of what the query wants
            (lambda log: log.records_in_steps(0, 10**9), 2),
        ):
            with counting(EventLog.open(local_run)) as log:
                for _ in read(log):
                    assert Live.alive <= chunks * per_chunk
                assert Live.peak <= chunks * per_chunk + 1
    with chunk_size(WHOLE), counting(EventLog.open(local_run)) as log:  # what the test tells apart
        for _ in log.records():
            pass
        assert Live.peak == 500


def test_a_scan_keeps_no_more_than_a_chunk_of_what_a_step_query_wants(local_run):
    starts = big_segment(local_run, 300)  # one segment, the last: always scanned
    events = [same_size_step(i) for i in range(300)]
    with chunk_size(10 * (starts[1] - starts[0])), counting(EventLog.open(local_run)) as log:
        # kept from the scan (4 records), then handed on: nothing read twice
        assert [r.event.event for r in log.records_in_steps(1_005, 1_008)] == events[5:9]
        assert Live.made == 300 and Live.peak <= 10 + 4 + 1
        # more than a chunk's worth: let go during the scan, and the segment read again
        assert [r.event.event for r in log.records_in_steps(0, 10**9)] == events
        assert Live.made == 300 + 600 and Live.peak <= 2 * 10 + 1


def test_scans_of_many_unindexed_segments_keep_no_more_than_a_chunk_together(local_run):
    starts = big_segment(local_run, 2)
    frame = starts[1] - starts[0]
    shutil.rmtree(local_run)
    events = [same_size_step(i % 20) for i in range(300)]  # steps 1000..1019 over and over
    write(local_run, events, commit_every=7, segment_bytes=20 * frame)  # 15 segments of 20 records
    for index in Path(local_run, EVENTS_DIR).glob("*.idx"):
        index.unlink()  # as in a log of rewind 0.1: every segment is scanned
    with chunk_size(10 * frame), counting(EventLog.open(local_run)) as log:
        assert len(log.segment_summaries()) == 15
        Live.peak = 0
        # 6 records of each segment: 90 in all, more than a chunk (10 records) together
        got = [r.event.event for r in log.records_in_steps(1_000, 1_005)]
        assert got == [e for e in events if e.step <= 1_005]
        assert Live.peak <= 2 * 10 + 1


def test_reading_keeps_the_collector_as_it_was(local_run):
    write(local_run, sample_events(200), commit_every=50, segment_bytes=2_000)
    with chunk_size(500), EventLog.open(local_run) as log:
        assert all(gc.isenabled() for _ in log.records())
        assert gc.get_freeze_count() == 0  # what decoding did to the generations leaves nothing frozen
        gc.disable()
        try:
            assert not any(gc.isenabled() for _ in log.records())
        finally:
            gc.enable()
        gc.freeze()  # what a process that forks workers does: reading must not thaw it
        try:
            frozen = gc.get_freeze_count()
            assert frozen > 0 and len(log.events()) == 200
            # A thaw would leave nothing frozen; frozen objects freed meanwhile may lower the count a bit.
            assert gc.get_freeze_count() > 0.9 * frozen
        finally:
            gc.unfreeze()
