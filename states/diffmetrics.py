"""How much two runs differ after their divergence, summed up one step at a time.

The summaries match steps by step number: per scalar metric the largest |a - b| (and the first step
where it occurs) and how many steps differ at all; rows and cursors; validation losses per dataset;
and the evaluation scores per boundary. Each is a running figure, so the two runs' content can stream
past: `MetricsAccumulator.add_step` takes the content events of one step from each run, steps in
ascending order, and `merge_by_step` pairs up the steps of two streams. Memory is one step's events
per run, plus one entry per dataset and per evaluated boundary.

Steps must not go back within a run's stream (every legal log's effective records keep that order); a
stream that does raises `UnorderedSteps` rather than being matched wrongly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from itertools import zip_longest

from rewind.states.compare import floats_equal
from rewind.states.diffreport import SCALAR_METRICS, EvaluationPair, MetricDelta, Metrics
from rewind.states.events import Evaluated, Event, StepCommitted, Validated


class UnorderedSteps(ValueError):
    """A run's effective records go back to an earlier step: no log a run writes does that. `side`
    names the run ("a" or "b") when the comparison knows it."""

    def __init__(self, message: str, side: str = ""):
        super().__init__(message)
        self.side = side


def abs_delta(x: float, y: float) -> float:
    """|x - y|: 0 for bitwise-equal values (NaN included), inf when they differ and one is not finite."""
    if floats_equal(x, y):
        return 0.0
    delta = abs(x - y)
    return math.inf if math.isnan(delta) else delta


def _same_bits(x: float, y: float) -> bool:
    # floats_equal packs both values; equal non-zero numbers always have equal bits, so most steps of
    # runs that agree are decided by one comparison (this runs per metric per step).
    return (x == y and x != 0) or floats_equal(x, y)


class RunningDelta:
    """Over (step, a, b) triples given in ascending step order: the largest |a - b| (the first step
    where it occurs) and how many steps differ at all (bitwise: -0.0 against 0.0 counts, though its
    delta is 0)."""

    __slots__ = ("at_step", "best", "name", "num_different")

    def __init__(self, name: str):
        self.name = name
        self.best = 0.0
        self.at_step: int | None = None
        self.num_different = 0

    def add(self, step: int, a: float, b: float) -> None:
        if _same_bits(a, b):
            return
        self.num_different += 1
        delta = abs(a - b)
        if math.isnan(delta):
            delta = math.inf
        if delta > self.best:
            self.best, self.at_step = delta, step

    def result(self) -> MetricDelta:
        return MetricDelta(
            name=self.name,
            max_abs_delta=self.best,
            at_step=self.at_step,
            num_steps_different=self.num_different,
        )


def _step_ends(events: list[Event], evaluations: dict[int, Evaluated]) -> tuple[Event | None, Event | None]:
    """The last StepCommitted and the last Validated among one step's events (a step's last word, as the
    report takes it); its evaluations go into `evaluations`, the last per boundary winning."""
    step = validated = None
    for event in events:
        if isinstance(event, StepCommitted):
            step = event
        elif isinstance(event, Validated):
            validated = event
        elif isinstance(event, Evaluated):
            evaluations[event.boundary] = event
    return step, validated


class MetricsAccumulator:
    """The `Metrics` of two runs from `from_step` on, fed one step at a time in ascending order."""

    def __init__(self, from_step: int):
        self.from_step = from_step
        self.scalars = {name: RunningDelta(name) for name in SCALAR_METRICS}
        self.num_steps_both = self.num_steps_only_a = self.num_steps_only_b = 0
        self.num_rows_steps_different = self.max_row_difference = self.num_cursor_steps_different = 0
        self.validation: dict[str, RunningDelta] = {}  # per dataset validated in both runs
        # The last evaluation per boundary: a handful per run, whatever its length.
        self.evaluations_a: dict[int, Evaluated] = {}
        self.evaluations_b: dict[int, Evaluated] = {}

    def add_step(
        self, step: int, events_a: list[Event], events_b: list[Event], identical: bool = False
    ) -> None:
        """The content events each run logged at `step` (either list may be empty). `identical`: the
        caller knows the two lists are equal pair by pair, bit for bit, so only the counts move."""
        if step < self.from_step:
            return
        step_a, valid_a = _step_ends(events_a, self.evaluations_a)
        step_b, valid_b = _step_ends(events_b, self.evaluations_b)
        if step_a is not None and step_b is not None:
            self.num_steps_both += 1
            if not identical:
                self._compare_steps(step, step_a, step_b)
        elif step_a is not None:
            self.num_steps_only_a += 1
        elif step_b is not None:
            self.num_steps_only_b += 1
        if valid_a is not None and valid_b is not None:
            for name in valid_a.losses.keys() & valid_b.losses.keys():
                running = self.validation.get(name)
                if running is None:
                    running = self.validation[name] = RunningDelta(name)
                running.add(step, valid_a.losses[name], valid_b.losses[name])

    def _compare_steps(self, step: int, a: StepCommitted, b: StepCommitted) -> None:
        for name, running in self.scalars.items():
            running.add(step, getattr(a, name), getattr(b, name))
        if a.rows != b.rows:
            self.num_rows_steps_different += 1
            # Runs with different stage counts: a stage that one run does not have drew 0 rows in it.
            rows = max(abs(x - y) for x, y in zip_longest(a.rows, b.rows, fillvalue=0))
            self.max_row_difference = max(self.max_row_difference, rows)
        self.num_cursor_steps_different += a.cursors != b.cursors

    def result(self) -> Metrics:
        evals_a, evals_b = self.evaluations_a, self.evaluations_b
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
            from_step=self.from_step,
            num_steps_both=self.num_steps_both,
            num_steps_only_a=self.num_steps_only_a,
            num_steps_only_b=self.num_steps_only_b,
            scalars=[self.scalars[name].result() for name in SCALAR_METRICS],
            num_rows_steps_different=self.num_rows_steps_different,
            max_row_difference=self.max_row_difference,
            num_cursor_steps_different=self.num_cursor_steps_different,
            validation=[running.result() for _, running in sorted(self.validation.items())],
            evaluations=evaluations,
        )


def step_groups(events: Iterable[Event]) -> Iterator[tuple[int, list[Event]]]:
    """(step, its events) for each run of consecutive events of one step, in stream order."""
    step: int | None = None
    group: list[Event] = []
    for event in events:
        if event.step != step:
            if step is not None:
                if event.step < step:
                    raise UnorderedSteps(f"{type(event).__name__} at step {event.step} after step {step}")
                yield step, group
            step, group = event.step, []
        group.append(event)
    if step is not None:
        yield step, group


def merge_by_step(metrics: MetricsAccumulator, events_a: Iterable[Event], events_b: Iterable[Event]) -> None:
    """Feed two content streams to `metrics`, step by step; a step only one run logged pairs with
    nothing. Both streams are read to their ends, each at most one step ahead of the other."""
    groups_a, groups_b = step_groups(events_a), step_groups(events_b)
    next_a, next_b = next(groups_a, None), next(groups_b, None)
    while next_a is not None or next_b is not None:
        if next_b is None or (next_a is not None and next_a[0] < next_b[0]):
            metrics.add_step(next_a[0], next_a[1], [])
            next_a = next(groups_a, None)
        elif next_a is None or next_b[0] < next_a[0]:
            metrics.add_step(next_b[0], [], next_b[1])
            next_b = next(groups_b, None)
        else:
            metrics.add_step(next_a[0], next_a[1], next_b[1])
            next_a, next_b = next(groups_a, None), next(groups_b, None)
