"""Comparing two runs: where their histories part, and by how much they differ afterwards.

The pure half of `rewind diff`, over lists of (seq, event) as read from two logs:
- only *content* events are compared (what training did: stages, fades, steps, validations, scores);
  bookkeeping (starts, resumes, config records, checkpoints, stops) is left out, so a run that was
  stopped and resumed equals the same run trained straight through;
- both streams are taken from the effective records (history.effective), and aligned at the step
  where the later-starting run began (a fork starts at its parent's checkpoint step);
- the first pair of events that `compare.first_difference` tells apart is the divergence; a stream
  that is a prefix of the other one ends early (a live or stopped run against a finished one);
- after it, per-metric summaries over the steps both runs logged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import zip_longest
from typing import Any

import msgspec

from rewind.states.compare import first_difference, floats_equal
from rewind.states.config import Config, config_differences
from rewind.states.events import (
    CheckpointCommitted,
    ConfigChanged,
    Evaluated,
    Event,
    FadeEnded,
    FadeStarted,
    ForkOrigin,
    NonFiniteLoss,
    ReferenceRefreshed,
    RunFinished,
    RunStarted,
    StackAppended,
    StageEntered,
    StepCommitted,
    Validated,
)
from rewind.states.history import SeqEvent, config_events, effective

CONTENT_TYPES: tuple[type[Event], ...] = (
    StageEntered,
    FadeStarted,
    FadeEnded,
    ReferenceRefreshed,
    StackAppended,
    StepCommitted,
    Validated,
    Evaluated,
    NonFiniteLoss,
    RunFinished,
)
# Checkpoint names contain content hashes: two runs that agree on everything else still name their
# reference checkpoints differently.
IGNORED_FIELDS: dict[type[Event], frozenset[str]] = {ReferenceRefreshed: frozenset({"checkpoint"})}
SCALAR_METRICS: tuple[str, ...] = ("loss", "kl", "grad_norm", "lr", "beta")


class ConfigChange(msgspec.Struct, frozen=True, kw_only=True):
    """A config change mid-run (`rewind train --fork`, or a `rewind fork` child's changed config): from
    `step` on, `changes` hold against the config `previous_hash` names (`previous_known` false, and no
    `changes`, when neither log records it: a fork's parent that is not being compared)."""

    step: int
    seq: int
    previous_hash: str
    previous_known: bool
    changes: list[str]


class RunEnd(msgspec.Struct, frozen=True, kw_only=True):
    start_step: int  # 0, or the parent's step for a fork
    last_step: int
    finished: bool
    num_compared: int  # content events from the aligned start on


class EventAt(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    step: int
    seq: int


class Divergence(msgspec.Struct, frozen=True, kw_only=True):
    """Where the runs part. kind "event": the events `a` and `b` differ in `field` (value_a vs
    value_b). kind "ends": run `ended` has no more events (its side is None) while the other goes on."""

    kind: str  # "event" | "ends"
    step: int  # the earlier of the two events' steps: where the per-metric summaries begin
    a: EventAt | None
    b: EventAt | None
    field: str = ""
    value_a: Any = None
    value_b: Any = None
    ended: str = ""  # "a" | "b" for kind "ends"


class MetricDelta(msgspec.Struct, frozen=True, kw_only=True):
    """max |a - b| over matched steps (inf where exactly one side is not finite), and where."""

    name: str
    max_abs_delta: float
    at_step: int | None
    num_steps_different: int


class EvaluationPair(msgspec.Struct, frozen=True, kw_only=True):
    boundary: int
    step_a: int | None
    step_b: int | None
    scores_a: dict[str, float] | None
    scores_b: dict[str, float] | None


class Metrics(msgspec.Struct, frozen=True, kw_only=True):
    from_step: int
    num_steps_both: int
    num_steps_only_a: int
    num_steps_only_b: int
    scalars: list[MetricDelta]
    num_rows_steps_different: int
    max_row_difference: int
    num_cursor_steps_different: int
    validation: list[MetricDelta]  # one per dataset validated in both runs
    evaluations: list[EvaluationPair]


class Relation(msgspec.Struct, frozen=True, kw_only=True):
    child: str = ""  # "b" when B is a fork of A, "a" when A is a fork of B, "" otherwise
    parent_a: ForkOrigin | None = None
    parent_b: ForkOrigin | None = None


class DiffReport(msgspec.Struct, frozen=True, kw_only=True):
    relation: Relation
    config_differences: list[str]
    config_changes: dict[str, list[ConfigChange]]  # "a" / "b"
    compared_from_step: int
    runs: dict[str, RunEnd]
    rtol: float
    divergence: Divergence | None
    metrics: Metrics


# --- reading a run's history -------------------------------------------------------------------------


def fork_origin(records: Sequence[SeqEvent]) -> ForkOrigin | None:
    if not records or not isinstance(records[0][1], RunStarted):
        raise ValueError("the log does not start with RunStarted")
    return records[0][1].parent


def start_step(records: Sequence[SeqEvent]) -> int:
    origin = fork_origin(records)
    return origin.step if origin is not None else 0


def final_config(records: Sequence[SeqEvent]) -> Config:
    """The config in force at the end: RunStarted's, or that of the last effective ConfigChanged."""
    return config_events(effective(records))[-1][1].config


def known_configs(records: Sequence[SeqEvent]) -> dict[str, Config]:
    """Every config a run's effective log records, by its hash."""
    return {
        e.config_hash: e.config for _, e in effective(records) if isinstance(e, RunStarted | ConfigChanged)
    }


def config_changes(records: Sequence[SeqEvent], known: dict[str, Config] | None = None) -> list[ConfigChange]:
    """The run's effective ConfigChanged records, each compared with the config it replaced: one this
    log records, or one of `known` (a fork child's log starts under its own config; the config it
    changed from is its parent's)."""
    configs = {**(known or {}), **known_configs(records)}
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
    """The content a run logged after the point where a fork of it at `step` from `checkpoint` starts:
    after its effective commit of `checkpoint` at that step when there is one (the fork restarts from
    exactly that record), else after its last step-end record (StepCommitted, Validated, Evaluated)
    at that step; nothing when the run never got to `step`. At step 0 without the checkpoint, the
    fork started from scratch: everything."""
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
    """(S, content of A, content of B) compared from step S = the later of the two start steps. The
    run that started earlier is cut where the later one (a fork) began; so is a run that started at S
    as a run of its own when the other one is a fork at S (from a checkpoint at step 0)."""
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


# --- the first divergence ----------------------------------------------------------------------------


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


# --- after the divergence ----------------------------------------------------------------------------


def abs_delta(x: float, y: float) -> float:
    """|x - y|: 0 for bitwise-equal values (NaN included), inf when they differ and one is not finite."""
    if floats_equal(x, y):
        return 0.0
    delta = abs(x - y)
    return math.inf if math.isnan(delta) else delta


def _max_delta(name: str, pairs: Sequence[tuple[int, float, float]]) -> MetricDelta:
    """Over (step, a, b) triples: the largest |a - b| (the first step where it occurs), and how many
    steps differ at all (bitwise: -0.0 against 0.0 counts, though its delta is 0)."""
    best, at_step, num_different = 0.0, None, 0
    for step, a, b in pairs:
        num_different += not floats_equal(a, b)
        delta = abs_delta(a, b)
        if delta > best:
            best, at_step = delta, step
    return MetricDelta(name=name, max_abs_delta=best, at_step=at_step, num_steps_different=num_different)


def _last_by(content: Sequence[SeqEvent], kind: type[Event], key: str, from_step: int) -> dict[int, Any]:
    """The last event of `kind` per `key` (its step, or its boundary) from `from_step` on."""
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
    # Runs with different stage counts: a stage that one run does not have drew 0 rows in it.
    row_differences = [
        max((abs(x - y) for x, y in zip_longest(steps_a[k].rows, steps_b[k].rows, fillvalue=0)), default=0)
        for k in both
    ]
    rows_differ = [k for k in both if steps_a[k].rows != steps_b[k].rows]
    cursors_differ = [k for k in both if steps_a[k].cursors != steps_b[k].cursors]

    valid_a = _last_by(content_a, Validated, "step", from_step)
    valid_b = _last_by(content_b, Validated, "step", from_step)
    losses: dict[str, list[tuple[int, float, float]]] = {}  # dataset -> (step, a, b)
    for k in sorted(valid_a.keys() & valid_b.keys()):
        for name in valid_a[k].losses.keys() & valid_b[k].losses.keys():
            losses.setdefault(name, []).append((k, valid_a[k].losses[name], valid_b[k].losses[name]))
    validation = [_max_delta(name, triples) for name, triples in sorted(losses.items())]

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
        num_rows_steps_different=len(rows_differ),
        max_row_difference=max(row_differences, default=0),
        num_cursor_steps_different=len(cursors_differ),
        validation=validation,
        evaluations=evaluations,
    )


# --- everything together -----------------------------------------------------------------------------


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
    """The whole comparison. `child` says which run is a fork of the other ("a", "b" or ""): deciding
    it means resolving run locations, which is the caller's business."""
    from_step, content_a, content_b = aligned_streams(records_a, records_b)
    known = {**known_configs(records_a), **known_configs(records_b)}
    divergence = first_divergence(content_a, content_b, rtol=rtol)
    return DiffReport(
        relation=Relation(child=child, parent_a=fork_origin(records_a), parent_b=fork_origin(records_b)),
        config_differences=config_differences(final_config(records_a), final_config(records_b)),
        config_changes={"a": config_changes(records_a, known), "b": config_changes(records_b, known)},
        compared_from_step=from_step,
        runs={"a": _run_end(records_a, len(content_a)), "b": _run_end(records_b, len(content_b))},
        rtol=rtol,
        divergence=divergence,
        metrics=summarize_metrics(content_a, content_b, divergence.step if divergence else from_step),
    )
