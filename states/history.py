"""Reading a run's history: which records still count after resumes, and where a resume restarts.

The log is append-only, so a resume cannot delete the events a crashed process wrote after its last
checkpoint. Instead `RunResumed` names the superseded seq range. Folding the *raw* stream is still
correct (RunResumed replaces the state with the one it carries); the *effective* stream, with the
superseded records left out, is what metrics, diffs and the exactness test compare.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rewind.states.config import Config
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


class HistoryError(ValueError):
    """A log whose records fold but do not make a history a run can restart from."""


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
    """The last committed, still-effective checkpoint, or the run's start when there is none.

    A checkpoint is anchored by its CheckpointCommitted record, or by a later RunResumed that restarted
    from it (a resume, or the start of a fork); the last effective anchor wins. Records that belong to
    the anchor stay with it: retention deletions after a checkpoint (their files may already be gone)
    and config changes after a resume (the run goes on under the new config even if the process dies
    before its next checkpoint)."""
    if not records or not isinstance(records[0][1], RunStarted):
        raise HistoryError("the log does not start with RunStarted")
    target = fold(e for _, e in records).last_checkpoint
    name = target.checkpoint if target is not None else ""
    ranges = superseded_ranges(records)
    for i in range(len(records) - 1, -1, -1):
        seq, event = records[i]
        anchored = (
            (isinstance(event, CheckpointCommitted) and event.checkpoint == name)
            or (isinstance(event, RunResumed) and event.checkpoint == name)
            or (isinstance(event, RunStarted) and not name)
        )
        if anchored and not is_superseded(seq, ranges):
            end = anchor_end(records, i)
            return RestorePoint(name, records[end - 1][0], fold(e for _, e in records[:end]))
    raise HistoryError(f"no effective record anchors checkpoint {name!r}")


def anchor_end(records: Sequence[SeqEvent], i: int) -> int:
    """The index just past the anchor at `i` and the records that belong to it (see restore_point).
    Resume, fork and replay all start there, so they agree on the config and state in force."""
    end = i + 1
    while end < len(records) and isinstance(records[end][1], CheckpointDeleted | ConfigChanged):
        end += 1
    return end


def config_in_force(records: Sequence[SeqEvent]) -> Config:
    """The config the run goes on under after `records` (the whole log, or a prefix of it): RunStarted's,
    or that of the last ConfigChanged no resume has superseded."""
    return config_events(effective(records))[-1][1].config


def config_events(records: Sequence[SeqEvent]) -> list[SeqEvent]:
    """RunStarted and every later config change (forks in place), in order."""
    return [(s, e) for s, e in records if isinstance(e, RunStarted | ConfigChanged)]
