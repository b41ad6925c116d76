"""Seeking readers and segment index files: every reader agrees with a full read and a filter, for
random logs over many small segments, with index files intact, missing, damaged or stale, and with
a torn tail; the writer's index files match what a scan of their segment finds."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rewind.states.events import RunResumed, StageEntered, StepCommitted
from rewind.stores import fsio, segparse
from rewind.stores.codec import EventDecoder, encode_frame
from rewind.stores.eventlog import (
    EVENTS_DIR,
    EventLog,
    TornTailTruncated,
    read_events,
    segment_name,
    verify_log,
)
from rewind.stores.logindex import (
    INDEX_SUFFIX,
    decode_index,
    encode_index,
    index_name,
    load_index,
    summarize,
)
from rewind.stores.segparse import parse_segment
from tests.stores.conftest import skip_syncs

SEGMENT_BYTES = 300  # a few records per segment: every query crosses segment boundaries


def resumed(seq_first: int, seq_last: int, step: int) -> RunResumed:
    fields: dict = {}
    if "restored" in RunResumed.__struct_fields__:  # before RunResumed lost its copy of the state
        from rewind.states.state import State

        fields["restored"] = State()
    return RunResumed(
        step=step,
        tokens=step * 512,
        checkpoint=f"{step:08d}-00c0ffee",
        superseded_first_seq=seq_first,
        superseded_last_seq=seq_last,
        **fields,
    )


def step_event(step: int) -> StepCommitted:
    return StepCommitted(step=step, tokens=step * 512, stage=0, lr=1e-3, beta=0.0, loss=2.0, rows=[8])


@st.composite
def logs(draw) -> list:
    """Events with steps that mostly grow and sometimes fall back, and RunResumed records with
    arbitrary ranges (empty, overlapping, reaching past the record itself): the readers must not
    assume more than the log format promises."""
    events: list = []
    step = 0
    for _ in range(draw(st.integers(0, 45))):
        kind = draw(st.sampled_from(["step", "step", "step", "stage", "resume"]))
        step = max(0, step + draw(st.integers(-4, 3)))
        if kind == "resume":
            first = draw(st.integers(0, len(events) + 1))
            events.append(resumed(first, first + draw(st.integers(-2, 6)), step))
        elif kind == "stage":
            events.append(StageEntered(step=step, tokens=step * 512, stage=draw(st.integers(0, 3))))
        else:
            events.append(step_event(step))
    return events


def write(url: str, events: list, commit_every: int, segment_bytes: int = SEGMENT_BYTES) -> None:
    with EventLog.open(url, "w", segment_bytes=segment_bytes) as log:
        for i, event in enumerate(events):
            log.append(event)
            if i % commit_every == commit_every - 1:
                log.commit()
        log.commit()


def expected_ranges(events: list) -> list[tuple[int, int]]:
    return [
        (e.superseded_first_seq, e.superseded_last_seq)
        for e in events
        if isinstance(e, RunResumed) and e.superseded_last_seq >= e.superseded_first_seq
    ]


def snapshot(events_dir: str) -> dict[str, bytes]:
    return {name: Path(events_dir, name).read_bytes() for name in sorted(os.listdir(events_dir))}


def spoil(events_dir: str, how: str, which: int, data) -> str | None:
    """Make one index file unusable in the way `how` says; returns its name (None: nothing to spoil)."""
    names = sorted(n for n in os.listdir(events_dir) if n.endswith(INDEX_SUFFIX))
    if not names:
        return None
    name = names[which % len(names)]
    path = Path(events_dir, name)
    blob = path.read_bytes()
    if how == "damaged":
        spoiled = bytearray(blob)
        spoiled[data.draw(st.integers(0, len(blob) - 1), label="byte")] ^= 1 << data.draw(st.integers(0, 7))
        blob = bytes(spoiled)
    else:  # stale: claims steps a query would then skip, and disagrees with the segment on one cheap check
        summary = decode_index(blob)
        off = data.draw(st.sampled_from(["num_bytes", "first_seq", "last_crc", "last_offset", "segment"]))
        changes = {"min_step": 10**9, "max_step": 10**9, "resumes": ()}
        changes[off] = segment_name(999) if off == "segment" else getattr(summary, off) + 1
        blob = encode_index(msgspec.structs.replace(summary, **changes))
    path.write_bytes(blob)
    return name


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=logs(),
    commit_every=st.integers(1, 6),
    index=st.sampled_from(["intact", "deleted", "damaged", "stale"]),
    torn=st.booleans(),
    data=st.data(),
)
def test_seeking_readers_agree_with_a_full_read_and_a_filter(events, commit_every, index, torn, data):
    root = tempfile.mkdtemp(prefix="rewind-logindex-")
    saved = skip_syncs()
    try:
        url = os.path.join(root, "run")
        write(url, events, commit_every)
        events_dir = os.path.join(url, EVENTS_DIR)
        assert verify_log(url).ok  # the writer's index files are exactly what a scan finds
        spoiled = None
        if index == "deleted":
            for name in os.listdir(events_dir):
                if name.endswith(INDEX_SUFFIX):
                    os.remove(os.path.join(events_dir, name))
        elif index in ("damaged", "stale"):
            spoiled = spoil(events_dir, index, data.draw(st.integers(0, 99), label="which"), data)
        if torn and events:
            last = sorted(n for n in os.listdir(events_dir) if n.endswith(".log"))[-1]
            with open(os.path.join(events_dir, last), "ab") as f:
                f.write(encode_frame(len(events), b"\x81\xa4type\xa7ignored")[:-3])
        before = snapshot(events_dir)

        records = list(enumerate(events))
        ranges = expected_ranges(events)
        with EventLog.open(url) as log:
            assert log.superseded_ranges() == ranges
            summaries = log.segment_summaries()
            assert [s.first_seq for s in summaries[1:]] == [s.next_seq for s in summaries[:-1]]
            assert (log.next_seq, bool(log.torn_tail)) == (len(events), torn and bool(events))
            n = len(events)
            start = data.draw(st.integers(0, n + 2), label="start")
            stop = data.draw(st.one_of(st.none(), st.integers(start, n + 3)), label="stop")
            got = [(r.seq, r.event) for r in log.records(start, stop)]
            assert got == records[start:stop]
            low = data.draw(st.integers(-1, 50), label="low")
            high = data.draw(st.integers(low - 1, 60), label="high")
            for effective in (False, True):
                got = [(r.seq, r.event) for r in log.records_in_steps(low, high, effective=effective)]
                assert got == [
                    (s, e)
                    for s, e in records
                    if low <= e.step <= high and not (effective and any(a <= s <= b for a, b in ranges))
                ]
        assert snapshot(events_dir) == before  # reading wrote nothing, repaired nothing

        report = verify_log(url)
        assert not report.problems
        if spoiled is not None:
            (problem,) = report.index_problems
            assert problem.segment == spoiled
            assert ("damaged" if index == "damaged" else "stale") in problem.message
        else:
            assert report.index_problems == []
    finally:
        shutil.rmtree(root)
        for name, function in saved.items():
            setattr(fsio, name, function)


def test_the_writer_indexes_each_segment_it_seals_and_only_those(run_url):
    events = [step_event(s) for s in range(40)]
    write(run_url, events, commit_every=3)
    events_dir = fsio.filesystem(run_url).join(EVENTS_DIR)
    names = events_dir.list_names()
    segments = sorted(n for n in names if n.endswith(".log"))
    assert len(segments) > 3
    assert sorted(n for n in names if n.endswith(INDEX_SUFFIX)) == [index_name(s) for s in segments[:-1]]
    with EventLog.open(run_url) as log:
        summaries = log.segment_summaries()
        for summary in summaries[:-1]:
            assert load_index(events_dir, summary.segment, summary.first_seq) == summary
        assert summaries[-1].next_seq == 40
        assert [(s.min_step, s.max_step) for s in summaries] == [
            (s.first_seq, s.next_seq - 1) for s in summaries
        ]


def test_the_writer_rewrites_missing_and_wrong_index_files_on_open(run_url):
    write(run_url, [step_event(s) for s in range(30)], commit_every=4)
    events_dir = fsio.filesystem(run_url).join(EVENTS_DIR)
    indexes = sorted(n for n in events_dir.list_names() if n.endswith(INDEX_SUFFIX))
    good = {name: events_dir.join(name).read_bytes() for name in indexes}
    events_dir.join(indexes[0]).remove()
    events_dir.join(indexes[1]).write_atomic(b"not an index")
    summary = decode_index(good[indexes[2]])
    events_dir.join(indexes[2]).write_atomic(encode_index(msgspec.structs.replace(summary, max_step=-5)))
    assert len(verify_log(run_url).index_problems) == 2
    with EventLog.open(run_url):  # a reader changes nothing
        pass
    assert len(verify_log(run_url).index_problems) == 2
    with EventLog.open(run_url, "w"):
        pass
    assert {name: events_dir.join(name).read_bytes() for name in indexes} == good
    assert verify_log(run_url).ok


def test_an_index_that_passes_the_cheap_checks_but_lies_is_named_by_verify(run_url):
    write(run_url, [step_event(s) for s in range(30)], commit_every=4)
    events_dir = fsio.filesystem(run_url).join(EVENTS_DIR)
    name = sorted(n for n in events_dir.list_names() if n.endswith(INDEX_SUFFIX))[1]
    summary = decode_index(events_dir.join(name).read_bytes())
    events_dir.join(name).write_atomic(encode_index(msgspec.structs.replace(summary, min_step=10**6)))
    (problem,) = verify_log(run_url).index_problems
    assert problem.segment == name
    assert "stale index file" in problem.message and "min_step 1000000" in problem.message
    assert "they trust it" in problem.message


def test_an_index_file_without_its_segment_is_named_by_verify(run_url):
    write(run_url, [step_event(s) for s in range(20)], commit_every=4)
    events_dir = fsio.filesystem(run_url).join(EVENTS_DIR)
    events_dir.join("00000099.idx").write_atomic(b"anything")
    (problem,) = verify_log(run_url).index_problems
    assert problem.segment == "00000099.idx" and "does not exist" in problem.message
    assert not verify_log(run_url).problems  # the log itself is fine


def test_a_log_written_with_big_segments_reads_the_same_with_small_ones_after(run_url):
    events = [step_event(s) for s in range(60)]
    write(run_url, events[:30], commit_every=5, segment_bytes=64 << 20)
    write(run_url, events[30:], commit_every=5, segment_bytes=SEGMENT_BYTES)
    with EventLog.open(run_url) as log:
        assert [r.event for r in log.records_in_steps(25, 35)] == events[25:36]
        assert [r.seq for r in log.records(28, 33)] == list(range(28, 33))
    assert read_events(run_url) == events
    assert verify_log(run_url).ok


def test_summaries_of_a_scan_and_of_the_writer_agree_on_resumes(local_run):
    events = [step_event(1), step_event(2), resumed(1, 1, 1), step_event(2), resumed(4, 3, 2)]
    write(local_run, events, commit_every=1, segment_bytes=10)  # a segment per record
    with EventLog.open(local_run) as log:
        summaries = log.segment_summaries()
        assert [(m.seq, m.first, m.last) for s in summaries for m in s.resumes] == [(2, 1, 1), (4, 4, 3)]
        assert log.superseded_ranges() == [(1, 1)]
        assert [r.seq for r in log.records_in_steps(2, 2, effective=True)] == [3, 4]
    events_dir = fsio.filesystem(local_run).join(EVENTS_DIR)
    for summary in summaries:
        data = events_dir.join(summary.segment).read_bytes()
        parsed = parse_segment(summary.segment, data, seq=summary.first_seq, decoder=EventDecoder())
        assert summarize(summary.segment, summary.first_seq, parsed) == summary


@pytest.mark.parametrize("start", [0, 3, 7])
def test_follow_from_a_seq_starts_there(run_url, start):
    events = [step_event(s) for s in range(12)]
    write(run_url, events, commit_every=2)
    with EventLog.open(run_url) as log:
        seen = [r.seq for r in log.follow(poll_s=0.0, stop=lambda: True, start_seq=start)]
    assert seen == list(range(start, 12))


def test_narrow_queries_read_only_the_segments_they_need(local_run, monkeypatch):
    write(local_run, [step_event(s) for s in range(200)], commit_every=10)
    read: list[str] = []
    real_window = segparse.SegmentChunks._window

    def counting_window(chunks, begin):  # the reads that decode a segment (not a header's peek)
        read.append(chunks.name)
        return real_window(chunks, begin)

    monkeypatch.setattr(segparse.SegmentChunks, "_window", counting_window)
    with EventLog.open(local_run) as log:
        summaries = log.segment_summaries()
        assert len(summaries) > 20
        last = summaries[-1].segment
        holding = {s.segment for s in summaries if s.may_hold_steps(100, 101)}
        read.clear()
        assert [r.event.step for r in log.records_in_steps(100, 101)] == [100, 101]
        assert set(read) == holding | {last} and len(read) <= 3
        read.clear()
        assert [r.seq for r in log.records(150, 152)] == [150, 151]
        assert read == [s.segment for s in summaries if s.first_seq < 152 and s.next_seq > 150]
        read.clear()
        assert log.superseded_ranges() == [] and read == [last]


def test_a_read_that_stops_early_says_nothing_about_the_end(run_url):
    write(run_url, [step_event(s) for s in range(5)], commit_every=5, segment_bytes=64 << 20)
    with EventLog.open(run_url) as log:
        assert [r.seq for r in log.records(0, 1)] == [0]
        assert log.next_seq == 5


def test_a_writer_that_checks_only_the_tail_reads_only_unindexed_segments(local_run, monkeypatch):
    events = [step_event(s) for s in range(60)]
    write(local_run, events[:50], commit_every=5)
    events_dir = os.path.join(local_run, EVENTS_DIR)
    segments = sorted(n for n in os.listdir(events_dir) if n.endswith(".log"))
    os.remove(os.path.join(events_dir, index_name(segments[2])))
    last = Path(events_dir, segments[-1])
    last.write_bytes(last.read_bytes() + encode_frame(50, b"\x81")[:-2])  # a torn tail
    read: list[str] = []
    real_window = segparse.SegmentChunks._window
    monkeypatch.setattr(
        segparse.SegmentChunks, "_window", lambda chunks, begin: read.append(chunks.name) or real_window(chunks, begin)
    )
    with pytest.warns(TornTailTruncated), EventLog.open(local_run, "w", check="tail") as log:
        assert log.next_seq == 50
        for event in events[50:]:
            log.append(event)
        log.commit()
    assert list(dict.fromkeys(read)) == [segments[2], segments[-1]]
    monkeypatch.undo()
    assert read_events(local_run) == events
    assert verify_log(local_run).ok  # the missing index was written on open
    with pytest.raises(ValueError, match="check"):
        EventLog.open(local_run, "w", check="some")  # type: ignore[arg-type]
