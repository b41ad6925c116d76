"""Read-side conveniences over a run directory's event log, shared by the engine and the tools."""

from __future__ import annotations

import os

from rewind.states.events import Event
from rewind.stores.eventlog import EventLog, LogNotFoundError, Record

__all__ = ["LogNotFoundError", "read_records", "read_seq_events"]


def read_records(run_url: str | os.PathLike[str]) -> list[Record]:
    """Every committed record (seq, segment, offset, event), read-only; LogNotFoundError if no log."""
    with EventLog.open(run_url) as log:
        return list(log.records())


def read_seq_events(run_url: str | os.PathLike[str]) -> list[tuple[int, Event]]:
    return [(r.seq, r.event) for r in read_records(run_url)]
