"""The streaming diff (`diffing.diff_streams`): the same report as the list-based one it replaced
(`diff_reference`, kept as the oracle), reading each run once and in step with the other, in memory
that does not grow with the runs. Synthetic logs from `strategies.simulate_run` and generators."""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.states.diffing import UnorderedSteps, diff_runs, diff_streams
from rewind.states.events import (
    CheckpointCommitted,
    Event,
    RunResumed,
    StepCommitted,
    Validated,
)
from rewind.states.strategies import configs, simulate_run
from tests.states import diff_reference
from tests.states.test_diffing import FLOAT_FIELDS, STRAIGHT, checkpoints_of, fork_of, seq_events

replace = msgspec.structs.replace
SMALL_RUNS = configs(max_stages=3, max_steps=30)
MUTATIONS = ("none", "none", "scale_from", "field", "rows", "validation", "drop", "repeat", "cut")


def encoded(report) -> bytes:
    return msgspec.msgpack.encode(report)  # bit for bit, NaN payloads included


@st.composite
def mutated(draw, events: list[Event]) -> list[Event]:
    """`events` with one thing changed: what makes two runs part in every way the report can show."""
    events = list(events)
    kind = draw(st.sampled_from(MUTATIONS))
    # Records are inserted or dropped only after the last resume: before it they would shift the seqs
    # that its superseded range names, which no writer does.
    first = 1 + max((i for i, e in enumerate(events) if isinstance(e, RunResumed)), default=0)
    if kind == "none" or len(events) < 2:
        return events
    if kind == "cut":
        return events[: draw(st.integers(1, len(events) - 1))]
    if first >= len(events):
        return events
    i = draw(st.integers(first, len(events) - 1))
    e = events[i]
    if kind == "scale_from":  # every loss from this step on, as a changed seed or kernel would
        return [
            replace(x, loss=x.loss * (1 + 1e-9)) if isinstance(x, StepCommitted) and x.step >= e.step else x
            for x in events
        ]
    if kind == "field" and isinstance(e, StepCommitted):
        name = draw(st.sampled_from(FLOAT_FIELDS))
        value = getattr(e, name)
        new = draw(st.sampled_from((-0.0, 0.0, math.nan, math.inf, value * 1.5, value + 1e-12)))
        events[i] = replace(e, **{name: new})
    elif kind == "rows" and isinstance(e, StepCommitted):
        events[i] = replace(e, rows=[*e.rows, 1], cursors={**e.cursors, "extra": 1})
    elif kind == "validation" and isinstance(e, Validated):
        events[i] = replace(e, losses={**e.losses, "grammar": 9.0, "other": 1.0})
    elif kind == "drop" and not isinstance(e, RunResumed):
        del events[i]
    elif kind == "repeat" and not isinstance(e, RunResumed | CheckpointCommitted):
        events.insert(i, e)
    return events


def maybe_forked(draw, events: list[Event]) -> list[Event]:
    names = checkpoints_of(events)
    if names and draw(st.booleans()):
        return fork_of(events, draw(st.sampled_from(names)))
    return events


@settings(max_examples=200, deadline=None)
@given(
    SMALL_RUNS, st.lists(st.integers(0, 30), max_size=2), st.lists(st.integers(0, 30), max_size=2), st.data()
)
def test_the_streamed_report_is_the_list_based_one(config, crashes_a, crashes_b, data):
    a = maybe_forked(data.draw, simulate_run(config, crash_after=crashes_a))
    b = maybe_forked(data.draw, simulate_run(config, crash_after=crashes_b))
    b = data.draw(mutated(b))
    rtol = data.draw(st.sampled_from((0.0, 1e-6)))
    for x, y in ((a, b), (b, a)):
        expected = diff_reference.diff_runs(seq_events(x), seq_events(y), rtol=rtol, child="b")
        assert encoded(diff_runs(seq_events(x), seq_events(y), rtol=rtol, child="b")) == encoded(expected)


# --- reading in step --------------------------------------------------------------------------------


def generated_run(num_steps: int, *, perturbed_from: int = 0, validate_every: int = 10) -> Iterator:
    """A run's effective records, made as they are read (nothing holds them): RunStarted, then steps,
    with a validation every `validate_every` steps; losses scaled from step `perturbed_from` on."""
    yield 0, STRAIGHT[0]
    seq = 1
    for k in range(1, num_steps + 1):
        loss = 4.0 / math.sqrt(k) * (1 + 1e-9 if perturbed_from and k >= perturbed_from else 1)
        cursors = {"grammar": 2 * k}
        yield (
            seq,
            StepCommitted(
                step=k, tokens=16 * k, stage=0, lr=0.1, beta=0.0, loss=loss, rows=[2, 0], cursors=cursors
            ),
        )
        seq += 1
        if k % validate_every == 0:
            yield seq, Validated(step=k, tokens=16 * k, losses={"grammar": loss})
            seq += 1


class Reads:
    """Watches two streams as the diff takes records from them: how far (in steps) one was ever ahead
    of the other while both still had records to give."""

    def __init__(self) -> None:
        self.step = {"a": 0, "b": 0}
        self.ended: set[str] = set()
        self.max_lead = 0

    def watched(self, side: str, records) -> Iterator:
        for seq, event in records:
            self.step[side] = event.step
            if not self.ended:
                self.max_lead = max(self.max_lead, abs(self.step["a"] - self.step["b"]))
            yield seq, event
        self.ended.add(side)


@pytest.mark.parametrize(
    ("run_b", "what"),
    [
        (lambda: generated_run(20_000), "no divergence"),
        (lambda: generated_run(20_000, perturbed_from=10_000), "every loss from the middle on"),
        (lambda: generated_run(20_000, validate_every=7), "other validation steps: matched by step"),
        (lambda: generated_run(12_000), "B ends early"),
    ],
)
def test_the_runs_are_read_in_step(run_b, what):
    reads = Reads()
    report = diff_streams(reads.watched("a", generated_run(20_000)), reads.watched("b", run_b()))
    assert reads.max_lead <= 1, what  # a list() of either stream would put it 20,000 steps ahead
    assert reads.ended == {"a", "b"}  # and both were read to their ends
    assert (report.divergence is None) == (what == "no divergence")
    assert report.runs["a"].last_step == 20_000


def traced_peak(work) -> int:
    tracemalloc.start()
    try:
        work()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_runs():
    def diff(num_steps: int):
        return lambda: diff_streams(
            generated_run(num_steps),
            generated_run(num_steps, perturbed_from=num_steps // 2, validate_every=7),
        )

    small, large = traced_peak(diff(2_000)), traced_peak(diff(30_000))
    held = traced_peak(lambda: list(generated_run(30_000)))  # what holding one of the runs would cost
    assert held > 10_000_000
    assert large < small + 200_000  # 15 times the steps, about the same memory
    assert large < held / 20


def test_steps_that_go_back_are_refused_and_the_run_named():
    events = list(STRAIGHT)
    nine, ten = (
        next(i for i, e in enumerate(events) if isinstance(e, StepCommitted) and e.step == k) for k in (9, 10)
    )
    events[nine], events[ten] = events[ten], events[nine]
    records = seq_events(events)
    with pytest.raises(UnorderedSteps) as raised:
        diff_streams(iter(seq_events(STRAIGHT)), iter(records))
    assert raised.value.side == "b"
