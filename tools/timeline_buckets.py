"""Bounded summaries of a run's long series for `rewind timeline --plot`, filled one record at a time.

A plot has room for about MAX_POINTS points across; a long run logs a million steps. So the series
are reduced while the log streams past, never held whole:
- `StepBuckets`: the effective StepCommitted stream as at most 2 x MAX_POINTS buckets of consecutive
  steps, all of one width (a power of two: when they are full, neighbours merge and the width
  doubles). Each keeps what the panels draw: the first step's tokens, stage, LR, beta and loss, the
  finite losses' sum and count, the losses' min and max (NaN ignored), the finite KL terms' sum and
  count, and the row shares per dataset (each step's cursor advances: the fades between stages and
  the split inside one, e.g. 80% task and 20% replay, which shares per stage could not show).
- `PointSampler`: every k-th point of a series, k doubling as it grows: at most 2 x MAX_POINTS points,
  evenly spread (validation losses, superseded steps).
At drawing time `bucket_edges` brings either down to MAX_POINTS (`StepColumns`, what the panels draw),
as the plot did over whole arrays before it streamed; up to 2 x MAX_POINTS steps nothing has been
merged, so such runs plot as then.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from rewind.states.events import StepCommitted
from rewind.tools.plots import MAX_POINTS


def bucket_edges(num_points: int, max_points: int = MAX_POINTS) -> np.ndarray:
    """Start indices of at most max_points contiguous buckets covering range(num_points)."""
    num_buckets = min(num_points, max_points)
    return np.unique(np.linspace(0, num_points, num_buckets + 1).astype(np.int64)[:-1])


def bucket_mean(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Mean of the finite values of each bucket (NaN where a bucket has none). values: (n,) or (n, k)."""
    finite = np.isfinite(values)
    sums = np.add.reduceat(np.where(finite, values, 0.0), edges, axis=0)
    counts = np.add.reduceat(finite.astype(np.float64), edges, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / counts


def windowed_mean(
    sums: np.ndarray, counts: np.ndarray, window: int, segments: np.ndarray | None = None
) -> np.ndarray:
    """Centred moving average of series given as per-position sums and counts (of finite values). With
    `segments` (a non-decreasing segment number per position) a window stops at its position's segment's
    ends: a curve does not average across a stage boundary or a growth, where the loss jumps."""
    total = np.concatenate([[0.0], np.cumsum(sums)])
    number = np.concatenate([[0.0], np.cumsum(counts)])
    index = np.arange(len(sums))
    low = np.clip(index - window // 2, 0, len(sums))
    high = np.clip(index + window // 2 + 1, 0, len(sums))
    if segments is not None:
        low = np.maximum(low, np.searchsorted(segments, segments, side="left"))
        high = np.minimum(high, np.searchsorted(segments, segments, side="right"))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (total[high] - total[low]) / (number[high] - number[low])


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average over the finite values (skipped steps carry NaN losses)."""
    finite = np.isfinite(values)
    return windowed_mean(np.where(finite, values, 0.0), finite.astype(np.float64), window)


def _fmin(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else min(a, b)


def _fmax(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


class StepBuckets:
    """The effective StepCommitted stream, reduced as it arrives (see the module's docstring)."""

    def __init__(self, max_points: int = MAX_POINTS):
        self.capacity = 2 * max_points
        self.width = 1  # steps per bucket; only the last bucket may hold fewer
        self.num_steps = 0
        self.last_tokens = 0
        self.last_beta = 0.0
        # One entry per bucket in each column.
        self.tokens: list[int] = []
        self.stage: list[int] = []
        self.lr: list[float] = []
        self.beta: list[float] = []
        self.first_loss: list[float] = []
        self.loss_sum: list[float] = []
        self.loss_count: list[int] = []
        self.loss_min: list[float] = []
        self.loss_max: list[float] = []
        self.kl_sum: list[float] = []
        self.kl_count: list[int] = []
        # Per dataset (in `dataset_names` order): the sum over the bucket's steps of rows / batch. A step's
        # rows of a dataset are how far it moved that dataset's cursor; a step whose previous cursors
        # are unknown (the first of a fork's log) counts nothing, rather than a parent's whole history.
        self.dataset_names: list[str] = []
        self.dataset_shares: list[list[float]] = []
        self._cursors: dict[str, int] | None = None
        self.size: list[int] = []

    def add(self, e: StepCommitted) -> None:
        loss = e.loss
        finite = math.isfinite(loss)
        kl_finite = math.isfinite(e.kl)
        moved = self._cursor_advance(e.step, e.cursors)
        if self.num_steps % self.width == 0:  # the step opens a new bucket
            if len(self.size) == self.capacity:
                self._merge_pairs()
            self.tokens.append(e.tokens)
            self.stage.append(e.stage)
            self.lr.append(e.lr)
            self.beta.append(e.beta)
            self.first_loss.append(loss)
            self.loss_sum.append(loss if finite else 0.0)
            self.loss_count.append(int(finite))
            self.loss_min.append(loss)
            self.loss_max.append(loss)
            self.kl_sum.append(e.kl if kl_finite else 0.0)
            self.kl_count.append(int(kl_finite))
            self.dataset_shares.append(moved)
            self.size.append(1)
        else:  # this runs for almost every step of a long run: in place, no lists made
            if finite:
                self.loss_sum[-1] += loss
                self.loss_count[-1] += 1
            low, high = self.loss_min[-1], self.loss_max[-1]
            if loss < low or low != low:  # as numpy's fmin: a NaN gives way to any number
                self.loss_min[-1] = loss
            if loss > high or high != high:
                self.loss_max[-1] = loss
            if kl_finite:
                self.kl_sum[-1] += e.kl
                self.kl_count[-1] += 1
            into = self.dataset_shares[-1]
            if len(into) < len(moved):
                into.extend([0.0] * (len(moved) - len(into)))
            for i, share in enumerate(moved):
                into[i] += share
            self.size[-1] += 1
        self.num_steps += 1
        self.last_tokens, self.last_beta = e.tokens, e.beta

    def _cursor_advance(self, step: int, cursors: dict[str, int]) -> list[float]:
        """This step's rows per dataset as fractions of its batch, in `dataset_names` order."""
        previous, self._cursors = self._cursors, cursors
        if previous is None and step == 1:
            previous = {}  # the run's first step (StepCommitted counts steps done): cursors started at 0
        for name in cursors:
            if name not in self.dataset_names:
                self.dataset_names.append(name)
        if previous is None:
            return [0.0] * len(self.dataset_names)
        moved = [max(cursors.get(name, 0) - previous.get(name, 0), 0) for name in self.dataset_names]
        total = sum(moved)
        return [m / total for m in moved] if total > 0 else [0.0] * len(moved)

    def _merge_pairs(self) -> None:
        """Two neighbouring buckets become one: half as many buckets, twice as wide (all are full)."""
        for column in (self.tokens, self.stage, self.lr, self.beta, self.first_loss):
            column[:] = column[::2]
        for column in (self.loss_sum, self.loss_count, self.kl_sum, self.kl_count, self.size):
            column[:] = [a + b for a, b in zip(column[::2], column[1::2], strict=True)]
        self.loss_min[:] = [_fmin(a, b) for a, b in zip(self.loss_min[::2], self.loss_min[1::2], strict=True)]
        self.loss_max[:] = [_fmax(a, b) for a, b in zip(self.loss_max[::2], self.loss_max[1::2], strict=True)]
        pairs = zip(self.dataset_shares[::2], self.dataset_shares[1::2], strict=True)
        self.dataset_shares[:] = [_add(a, b) for a, b in pairs]
        self.width *= 2

    def dataset_matrix(self) -> np.ndarray:
        """(buckets, datasets) summed row shares, datasets in `dataset_names` order."""
        matrix = np.zeros((len(self.dataset_shares), len(self.dataset_names)))
        for i, shares in enumerate(self.dataset_shares):
            matrix[i, : len(shares)] = shares
        return matrix


def _add(a: list[float], b: list[float]) -> list[float]:
    if len(a) < len(b):
        a, b = b, a
    return [x + y for x, y in zip(a, b, strict=False)] + a[len(b) :]


class PointSampler:
    """Every `stride`-th point (x, y) of a series, the stride doubling whenever 2 x max_points are kept."""

    def __init__(self, max_points: int = MAX_POINTS):
        self.capacity = 2 * max_points
        self.stride = 1
        self.num_points = 0
        self.xs: list[float] = []
        self.ys: list[float] = []

    def add(self, x: float, y: float) -> None:
        if self.num_points % self.stride == 0:
            if len(self.xs) == self.capacity:
                self.xs, self.ys = self.xs[::2], self.ys[::2]
                self.stride *= 2
            if self.num_points % self.stride == 0:
                self.xs.append(x)
                self.ys.append(y)
        self.num_points += 1

    def points(self, max_points: int = MAX_POINTS) -> tuple[list[float], list[float]]:
        """At most max_points of the kept points, evenly spread (all of them for a short series)."""
        keep = bucket_edges(len(self.xs), max_points)
        return [self.xs[i] for i in keep], [self.ys[i] for i in keep]


def smoothing_segments(stages: np.ndarray, tokens: np.ndarray, cuts) -> np.ndarray:
    """A segment number per bucket, a new one at each change of primary stage and after each token
    position in `cuts` (growths, reference refreshes: where the loss or the KL term jumps)."""
    stages, tokens = np.asarray(stages, dtype=np.int64), np.asarray(tokens, dtype=np.float64)
    # How many cuts lie before each bucket's first step ends: a cut after step k parts steps k and k + 1.
    crossed = np.searchsorted(np.sort(np.asarray(list(cuts), dtype=np.float64)), tokens, side="left")
    starts = (np.diff(stages, prepend=stages[:1]) != 0) | (np.diff(crossed, prepend=crossed[:1]) != 0)
    return np.cumsum(starts)


class StepColumns:
    """The effective steps as at most MAX_POINTS buckets (single steps for a short run), as columns:
    x = tokens after each bucket's first step, start = before it. The smoothed loss and KL average
    within one segment (see `smoothing_segments`; `cuts` are token positions that start a new one)."""

    def __init__(self, buckets: StepBuckets, tokens_per_step: int, cuts=()):
        self.num_steps = buckets.num_steps
        edges = bucket_edges(len(buckets.size))
        self.reduced = len(edges) < self.num_steps
        self.last_tokens, self.last_beta = buckets.last_tokens, buckets.last_beta

        def first(column: list, dtype=np.float64) -> np.ndarray:
            return np.array(column, dtype=dtype)[edges]

        def summed(column: list) -> np.ndarray:
            values = np.array(column, dtype=np.float64)
            return np.add.reduceat(values, edges, axis=0) if len(edges) else values

        self.tokens = first(buckets.tokens)
        self.start = self.tokens - tokens_per_step
        self.stage = first(buckets.stage, np.int64)
        self.lr, self.beta, self.loss = first(buckets.lr), first(buckets.beta), first(buckets.first_loss)
        loss_min, loss_max = np.array(buckets.loss_min), np.array(buckets.loss_max)
        self.low = np.fmin.reduceat(loss_min, edges) if len(edges) else loss_min
        self.high = np.fmax.reduceat(loss_max, edges) if len(edges) else loss_max
        # About 40 windows across the run, however long; over the stored buckets, so exactly the
        # per-step moving average while they are single steps.
        window = max(1, round(max(self.num_steps, 1) / 40 / buckets.width))
        segments = smoothing_segments(np.array(buckets.stage), np.array(buckets.tokens), cuts)
        self.segment = segments[edges]
        sums = np.array(buckets.loss_sum, dtype=np.float64)
        counts = np.array(buckets.loss_count, dtype=np.float64)
        self.smooth = windowed_mean(sums, counts, window, segments)[edges]
        kl_sums = np.array(buckets.kl_sum, dtype=np.float64)
        kl_counts = np.array(buckets.kl_count, dtype=np.float64)
        self.kl = windowed_mean(kl_sums, kl_counts, window, segments)[edges]
        self.dataset_names = list(buckets.dataset_names)
        datasets = buckets.dataset_matrix()
        datasets = np.add.reduceat(datasets, edges, axis=0) if len(edges) and datasets.size else datasets
        self.datasets = datasets / summed(buckets.size)[:, None] if datasets.size else datasets


def runs_of(values: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, first index, last index + 1) of each run of equal values."""
    if len(values) == 0:
        return []
    cuts = np.flatnonzero(np.diff(values)) + 1
    bounds = [0, *cuts.tolist(), len(values)]
    return [(int(values[a]), a, b) for a, b in itertools.pairwise(bounds)]
