"""Records read from a log are untrusted input: each is admitted before the fold acts on what it carries.

What a record may carry is decided beside the fold, in `rewind.states.admission` (pure); this module is
where a reader applies it. `RecordChecker` refuses the first record that breaks those rules with
`UntrustedRecord`, a LogError: one line naming the record's seq, exit 1, from any command.
"""

from __future__ import annotations

import operator

from rewind.states.admission import CARRIERS, Admission
from rewind.states.events import Event, event_tag
from rewind.stores.codec import LogError


class UntrustedRecord(LogError):
    """A record that decodes and may even fold, but carries something no rewind run could have written."""

    def __init__(self, seq: int, event: Event, problem: str):
        self.seq = seq
        self.problem = problem
        super().__init__(f"event log record {seq} ({event_tag(event)} at step {event.step}): {problem}")


class RecordChecker(Admission):
    """Admits records in log order (see Admission), refusing the first that breaks the rules."""

    def check(self, seq: int, event: Event) -> None:
        if problem := self.problem(event):
            raise UntrustedRecord(seq, event, problem)


_CARRIER_TYPES = frozenset(CARRIERS)
_event_of = operator.attrgetter("event")


def check_carriers(checker: RecordChecker, records: list, first_seq: int | None = None) -> None:
    """Check the CARRIERS among `records` (Records; or bare events numbered from `first_seq`). A chunk
    without one (almost every chunk: steps) costs one pass of C-level type lookups, no Python loop."""
    events = records if first_seq is not None else list(map(_event_of, records))
    if _CARRIER_TYPES.isdisjoint(map(type, events)):
        return
    for position, event in enumerate(events):
        if type(event) in _CARRIER_TYPES:
            checker.check(first_seq + position if first_seq is not None else records[position].seq, event)
