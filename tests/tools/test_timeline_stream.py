"""`rewind timeline` in one pass: a long resumed run summarised as its whole log says, in memory that
does not grow with the run, and the plot's bounded buckets (exact for short runs, bounded for long)."""

from __future__ import annotations

import itertools
import json
import math
import tracemalloc

import numpy as np
import pytest

from rewind.states.events import CheckpointCommitted, Evaluated, RunResumed, StepCommitted, Validated
from rewind.states.history import effective
from rewind.states.strategies import simulate_run
from rewind.stores.runs import read_seq_events
from rewind.tools.plots import MAX_POINTS
from rewind.tools.timeline_buckets import PointSampler, StepBuckets, StepColumns, bucket_edges, bucket_mean
from rewind.tools.timeline_scan import LOSS_WINDOW_FRACTION, LOSS_WINDOW_MAX, Timeline
from tests.states.test_diffstream import generated_run
from tests.tools.stream_synthetic import long_config, write_run

CRASHES = (2_403, 3_800, 5_222)


@pytest.fixture(scope="module")
def long_run(tmp_path_factory) -> str:
    """6,000 simulated steps (stages of 3,000, 1,500 and 1,500: the loss windows are at their largest),
    three resumes."""
    run = str(tmp_path_factory.mktemp("long") / "run")
    write_run(run, simulate_run(long_config(6_000), crash_after=CRASHES), segment_bytes=64 << 10)
    return run


def test_a_long_resumed_run_is_summarised_as_its_whole_log_says(long_run, rewind_cli):
    code, out, err = rewind_cli("timeline", long_run, "--json")
    assert code == 0, err
    summary = json.loads(out)
    records = read_seq_events(long_run)
    kept = [e for _, e in effective(records)]
    steps = [e for e in kept if isinstance(e, StepCommitted)]
    stage_of = {e.step: e.stage for e in steps}
    for row in summary["stages"]:
        mine = [e for e in steps if e.stage == row["stage"]]
        losses = [e.loss for e in mine if math.isfinite(e.loss)]
        window = min(LOSS_WINDOW_MAX, max(1, round(len(losses) * LOSS_WINDOW_FRACTION)))
        assert window == LOSS_WINDOW_MAX  # the stages are long enough for the whole window
        assert (row["num_steps"], row["first_step"], row["last_step"]) == (
            len(mine),
            mine[0].step,
            mine[-1].step,
        )
        assert row["loss_start"] == sum(losses[:window]) / window  # the same sums, in the same order
        assert row["loss_end"] == sum(losses[-window:]) / window
        assert row["loss_min"] == min(losses)
        validated = {}
        for v in (e for e in kept if isinstance(e, Validated) and stage_of.get(e.step, 0) == row["stage"]):
            validated.update(v.losses)
        assert row["validation"] == validated
        scores = [e.scores for e in kept if isinstance(e, Evaluated) and e.boundary == row["stage"]]
        assert row["evaluation"] == scores[-1]
    resumes = [(s, e) for s, e in records if isinstance(e, RunResumed)]
    markers = [m for m in summary["markers"] if m["kind"] == "resumed"]
    assert len(markers) == len(resumes) == 3 and summary["num_resumes"] == 3
    for (_, resume), marker in zip(resumes, markers, strict=True):
        first, last = resume.superseded_first_seq, resume.superseded_last_seq
        redone = [e.step for s, e in records if first <= s <= last and isinstance(e, StepCommitted)]
        assert marker["superseded_steps"] == redone and redone
    assert summary["checkpoints"]["steps"] == [e.step for e in kept if isinstance(e, CheckpointCommitted)]


def test_the_pass_holds_the_same_memory_however_long_the_run():
    def peak(num_steps: int) -> int:
        timeline = Timeline("generated", with_plot=True)
        tracemalloc.start()
        try:
            for seq, event in generated_run(num_steps, validate_every=3):
                timeline.add(seq, event, superseded=seq % 1_000 == 5)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    small, large = peak(5_000), peak(50_000)
    assert large < small * 1.5  # ten times the steps; the buckets were full at both lengths
    assert large < 3_000_000  # a list of the 50,000 steps alone would be about 30 MB


# --- the plot's buckets -------------------------------------------------------------------------------


def steps_of(num_steps: int) -> list[StepCommitted]:
    # cursors after step k: "a" advances k % 4 rows, "b" the rest of 4; "c" joins mid-run
    a = [0, *itertools.accumulate(k % 4 for k in range(1, num_steps + 1))]  # a[k]: a's rows after step k
    return [
        StepCommitted(
            step=k,
            tokens=16 * k,
            stage=k * 3 // (num_steps + 1),
            lr=1.0 / k,
            beta=0.1 * (k % 3),
            loss=math.nan if k % 97 == 0 else 1.0 + math.sin(k),
            rows=[k % 4, 4 - k % 4] if k < num_steps // 2 else [1, 2, 1],  # a stage added mid-run
            kl=math.inf if k % 89 == 0 else 0.5 + math.cos(k) / 4,
            cursors={"a": a[k], "b": 4 * k - a[k]} | ({"c": k} if k >= num_steps // 2 else {}),
        )
        for k in range(1, num_steps + 1)
    ]


def _moved(steps: list[StepCommitted]) -> np.ndarray:
    """Each step's rows per dataset (a, b, c) as fractions of the step's rows."""
    moved = np.zeros((len(steps), 3))
    for i in range(len(steps)):
        now, before = steps[i].cursors, steps[i - 1].cursors if i else {}
        row = [now.get(n, 0) - before.get(n, 0) for n in "abc"]
        moved[i] = np.array(row) / sum(row)
    return moved


def mean_within(values: np.ndarray, window: int, segments: list[int]) -> np.ndarray:
    """The centred moving average of the finite values, by definition: over the positions within
    window // 2 of each one that lie in its segment."""
    means = np.full(len(values), math.nan)
    for i in range(len(values)):
        near = range(max(i - window // 2, 0), min(i + window // 2 + 1, len(values)))
        kept = [values[j] for j in near if segments[j] == segments[i] and math.isfinite(values[j])]
        if kept:
            means[i] = sum(kept) / len(kept)
    return means


def test_short_runs_plot_exactly_as_from_the_whole_arrays():
    """Up to 2 x MAX_POINTS steps each bucket is one step: the columns are the steps' own figures, the
    smoothed ones averaged within a segment, which a change of stage or a cut (a growth) begins."""
    steps = steps_of(3_000)  # more than MAX_POINTS, fewer than the buckets hold
    buckets = StepBuckets()
    for e in steps:
        buckets.add(e)
    assert buckets.width == 1
    cut = steps[1_500].tokens  # after step 1,501, inside stage 1 (steps 1,001..2,000)
    columns = StepColumns(buckets, tokens_per_step=16, cuts=[cut])
    loss = np.array([e.loss for e in steps])
    kl = np.array([e.kl if math.isfinite(e.kl) else math.nan for e in steps])
    edges = bucket_edges(len(steps))
    assert columns.reduced and np.array_equal(columns.tokens, np.array([e.tokens for e in steps])[edges])
    assert np.array_equal(columns.low, np.fmin.reduceat(loss, edges), equal_nan=True)
    assert np.array_equal(columns.high, np.fmax.reduceat(loss, edges), equal_nan=True)
    segments = [(e.stage, e.tokens > cut) for e in steps]
    assert len(set(segments)) == 4 and len(set(columns.segment.tolist())) == 4
    window = round(3_000 / 40)
    assert np.allclose(columns.smooth, mean_within(loss, window, segments)[edges], rtol=1e-12, equal_nan=True)
    assert np.allclose(columns.kl, mean_within(kl, window, segments)[edges], rtol=1e-12, equal_nan=True)
    assert buckets.dataset_names == ["a", "b", "c"]
    assert np.allclose(columns.datasets, bucket_mean(_moved(steps), edges), rtol=1e-12)


def test_long_runs_are_kept_in_bounded_buckets_that_add_up():
    steps = steps_of(21_003)
    buckets = StepBuckets(max_points=1_000)
    for e in steps:
        buckets.add(e)
    assert buckets.width == 16 and len(buckets.size) <= 2_000 and sum(buckets.size) == len(steps)
    start = 0
    for i, size in enumerate(buckets.size):  # each bucket sums up exactly the steps it covers
        mine = steps[start : start + size]
        finite = [e.loss for e in mine if math.isfinite(e.loss)]
        assert buckets.tokens[i] == mine[0].tokens and buckets.stage[i] == mine[0].stage
        assert math.isclose(buckets.loss_sum[i], sum(finite)) and buckets.loss_count[i] == len(finite)
        assert buckets.loss_min[i] == min(finite) and buckets.loss_max[i] == max(finite)
        finite_kl = [e.kl for e in mine if math.isfinite(e.kl)]
        assert math.isclose(buckets.kl_sum[i], sum(finite_kl)) and buckets.kl_count[i] == len(finite_kl)
        assert math.isclose(sum(buckets.dataset_shares[i]), size)  # each step's shares add up to 1
        assert size == buckets.width or i == len(buckets.size) - 1
        start += size
    assert len(StepColumns(buckets, 16).tokens) <= MAX_POINTS


def test_point_samples_are_evenly_spread_and_bounded():
    short = PointSampler(max_points=100)
    for i in range(150):
        short.add(i, -i)
    assert short.points(max_points=100)[0] == [int(i) for i in bucket_edges(150, 100)]  # as over all
    long = PointSampler(max_points=100)
    for i in range(10_001):
        long.add(i, -i)
    assert long.stride == 64 and long.xs == list(range(0, 10_001, 64))  # every 64th point, from the first
    assert len(long.points(max_points=100)[0]) == 100
