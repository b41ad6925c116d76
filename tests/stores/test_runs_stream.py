"""The streaming readers of `rewind.stores.runs`: the same records as the list readers, effective ones
as `history.effective` keeps them, one segment held at a time, on every backend."""

from __future__ import annotations

import gc
import tracemalloc

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.states.events import RunResumed, StageEntered
from rewind.states.history import effective
from rewind.states.history import superseded_ranges as ranges_in
from rewind.states.strategies import simulate_run
from rewind.stores.codec import HEADER_SIZE
from rewind.stores.eventlog import EventLog, LogCorruptError, LogNotFoundError
from rewind.stores.runs import (
    SupersededFilter,
    iter_effective,
    iter_marked,
    iter_records,
    read_seq_events,
    superseded_ranges,
)
from tests.stores.test_eventlog import segment, segment_indices
from tests.tools.stream_synthetic import long_config, write_run

CRASHES = (260, 555, 557, 900)  # the second and third resume from the same checkpoint


def encoded(records) -> list[bytes]:
    return [msgspec.msgpack.encode((seq, event)) for seq, event in records]


def write_crashed_run(run_url: str, *, num_steps: int = 1_000, segment_bytes: int = 8_192) -> None:
    events = simulate_run(long_config(num_steps), crash_after=[c * num_steps // 1_000 for c in CRASHES])
    write_run(run_url, events, commit_every=10, segment_bytes=segment_bytes)


def test_streamed_records_are_the_listed_ones(run_url):
    write_crashed_run(run_url)
    listed = read_seq_events(run_url)
    assert len(segment_indices(run_url)) > 10 and sum(isinstance(e, RunResumed) for _, e in listed) == 4
    assert encoded(iter_records(run_url)) == encoded(listed)
    assert encoded(iter_effective(run_url)) == encoded(effective(listed))
    kept = {seq for seq, _ in effective(listed)}
    assert [(seq, superseded) for seq, _, superseded in iter_marked(run_url)] == [
        (seq, seq not in kept) for seq, _ in listed
    ]
    assert superseded_ranges(run_url) == (ranges_in(listed), len(listed))
    assert encoded(iter_records(run_url, limit=5)) == encoded(listed[:5])


def test_one_segment_is_held_at_a_time(local_run):
    write_crashed_run(local_run, num_steps=5_000)

    def peak(read) -> int:
        tracemalloc.start()
        try:
            read()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    listed = peak(lambda: read_seq_events(local_run))
    streamed = peak(lambda: sum(1 for _ in iter_effective(local_run)))
    assert listed > 2_000_000 and streamed < listed / 20


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(-1, 60)), max_size=6))
def test_the_filter_answers_as_the_ranges_do(ranges):
    superseded = SupersededFilter(ranges)
    for seq in range(64):
        assert superseded(seq) == any(first <= seq <= last for first, last in ranges)


def test_the_ranges_come_from_the_logs_index_when_it_keeps_one(local_run, monkeypatch):
    write_crashed_run(local_run)
    listed = read_seq_events(local_run)
    monkeypatch.setattr(EventLog, "superseded_ranges", lambda self: [(3, 5), (9, 8)], raising=False)
    assert superseded_ranges(local_run) == ([(3, 5)], len(listed))  # empty ranges dropped
    assert [seq for seq, _ in iter_effective(local_run)] == [s for s, _ in listed if not 3 <= s <= 5]


def test_records_committed_between_the_two_passes_are_left_out(local_run):
    write_crashed_run(local_run)
    before = read_seq_events(local_run)
    stream = iter_effective(local_run)
    first = next(stream)  # the first pass has seen the log as it was
    with EventLog.open(local_run, "w") as log:  # a live writer supersedes the last record
        last = log.next_seq - 1
        log.append(RunResumed(**resumed_fields(before[-1][1], first=last, last=last)))
        log.commit()
    assert encoded([first, *stream]) == encoded(effective(before))


def resumed_fields(event, first: int, last: int) -> dict:
    fields = {"step": event.step, "tokens": event.tokens, "checkpoint": "", "superseded_first_seq": first}
    fields["superseded_last_seq"] = last
    if "restored" in RunResumed.__struct_fields__:  # the schema is dropping it; not needed here
        from rewind.states.fold import fold

        fields["restored"] = fold([])
    return fields


def test_the_collector_runs_while_the_caller_does(local_run):
    write_crashed_run(local_run)
    assert all(gc.isenabled() for _ in iter_records(local_run))
    gc.disable()
    try:
        assert not any(gc.isenabled() for _ in iter_records(local_run))  # and stays off if it was off
    finally:
        gc.enable()


def test_a_missing_or_damaged_log_raises_when_read(tmp_path):
    stream = iter_effective(tmp_path / "nothing")  # nothing is read until asked
    with pytest.raises(LogNotFoundError):
        next(stream)
    run = str(tmp_path / "damaged")
    write_run(run, [StageEntered(step=0, tokens=0, stage=i) for i in range(50)], segment_bytes=500)
    first = segment(run, 0)
    data = bytearray(first.read_bytes())
    data[HEADER_SIZE + 3] ^= 0x10
    first.write_atomic(bytes(data))
    for read in (iter_records, iter_effective):
        with pytest.raises(LogCorruptError, match=r"00000000\.log at byte 0"):
            list(read(run))
