"""The oracle for the streaming diff: `rewind diff` as it was computed before it streamed, over whole
lists of records (rewind 0.1's states/diffing.py, its report shapes shared). Kept only so that tests
can check `diffing.diff_streams` gives the same report; not imported by the package.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import zip_longest
from typing import Any

from rewind.states.compare import first_difference, floats_equal
from rewind.states.config import Config
from rewind.states.config_identity import config_differences
from rewind.states.diffing import abs_delta
from rewind.states.diffreport import (
    CONTENT_TYPES,
    IGNORED_FIELDS,
    SCALAR_METRICS,
    ConfigChange,
    DiffReport,
    Divergence,
    EvaluationPair,
    EventAt,
    MetricDelta,
    Metrics,
    Relation,
    RunEnd,
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
from rewind.states.history import SeqEvent, config_events, effective


def fork_origin(records: Sequence[SeqEvent]) -> ForkOrigin | None:
    if not records or not isinstance(records[0][1], RunStarted):
        raise ValueError("the log does not start with RunStarted")
    return records[0][1].parent


def start_step(records: Sequence[SeqEvent]) -> int:
    origin = fork_origin(records)
    return origin.step if origin is not None else 0


def known_configs(records: Sequence[SeqEvent]) -> dict[str, Config]:
    return {
        e.config_hash: e.config for _, e in effective(records) if isinstance(e, RunStarted | ConfigChanged)
    }


def config_changes(records: Sequence[SeqEvent], known: dict[str, Config]) -> list[ConfigChange]:
    configs = {**known, **known_configs(records)}
    found = [
        (seq, e, configs.get(e.previous_hash))
        for seq, e in effective(records)
        if isinstance(e, ConfigChanged)
    ]
    return [
        ConfigChange(
            step=event.step,
            seq=seq,
            previous_hash=event.previous_hash,
            previous_known=previous is not None,
            changes=[] if previous is None else config_differences(previous, event.config),
        )
        for seq, event, previous in found
    ]


def content_events(records: Sequence[SeqEvent]) -> list[SeqEvent]:
    return [(seq, e) for seq, e in records if isinstance(e, CONTENT_TYPES)]


def content_from(records: Sequence[SeqEvent], step: int, checkpoint: str) -> list[SeqEvent]:
    records = effective(records)
    cut = next(
        (
            i
            for i, (_, e) in enumerate(records)
            if isinstance(e, CheckpointCommitted) and e.step == step and e.checkpoint == checkpoint
        ),
        None,
    )
    if cut is None and step == 0:
        return content_events(records)
    if cut is None:
        step_ends = [
            i
            for i, (_, e) in enumerate(records)
            if isinstance(e, StepCommitted | Validated | Evaluated) and e.step == step
        ]
        if not step_ends:
            return []
        cut = step_ends[-1]
    return content_events(records[cut + 1 :])


def aligned_streams(
    records_a: Sequence[SeqEvent], records_b: Sequence[SeqEvent]
) -> tuple[int, list[SeqEvent], list[SeqEvent]]:
    origin_a, origin_b = fork_origin(records_a), fork_origin(records_b)
    start_a, start_b = start_step(records_a), start_step(records_b)
    from_step = max(start_a, start_b)
    checkpoint = next(
        (o.checkpoint for o in (origin_a, origin_b) if o is not None and o.step == from_step), ""
    )

    def stream(records: Sequence[SeqEvent], start: int, own: ForkOrigin | None, other: ForkOrigin | None):
        if start < from_step or (own is None and other is not None):
            return content_from(records, from_step, checkpoint)
        return content_events(effective(records))

    return (
        from_step,
        stream(records_a, start_a, origin_a, origin_b),
        stream(records_b, start_b, origin_b, origin_a),
    )


def first_divergence(
    content_a: Sequence[SeqEvent], content_b: Sequence[SeqEvent], *, rtol: float = 0.0
) -> Divergence | None:
    for (seq_a, a), (seq_b, b) in zip(content_a, content_b, strict=False):
        found = first_difference(a, b, rtol=rtol, ignore=IGNORED_FIELDS.get(type(a), frozenset()))
        if found is not None:
            return Divergence(
                kind="event",
                step=min(a.step, b.step),
                a=EventAt(type=type(a).__name__, step=a.step, seq=seq_a),
                b=EventAt(type=type(b).__name__, step=b.step, seq=seq_b),
                field=found.field,
                value_a=found.a,
                value_b=found.b,
            )
    if len(content_a) == len(content_b):
        return None
    ended, longer = ("a", content_b) if len(content_a) < len(content_b) else ("b", content_a)
    seq, event = longer[min(len(content_a), len(content_b))]
    goes_on = EventAt(type=type(event).__name__, step=event.step, seq=seq)
    return Divergence(
        kind="ends",
        step=event.step,
        a=None if ended == "a" else goes_on,
        b=goes_on if ended == "a" else None,
        ended=ended,
    )


def _max_delta(name: str, pairs: Sequence[tuple[int, float, float]]) -> MetricDelta:
    best, at_step, num_different = 0.0, None, 0
    for step, a, b in pairs:
        num_different += not floats_equal(a, b)
        delta = abs_delta(a, b)
        if delta > best:
            best, at_step = delta, step
    return MetricDelta(name=name, max_abs_delta=best, at_step=at_step, num_steps_different=num_different)


def _last_by(content: Sequence[SeqEvent], kind: type[Event], key: str, from_step: int) -> dict[int, Any]:
    return {getattr(e, key): e for _, e in content if isinstance(e, kind) and e.step >= from_step}


def summarize_metrics(
    content_a: Sequence[SeqEvent], content_b: Sequence[SeqEvent], from_step: int
) -> Metrics:
    steps_a = _last_by(content_a, StepCommitted, "step", from_step)
    steps_b = _last_by(content_b, StepCommitted, "step", from_step)
    both = sorted(steps_a.keys() & steps_b.keys())
    scalars = [
        _max_delta(name, [(k, getattr(steps_a[k], name), getattr(steps_b[k], name)) for k in both])
        for name in SCALAR_METRICS
    ]
    row_differences = [
        max((abs(x - y) for x, y in zip_longest(steps_a[k].rows, steps_b[k].rows, fillvalue=0)), default=0)
        for k in both
    ]
    valid_a = _last_by(content_a, Validated, "step", from_step)
    valid_b = _last_by(content_b, Validated, "step", from_step)
    losses: dict[str, list[tuple[int, float, float]]] = {}
    for k in sorted(valid_a.keys() & valid_b.keys()):
        for name in valid_a[k].losses.keys() & valid_b[k].losses.keys():
            losses.setdefault(name, []).append((k, valid_a[k].losses[name], valid_b[k].losses[name]))
    evals_a = _last_by(content_a, Evaluated, "boundary", from_step)
    evals_b = _last_by(content_b, Evaluated, "boundary", from_step)
    evaluations = [
        EvaluationPair(
            boundary=boundary,
            step_a=evals_a[boundary].step if boundary in evals_a else None,
            step_b=evals_b[boundary].step if boundary in evals_b else None,
            scores_a=dict(evals_a[boundary].scores) if boundary in evals_a else None,
            scores_b=dict(evals_b[boundary].scores) if boundary in evals_b else None,
        )
        for boundary in sorted(evals_a.keys() | evals_b.keys())
    ]
    return Metrics(
        from_step=from_step,
        num_steps_both=len(both),
        num_steps_only_a=len(steps_a.keys() - steps_b.keys()),
        num_steps_only_b=len(steps_b.keys() - steps_a.keys()),
        scalars=scalars,
        num_rows_steps_different=len([k for k in both if steps_a[k].rows != steps_b[k].rows]),
        max_row_difference=max(row_differences, default=0),
        num_cursor_steps_different=len([k for k in both if steps_a[k].cursors != steps_b[k].cursors]),
        validation=[_max_delta(name, triples) for name, triples in sorted(losses.items())],
        evaluations=evaluations,
    )


def _run_end(records: Sequence[SeqEvent], num_compared: int) -> RunEnd:
    kept = effective(records)
    return RunEnd(
        start_step=start_step(records),
        last_step=max(e.step for _, e in kept),
        finished=any(isinstance(e, RunFinished) for _, e in kept),
        num_compared=num_compared,
    )


def diff_runs(
    records_a: Sequence[SeqEvent], records_b: Sequence[SeqEvent], *, rtol: float = 0.0, child: str = ""
) -> DiffReport:
    from_step, content_a, content_b = aligned_streams(records_a, records_b)
    known = {**known_configs(records_a), **known_configs(records_b)}
    divergence = first_divergence(content_a, content_b, rtol=rtol)
    final = [config_events(effective(r))[-1][1].config for r in (records_a, records_b)]
    return DiffReport(
        relation=Relation(child=child, parent_a=fork_origin(records_a), parent_b=fork_origin(records_b)),
        config_differences=config_differences(*final),
        config_changes={"a": config_changes(records_a, known), "b": config_changes(records_b, known)},
        compared_from_step=from_step,
        runs={"a": _run_end(records_a, len(content_a)), "b": _run_end(records_b, len(content_b))},
        rtol=rtol,
        divergence=divergence,
        metrics=summarize_metrics(content_a, content_b, divergence.step if divergence else from_step),
    )
