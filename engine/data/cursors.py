"""Which rows a training step reads: stateless shuffled cursors over every dataset.

A cursor is a plain int per dataset, the number of samples consumed so far; it lives in the run's
control state (`State.cursors`), so there is no reader object to checkpoint. Position p of dataset
`name` with n samples reads row

    permutation[seed, name, epoch](p mod n),  epoch = p // n

where the permutation is a keyed pseudo-random bijection on [0, n): a 6-round Feistel network on
the smallest even number of bits that covers n, with cycle-walking to stay inside [0, n). It costs
O(1) time and memory per position (no index array, fine for 2**31 samples), every epoch is a fresh
order, and resuming at a cursor reads exactly the rows the killed run would have read.

`assemble_batch` builds one step's rows: each stage's share of the batch (the fade allocation,
decided in `rewind.states`) is split across the stage's mixture by `split_rows`, and every dataset
is read from its one cursor, shared by all stages that mix it in.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from fractions import Fraction

import numpy as np
import torch

from rewind.engine.data.datasets import Dataset
from rewind.engine.data.permutation import permute, permute_int, round_keys
from rewind.states.config import Config, Sampling

# Splits up to this many rows get each epoch's order as a cached array (2 MiB, ~20 ms to build): a draw is
# then a slice, which keeps batch assembly near a bare memmap gather. Larger splits (the built-in tasks'
# 2**20 rows and up) walk the permutation per position: the same rows, O(1) memory.
CACHED_ORDER_MAX_SAMPLES = 1 << 18
# Below this many positions a draw runs on Python ints: numpy's per-call overhead on arrays of a few
# elements cost ~1% of a small model's step. Both paths compute the same bits (tested).
_SCALAR_MAX_COUNT = 64


def _round_keys(seed: int, name: str, epoch: int) -> tuple[int, ...]:
    """The Feistel round keys of one epoch of one dataset."""
    return round_keys(seed, "shuffle", name, epoch)


def sample_indices(
    seed: int, name: str, num_samples: int, start: int, count: int, *, reshuffle: bool = True
) -> np.ndarray:
    """Rows read at cursor positions [start, start + count) of dataset `name` (int64 array). `reshuffle`:
    every epoch in its own order (else every epoch repeats the first one's)."""
    if num_samples < 1:
        raise ValueError(f"dataset {name!r}: cannot draw from an empty split")
    if start < 0 or count < 0:
        raise ValueError(f"cursor positions must be >= 0, got start={start}, count={count}")
    if num_samples == 1:
        return np.zeros(count, dtype=np.int64)
    if num_samples <= CACHED_ORDER_MAX_SAMPLES:
        return _from_cached_orders(seed, name, num_samples, start, count, reshuffle)
    if count <= _SCALAR_MAX_COUNT:
        rows = []
        for position in range(start, start + count):
            epoch, within_epoch = divmod(position, num_samples)
            keys = _round_keys(seed, name, epoch if reshuffle else 0)
            rows.append(permute_int(within_epoch, num_samples, keys))
        return np.array(rows, dtype=np.int64)
    positions = np.arange(start, start + count, dtype=np.int64)
    epochs, within = np.divmod(positions, num_samples)
    indices = np.empty(count, dtype=np.int64)
    # A batch spans at most a couple of epochs unless the split is tiny; each gets its own keys.
    for epoch in np.unique(epochs).tolist():
        in_epoch = epochs == epoch
        keys = _round_keys(seed, name, epoch if reshuffle else 0)
        indices[in_epoch] = permute(within[in_epoch], num_samples, keys)
    return indices


@functools.lru_cache(maxsize=16)
def epoch_order(seed: int, name: str, epoch: int, num_samples: int) -> np.ndarray:
    """The whole permutation of one epoch, as an array (read-only): the rows of positions
    [epoch * n, (epoch + 1) * n) in order. The same values as the Feistel walk, built once."""
    order = permute(np.arange(num_samples, dtype=np.int64), num_samples, _round_keys(seed, name, epoch))
    order.setflags(write=False)
    return order


def _from_cached_orders(seed: int, name: str, num_samples: int, start: int, count: int, reshuffle: bool) -> np.ndarray:
    first_epoch, first_within = divmod(start, num_samples)
    if first_within + count <= num_samples:  # the usual case: one epoch, one slice
        return epoch_order(seed, name, first_epoch if reshuffle else 0, num_samples)[first_within : first_within + count].copy()
    positions = np.arange(start, start + count, dtype=np.int64)
    epochs, within = np.divmod(positions, num_samples)
    indices = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs).tolist():
        in_epoch = epochs == epoch
        indices[in_epoch] = epoch_order(seed, name, epoch if reshuffle else 0, num_samples)[within[in_epoch]]
    return indices


def draw(
    seed: int, dataset: Dataset, split: str, start: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows for cursor positions [start, start + count) of `dataset`'s `split`:
    (tokens LongTensor (count, block_size + 1), loss_mask BoolTensor (count, block_size))."""
    indices = sample_indices(seed, dataset.name, dataset.num_samples(split), start, count, reshuffle=dataset.reshuffle)
    return dataset.gather(split, indices)  # in [0, num_samples) by construction


def epochs_started(
    before: Mapping[str, int], after: Mapping[str, int], datasets: Mapping[str, Dataset]
) -> list[tuple[str, int]]:
    """(dataset, epoch) for every epoch of a train split that the cursor moves from `before` to `after`
    begin (a step can begin several when a split is smaller than the batch), in dataset name order."""
    started = []
    for name in sorted(after):
        old, new = before.get(name, 0), after[name]
        if new > old:
            num_samples = datasets[name].num_samples("train")
            # Positions [old, new) are read; epoch e begins when position e * n is among them (e >= 1).
            first, last = (old + num_samples - 1) // num_samples, (new - 1) // num_samples
            started += [(name, epoch) for epoch in range(max(first, 1), last + 1)]
    return started


def split_rows(mixture: Sequence[Sampling], rows: int) -> list[int]:
    """Divide `rows` across the mixture by rate (largest remainder): each dataset gets
    floor(rate * rows), the leftover rows go to the largest fractional parts, ties to the later
    dataset. Exact rational arithmetic, so the result always sums to `rows` and rates that sum to 1
    only up to float rounding cannot tip a share over or under."""
    if not mixture:
        raise ValueError("split_rows: the mixture is empty")
    if rows < 0:
        raise ValueError(f"split_rows: rows must be >= 0, got {rows}")
    rates = [Fraction(sampling.rate) for sampling in mixture]
    total = sum(rates)
    if total <= 0:
        raise ValueError("split_rows: the rates must sum to a positive number")
    exact = [rate / total * rows for rate in rates]
    shares = [int(share) for share in exact]  # floor: shares are >= 0
    leftover = rows - sum(shares)
    by_remainder = sorted(range(len(mixture)), key=lambda i: (exact[i] - shares[i], i), reverse=True)
    for i in by_remainder[:leftover]:
        shares[i] += 1
    return shares


def assemble_batch(
    seed: int,
    config: Config,
    rows_per_stage: Sequence[int],
    cursors: Mapping[str, int],
    datasets: Mapping[str, Dataset],
) -> tuple[torch.Tensor, torch.Tensor, dict[str, int], dict[str, int]]:
    """One step's training rows: (tokens (B, block_size + 1), loss_mask (B, block_size), cursors
    after the step, rows drawn per dataset), with B = sum(rows_per_stage).

    Stage i contributes rows_per_stage[i] rows split across config.stages[i].datasets by
    `split_rows`; rows are concatenated in (stage, dataset-in-mixture) order. A dataset mixed into
    several stages reads consecutive positions of its single cursor, in stage order. `cursors` is
    not modified; datasets missing from it start at position 0. `datasets` maps names to opened
    datasets, typically a `rewind.engine.data.registry.DatasetRegistry` kept for the whole run."""
    mixtures = [stage.datasets for stage in config.stages]
    if len(rows_per_stage) != len(mixtures):
        raise ValueError(f"rows_per_stage has {len(rows_per_stage)} entries for {len(mixtures)} stages")
    new_cursors = dict(cursors)
    rows_per_dataset: dict[str, int] = {}
    token_parts: list[torch.Tensor] = []
    mask_parts: list[torch.Tensor] = []
    for stage_rows, mixture in zip(rows_per_stage, mixtures, strict=True):
        if stage_rows == 0:
            continue
        for sampling, rows in zip(mixture, split_rows(mixture, stage_rows), strict=True):
            if rows == 0:
                continue
            start = new_cursors.get(sampling.name, 0)
            tokens, loss_mask = draw(seed, datasets[sampling.name], "train", start, rows)
            token_parts.append(tokens)
            mask_parts.append(loss_mask)
            new_cursors[sampling.name] = start + rows
            rows_per_dataset[sampling.name] = rows_per_dataset.get(sampling.name, 0) + rows
    if not token_parts:
        block_size = config.architecture.block_size
        return (
            torch.zeros((0, block_size + 1), dtype=torch.long),
            torch.zeros((0, block_size), dtype=torch.bool),
            new_cursors,
            rows_per_dataset,
        )
    return torch.cat(token_parts), torch.cat(mask_parts), new_cursors, rows_per_dataset
