"""What `rewind diff` reports, and which events it compares: the report's shapes, apart from the code
that fills them (`diffing`, `diffstream`, `diffmetrics`), which all need them.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rewind.states.events import (
    Evaluated,
    Event,
    FadeEnded,
    FadeStarted,
    ForkOrigin,
    NonFiniteLoss,
    OptimizerReset,
    ReferenceRefreshed,
    RolloutsRecorded,
    RunFinished,
    StackAppended,
    StageEntered,
    StepCommitted,
    Validated,
)

CONTENT_TYPES: tuple[type[Event], ...] = (
    StageEntered,
    FadeStarted,
    FadeEnded,
    ReferenceRefreshed,
    OptimizerReset,
    StackAppended,
    RolloutsRecorded,  # a grpo stage's batch, named by its content: two runs sampled alike or not
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


def event_at(seq: int, event: Event) -> EventAt:
    return EventAt(type=type(event).__name__, step=event.step, seq=seq)
