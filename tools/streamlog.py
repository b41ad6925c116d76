"""Reading a run's log for a command as a stream: `runlog.load_records`' one-line errors and exit codes,
for commands that read long logs without holding them (`rewind diff`, `rewind timeline`).

No log: exit 2 (a wrong path is a usage error). Empty, damaged, or not starting with RunStarted:
exit 1. A stream reports damage where it meets it, possibly after handing on the records before it;
the commands print nothing until the whole log has been read, so the user sees the same one line.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from rewind.tools.errors import CommandError
from rewind.tools.runlog import log_errors


def _checked(run_dir: str, records: Iterator[tuple]) -> Iterator[tuple]:
    from rewind.states.events import RunStarted

    with log_errors(run_dir):
        first = next(records, None)
        if first is None:
            raise CommandError(f"{run_dir}: the event log is empty", exit_code=1)
        if not isinstance(first[1], RunStarted):
            raise CommandError(f"{run_dir}: the event log does not start with RunStarted", exit_code=1)
        yield first
        yield from records


def effective_records(run_dir: str) -> tuple[tuple, Iterator[tuple]]:
    """(the first record, an iterator over all of them from it on): (seq, event) of the records that
    still count after resumes, read without the writer's lock (a live run is fine). The first record,
    RunStarted, is read now, so a missing or unusable log fails here."""
    from rewind.stores.runs import iter_effective

    records = _checked(run_dir, iter_effective(run_dir))
    first = next(records)
    return first, itertools.chain([first], records)


def marked_records(run_dir: str) -> Iterator[tuple]:
    """(seq, event, superseded) of every record, read without the writer's lock; like
    `effective_records`, the first record is read now."""
    from rewind.stores.runs import iter_marked

    records = _checked(run_dir, iter_marked(run_dir))
    return itertools.chain([next(records)], records)
