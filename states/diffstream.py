"""Comparing two runs in one pass over each: alignment at a fork point, the first divergence, and the
hand-over to the per-step summaries after it.

A run's effective records arrive as an iterator and are read once. `RunSide` watches every record
go by for what the report needs about the run as a whole (its last step, whether it finished, its
config records: a few); `content_after` cuts the stream where a fork of it starts; `compare_content`
walks the two content streams in lockstep until the first pair that differs, then by step. Nothing
here holds more than one step's events per run, so two logs of any length compare in constant
memory. What makes that possible is an order every legal log keeps: a run's effective records never
go back to an earlier step (a resume supersedes everything after the step it restarts from). A stream
that breaks it raises `UnorderedSteps` instead of being compared wrongly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain

import msgspec

from rewind.states.compare import first_difference
from rewind.states.config import Config
from rewind.states.config_identity import config_differences
from rewind.states.diffmetrics import MetricsAccumulator, UnorderedSteps, merge_by_step
from rewind.states.diffreport import (
    CONTENT_TYPES,
    IGNORED_FIELDS,
    ConfigChange,
    Divergence,
    Metrics,
    RunEnd,
    event_at,
)
from rewind.states.events import (
    CheckpointCommitted,
    ConfigChanged,
    Evaluated,
    Event,
    ForkOrigin,
    RunFinished,
    RunStarted,
    StepCommitted,
    Validated,
)

SeqEvent = tuple[int, Event]
_STEP_ENDS = (StepCommitted, Validated, Evaluated)


class RunSide:
    """One run's effective records, read once: `content(...)` hands on its content events, while the
    figures about the whole run fill in as records pass (complete once the content is read out)."""

    def __init__(self, records: Iterable[SeqEvent], side: str = ""):
        self.side = side  # "a" or "b": named in errors
        self._records = iter(records)
        first = next(self._records, None)
        if first is None or not isinstance(first[1], RunStarted):
            raise ValueError("the log does not start with RunStarted")
        self._first = first
        self.origin: ForkOrigin | None = first[1].parent
        self.start_step = self.origin.step if self.origin is not None else 0
        self.last_step = first[1].step
        self.finished = False
        self.config_records: list[SeqEvent] = []  # effective RunStarted and ConfigChanged: a few
        self.num_compared = 0

    def records(self) -> Iterator[SeqEvent]:
        """Every effective record once, in order."""
        latest = self._first[1].step
        for seq, event in chain([self._first], self._records):
            if event.step < latest:
                raise UnorderedSteps(
                    f"record {seq} ({type(event).__name__}) is at step {event.step}, after step {latest}",
                    side=self.side,
                )
            latest = self.last_step = event.step
            if isinstance(event, RunStarted | ConfigChanged):
                self.config_records.append((seq, event))
            elif isinstance(event, RunFinished):
                self.finished = True
            yield seq, event

    def content(self, from_step: int, checkpoint: str, cut: bool) -> Iterator[SeqEvent]:
        """The content events compared: from where a fork at `from_step` from `checkpoint` starts when
        `cut`, else all of them."""
        stream = content_after(self.records(), from_step, checkpoint) if cut else content_of(self.records())
        for item in stream:
            self.num_compared += 1
            yield item

    @property
    def final_config(self) -> Config:
        """The config in force at the end: RunStarted's, or that of the last effective ConfigChanged."""
        return self.config_records[-1][1].config

    def known_configs(self) -> dict[str, Config]:
        return {e.config_hash: e.config for _, e in self.config_records}

    def end(self) -> RunEnd:
        return RunEnd(
            start_step=self.start_step,
            last_step=self.last_step,
            finished=self.finished,
            num_compared=self.num_compared,
        )


def changes_of(config_records: Iterable[SeqEvent], known: dict[str, Config]) -> list[ConfigChange]:
    """A run's ConfigChanged records, each compared with the config it replaced: one the run records,
    or one of `known` (a fork child's log starts under its own config; the one it changed from is its
    parent's)."""
    config_records = list(config_records)
    configs = {**known, **{e.config_hash: e.config for _, e in config_records}}
    changes = []
    for seq, event in config_records:
        if not isinstance(event, ConfigChanged):
            continue
        previous = configs.get(event.previous_hash)
        changes.append(
            ConfigChange(
                step=event.step,
                seq=seq,
                previous_hash=event.previous_hash,
                previous_known=previous is not None,
                changes=[] if previous is None else config_differences(previous, event.config),
            )
        )
    return changes


# --- alignment ----------------------------------------------------------------------------------------


def alignment(origin_a: ForkOrigin | None, origin_b: ForkOrigin | None) -> tuple[int, str, bool, bool]:
    """(S, checkpoint, cut A, cut B): the runs are compared from step S, the later of their start steps
    (a fork starts at its parent's checkpoint step). The run that started earlier is cut where the
    later one began; so is a run that started at S as a run of its own when the other one is a fork at
    S (from a checkpoint at step 0). `checkpoint` is the fork's, when one of them forked at S."""
    start_a = origin_a.step if origin_a is not None else 0
    start_b = origin_b.step if origin_b is not None else 0
    from_step = max(start_a, start_b)
    checkpoint = next(
        (o.checkpoint for o in (origin_a, origin_b) if o is not None and o.step == from_step), ""
    )
    cut_a = start_a < from_step or (origin_a is None and origin_b is not None)
    cut_b = start_b < from_step or (origin_b is None and origin_a is not None)
    return from_step, checkpoint, cut_a, cut_b


def content_of(records: Iterable[SeqEvent]) -> Iterator[SeqEvent]:
    return ((seq, e) for seq, e in records if isinstance(e, CONTENT_TYPES))


def content_after(records: Iterable[SeqEvent], step: int, checkpoint: str) -> Iterator[SeqEvent]:
    """The content a run logged after the point where a fork of it at `step` from `checkpoint` starts:
    after its commit of `checkpoint` at that step when there is one (the fork restarts from exactly
    that record), else after its last step-end record (StepCommitted, Validated, Evaluated) at that
    step; nothing when the run never got to `step`. At step 0 without the checkpoint, the fork
    started from scratch: everything.

    Which cut applies is known once the run is past `step`; until then the content since the last
    step end at `step` waits (a few events: what a step's end is followed by at the same step)."""
    records = iter(records)
    waiting: list[SeqEvent] = []
    seen_step_end = False
    for seq, event in records:
        if isinstance(event, CheckpointCommitted) and event.step == step and event.checkpoint == checkpoint:
            yield from content_of(records)
            return
        if event.step > step:
            if seen_step_end or step == 0:
                yield from waiting
                yield from content_of(chain([(seq, event)], records))
            else:
                for _ in records:  # never got to `step`: nothing to compare, but read it all
                    pass
            return
        if step != 0 and isinstance(event, _STEP_ENDS) and event.step == step:
            seen_step_end = True
            waiting.clear()
        elif isinstance(event, CONTENT_TYPES) and (seen_step_end or step == 0):
            waiting.append((seq, event))
    if seen_step_end or step == 0:
        yield from waiting


# --- the comparison -----------------------------------------------------------------------------------


def compare_content(
    content_a: Iterable[SeqEvent], content_b: Iterable[SeqEvent], from_step: int, *, rtol: float = 0.0
) -> tuple[Divergence | None, Metrics]:
    """The first divergence of two content streams and the metrics from its step on (from `from_step`
    when they do not diverge). Reads both streams to their ends.

    Up to the divergence the streams are compared pair by pair, so the two are read in lockstep; the
    pairs that agree are summarised by step as they go, for the case that nothing diverges. From the
    divergence on, steps are matched by number instead (one run may have events the other lacks)."""
    encode = msgspec.msgpack.Encoder().encode
    stream_a, stream_b = iter(content_a), iter(content_b)
    agreed = MetricsAccumulator(from_step)
    pairs = _PairsOfAStep()
    while True:
        item_a, item_b = next(stream_a, None), next(stream_b, None)
        if item_a is None or item_b is None:
            divergence = _one_ends(item_a, item_b)
            break
        # Bit-identical encodings are equal under any rtol; that is most pairs, at a fraction of the
        # cost of the field-by-field comparison, which only runs on the others.
        identical = encode(item_a[1]) == encode(item_b[1])
        divergence = None if identical else _difference(item_a, item_b, rtol)
        if divergence is not None:
            break
        pairs.add(item_a[1], item_b[1], identical, agreed)
    if divergence is None:
        pairs.flush(agreed)
        return None, agreed.result()
    # The summaries start over at the divergence's step, with the pairs already read at that step
    # and the events of the diverging pair (or the one that goes on) in front of the rest.
    carried_a, carried_b = pairs.at(divergence.step)
    rest_a = chain(carried_a, [item_a[1]] if item_a else [], (e for _, e in stream_a))
    rest_b = chain(carried_b, [item_b[1]] if item_b else [], (e for _, e in stream_b))
    after = MetricsAccumulator(divergence.step)
    merge_by_step(after, rest_a, rest_b)
    return divergence, after.result()


class _PairsOfAStep:
    """The agreeing pairs of the step being read, summed up as one step once the next one begins."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.a: list[Event] = []
        self.b: list[Event] = []
        self.identical = True

    def add(self, a: Event, b: Event, identical: bool, metrics: MetricsAccumulator) -> None:
        if a.step != self.step:
            self.flush(metrics)
            self.step, self.a, self.b, self.identical = a.step, [], [], True
        self.a.append(a)
        self.b.append(b)
        self.identical = self.identical and identical

    def flush(self, metrics: MetricsAccumulator) -> None:
        if self.step is not None:
            metrics.add_step(self.step, self.a, self.b, self.identical)

    def at(self, step: int) -> tuple[list[Event], list[Event]]:
        return (self.a, self.b) if self.step == step else ([], [])


def _difference(item_a: SeqEvent, item_b: SeqEvent, rtol: float) -> Divergence | None:
    (seq_a, a), (seq_b, b) = item_a, item_b
    found = first_difference(a, b, rtol=rtol, ignore=IGNORED_FIELDS.get(type(a), frozenset()))
    if found is None:
        return None
    return Divergence(
        kind="event",
        step=min(a.step, b.step),
        a=event_at(seq_a, a),
        b=event_at(seq_b, b),
        field=found.field,
        value_a=found.a,
        value_b=found.b,
    )


def _one_ends(item_a: SeqEvent | None, item_b: SeqEvent | None) -> Divergence | None:
    """None when both streams ended together; else the one that goes on, and its next event."""
    if item_a is None and item_b is None:
        return None
    ended = "a" if item_a is None else "b"
    seq, event = item_b if ended == "a" else item_a
    goes_on = event_at(seq, event)
    return Divergence(
        kind="ends",
        step=event.step,
        a=None if ended == "a" else goes_on,
        b=goes_on if ended == "a" else None,
        ended=ended,
    )
