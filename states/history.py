"""Reading a run's history: which records still count after resumes, and where a resume restarts.

The log is append-only, so a resume cannot delete the events a crashed process wrote after its last
checkpoint. Instead `RunResumed` names the superseded seq range. Folding the *raw* stream is still
correct (RunResumed replaces the state with the one it carries); the *effective* stream, with the
superseded records left out, is what metrics, diffs and the exactness test compare.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rewind.states.events import (
    CheckpointCommitted,
    CheckpointDeleted,
    ConfigChanged,
    Event,
    RunResumed,
    RunStarted,
)
from rewind.states.fold import fold
from rewind.states.state import State

SeqEvent = tuple[int, Event]


def superseded_ranges(records: Iterable[SeqEvent]) -> list[tuple[int, int]]:
    return [
        (e.superseded_first_seq, e.superseded_last_seq)
        for _, e in records
        if isinstance(e, RunResumed) and e.superseded_last_seq >= e.superseded_first_seq
    ]


def effective(records: Sequence[SeqEvent]) -> list[SeqEvent]:
    """The records that still count: everything not inside a superseded range."""
    ranges = superseded_ranges(records)
    if not ranges:
        return list(records)
    return [(seq, e) for seq, e in records if not any(a <= seq <= b for a, b in ranges)]


def is_superseded(seq: int, ranges: Sequence[tuple[int, int]]) -> bool:
    return any(a <= seq <= b for a, b in ranges)


@dataclass(frozen=True)
class RestorePoint:
    """Where a resume starts: the checkpoint (empty = from scratch), the state as of it, and the seq of
    the record it follows (everything after is superseded)."""

    checkpoint: str
    seq: int
    state: State


def restore_point(records: Sequence[SeqEvent]) -> RestorePoint:
    """The last committed, still-effective checkpoint, or the run's start when there is none."""
    if not records or not isinstance(records[0][1], RunStarted):
        raise ValueError("the log does not start with RunStarted")
    final = fold(e for _, e in records)
    target = final.last_checkpoint
    if target is not None:
        ranges = superseded_ranges(records)
        for i in range(len(records) - 1, -1, -1):
            seq, event = records[i]
            if (
                isinstance(event, CheckpointCommitted)
                and event.checkpoint == target.checkpoint
                and not is_superseded(seq, ranges)
            ):
                # The retention deletions that follow a checkpoint record belong to it: their files
                # may already be gone, so they must not be superseded with the steps after it.
                end = i + 1
                while end < len(records) and isinstance(records[end][1], CheckpointDeleted):
                    end += 1
                return RestorePoint(target.checkpoint, records[end - 1][0], fold(e for _, e in records[:end]))
    first_seq, started = records[0]
    return RestorePoint("", first_seq, fold([started]))


def config_events(records: Sequence[SeqEvent]) -> list[SeqEvent]:
    """RunStarted and every later config change (forks in place), in order."""
    return [(s, e) for s, e in records if isinstance(e, RunStarted | ConfigChanged)]
