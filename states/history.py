"""Reading a run's history: which records still count after resumes, and where a resume restarts.

The log is append-only, so a resume cannot delete the events a crashed process wrote after its last
checkpoint. Instead `RunResumed` names the superseded seq range. Folding the *raw* stream is still
correct (RunResumed replaces the state with the one it carries); the *effective* stream, with the
superseded records left out, is what metrics, diffs and the exactness test compare.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from rewind.states.config import Config
from rewind.states.events import (
    CheckpointCommitted,
    ConfigChanged,
    Event,
    RunResumed,
    RunStarted,
)
from rewind.states.fold import ANCHOR_FOLLOWERS, apply, fold
from rewind.states.state import State, anchor_checkpoint

SeqEvent = tuple[int, Event]


class HistoryError(ValueError):
    """A log whose records fold but do not make a history a run can restart from."""


def superseded_ranges(records: Iterable[SeqEvent]) -> list[tuple[int, int]]:
    return [
        (e.superseded_first_seq, e.superseded_last_seq)
        for _, e in records
        if isinstance(e, RunResumed) and e.superseded_last_seq >= e.superseded_first_seq
    ]


def merged_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges sorted and merged where they overlap or touch, so one pass can skip them."""
    merged: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if merged and first <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], last))
        else:
            merged.append((first, last))
    return merged


def effective(records: Sequence[SeqEvent]) -> list[SeqEvent]:
    """The records that still count: everything not inside a superseded range (one merge pass over
    records in seq order and the sorted ranges, whatever the number of resumes)."""
    return list(skip_ranges(records, superseded_ranges(records)))


class SupersededFilter:
    """Is record `seq` superseded? Asked for seqs in ascending order, it answers from ranges merged and
    sorted once, with a cursor: constant time per record, however many resumes the run had."""

    def __init__(self, ranges: Iterable[tuple[int, int]]):
        self._ranges = merged_ranges(r for r in ranges if r[1] >= r[0])
        self._index = 0

    def __call__(self, seq: int) -> bool:
        ranges, index = self._ranges, self._index
        while index < len(ranges) and ranges[index][1] < seq:
            index += 1
        self._index = index
        return index < len(ranges) and ranges[index][0] <= seq


def skip_ranges(records: Iterable[SeqEvent], ranges: Iterable[tuple[int, int]]) -> Iterator[SeqEvent]:
    """`records` (in seq order) without those inside `ranges`; streams."""
    superseded = SupersededFilter(ranges)
    return ((seq, event) for seq, event in records if not superseded(seq))


def is_superseded(seq: int, ranges: Sequence[tuple[int, int]]) -> bool:
    return any(a <= seq <= b for a, b in ranges)


@dataclass(frozen=True)
class RestorePoint:
    """Where a resume (or a fork, or a replay) can start: the checkpoint ("" = from scratch), the state
    as of it, the seq of the last record that belongs to it (everything after is superseded on resume)
    and the index just past it in the effective records it was found in."""

    checkpoint: str
    seq: int
    state: State
    index: int = 0


def restore_point(records: Sequence[SeqEvent], state: State | None = None) -> RestorePoint:
    """Where a resume restarts: the fold's own restore anchor (the last committed, still-effective
    checkpoint, or the run's start). `state` is the fold of `records` when the caller has it."""
    if not records or not isinstance(records[0][1], RunStarted):
        raise HistoryError("the log does not start with RunStarted")
    return point_of(state if state is not None else fold(e for _, e in records))


def point_of(state: State) -> RestorePoint:
    """The restore point a folded state holds (see State.anchor)."""
    anchor = state.anchor
    if anchor is None:
        raise HistoryError("the log has no restore point (it does not start with RunStarted)")
    return RestorePoint(anchor_checkpoint(anchor), anchor.next_seq - 1, anchor)


def restore_points(records: Sequence[SeqEvent]) -> list[RestorePoint]:
    """Every restore point of the effective history, in order, each with the whole group of records
    that belongs to it (so its state is the one a resume from it would continue with). The one search
    for anchors that resume, fork and replay share. A point's `index` is into `effective(records)`."""
    points: list[RestorePoint] = []
    state = State()
    for index, (seq, event) in enumerate(effective(records)):
        state = apply(state, event)
        if not state.anchor_open:
            continue
        point = RestorePoint(anchor_checkpoint(state), seq, state, index + 1)
        if isinstance(event, RunStarted | CheckpointCommitted | RunResumed) or not points:
            points.append(point)
        else:
            points[-1] = point  # a record that belongs to the anchor just before it
    return points


def anchor_end(records: Sequence[SeqEvent], i: int) -> int:
    """The index just past the anchor at `i` and the records that belong to it (what `apply` keeps in
    State.anchor): for tests and tools that cut a log at an anchor by hand."""
    end = i + 1
    while end < len(records) and isinstance(records[end][1], ANCHOR_FOLLOWERS):
        end += 1
    return end


def config_in_force(records: Sequence[SeqEvent]) -> Config:
    """The config the run goes on under after `records` (the whole log, or a prefix of it): RunStarted's,
    or that of the last ConfigChanged no resume has superseded."""
    return config_events(effective(records))[-1][1].config


def config_events(records: Sequence[SeqEvent]) -> list[SeqEvent]:
    """RunStarted and every later config change (forks in place), in order."""
    return [(s, e) for s, e in records if isinstance(e, RunStarted | ConfigChanged)]
