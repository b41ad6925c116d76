"""Reading a run's log for a command: every way it can be missing or unusable is one line and an exit code."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rewind.tools.errors import CommandError


def load_records(run_dir: str) -> list:
    """(seq, event) of every committed record, read without the writer's lock (a live run is fine).
    No log: exit 2 (a wrong path is a usage error). Empty, damaged, or not starting with RunStarted: exit 1."""
    from rewind.states.events import RunStarted
    from rewind.stores.runs import read_seq_events

    with log_errors(run_dir):
        records = read_seq_events(run_dir)
    if not records:
        raise CommandError(f"{run_dir}: the event log is empty", exit_code=1)
    if not isinstance(records[0][1], RunStarted):
        raise CommandError(f"{run_dir}: the event log does not start with RunStarted", exit_code=1)
    return records


@contextlib.contextmanager
def open_log(run_dir: str) -> Iterator:
    """The run's log opened for reading (seeking readers: rewind.stores.eventlog), with the same
    one-line errors as `load_records`; yields (log, first record's event)."""
    from rewind.states.events import RunStarted
    from rewind.stores.eventlog import EventLog

    with log_errors(run_dir), EventLog.open(run_dir) as log:
        first = next(log.records(0, 1), None)
        if first is None:
            raise CommandError(f"{run_dir}: the event log is empty", exit_code=1)
        if not isinstance(first.event, RunStarted):
            raise CommandError(f"{run_dir}: the event log does not start with RunStarted", exit_code=1)
        yield log, first.event


@contextlib.contextmanager
def log_errors(run_dir: str) -> Iterator[None]:
    """The log's errors inside the block as a CommandError naming the run."""
    from rewind.stores.eventlog import LogError, LogNotFoundError

    try:
        yield
    except LogNotFoundError:
        raise CommandError(f"{run_dir}: no run here (no event log)") from None
    except LogError as exc:  # damaged bytes or a newer schema: `rewind verify` locates the damage
        raise CommandError(f"{run_dir}: {exc}", exit_code=1) from None
