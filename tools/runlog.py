"""Reading a run's log for a command: every way it can be missing or unusable is one line and an exit code."""

from __future__ import annotations

from rewind.tools.errors import CommandError


def load_records(run_dir: str) -> list:
    """(seq, event) of every committed record, read without the writer's lock (a live run is fine).
    No log: exit 2 (a wrong path is a usage error). Empty, damaged, or not starting with RunStarted: exit 1."""
    from rewind.states.events import RunStarted
    from rewind.stores.eventlog import LogError, LogNotFoundError
    from rewind.stores.runs import read_seq_events

    try:
        records = read_seq_events(run_dir)
    except LogNotFoundError:
        raise CommandError(f"{run_dir}: no run here (no event log)") from None
    except LogError as exc:  # damaged bytes or a newer schema: `rewind verify` locates the damage
        raise CommandError(f"{run_dir}: {exc}", exit_code=1) from None
    if not records:
        raise CommandError(f"{run_dir}: the event log is empty", exit_code=1)
    if not isinstance(records[0][1], RunStarted):
        raise CommandError(f"{run_dir}: the event log does not start with RunStarted", exit_code=1)
    return records
