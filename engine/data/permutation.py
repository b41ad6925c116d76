"""Keyed pseudo-random permutations of [0, n) in O(1) time and memory per position.

A 6-round Feistel network on the smallest even number of bits that covers n, with cycle-walking to stay
inside [0, n): no index array, so it serves a split of 2**31 rows as cheaply as one of ten. Used for the
order a cursor reads a dataset in (rewind.engine.data.cursors, keyed by (seed, dataset, epoch)) and for which
rows of a file form its validation split (rewind.engine.data.tokens, keyed by a fixed seed).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from rewind.engine.model.rng import derive_seed

NUM_FEISTEL_ROUNDS = 6  # >= 4 rounds make a Feistel network a strong pseudo-random permutation
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 finaliser constants
_MIX_2 = np.uint64(0x94D049BB133111EB)
_MASK_64 = (1 << 64) - 1


@functools.lru_cache(maxsize=1024)
def round_keys(seed: int, *purpose: str | int) -> tuple[int, ...]:
    """The Feistel round keys of the permutation named (seed, *purpose): a pure function, so cached."""
    permutation_seed = derive_seed(seed, *purpose)
    return tuple(derive_seed(permutation_seed, "round", r) for r in range(NUM_FEISTEL_ROUNDS))


def _round_function_int(half: int, key: int) -> int:
    """`_round_function` on one Python int (masking to 64 bits where uint64 arithmetic wraps)."""
    z = half ^ key
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return z ^ (z >> 31)


def permute_int(within: int, num_samples: int, keys: tuple[int, ...]) -> int:
    """`permute` for one position."""
    half_bits = max(1, ((num_samples - 1).bit_length() + 1) // 2)
    mask = (1 << half_bits) - 1
    value = within
    while True:
        left, right = value >> half_bits, value & mask
        for key in keys:
            left, right = right, left ^ (_round_function_int(right, key) & mask)
        value = (left << half_bits) | right
        if value < num_samples:
            return value


def _round_function(half: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finaliser of (half ^ key): every input bit flips about half of the output bits.
    uint64 array arithmetic wraps around modulo 2**64, which is what the hash wants."""
    z = half ^ key
    z = (z ^ (z >> np.uint64(30))) * _MIX_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


def _feistel(values: np.ndarray, half_bits: int, keys: Sequence[int]) -> np.ndarray:
    """A bijection on [0, 4**half_bits): each round swaps the halves and mixes one into the other."""
    shift = np.uint64(half_bits)
    mask = np.uint64((1 << half_bits) - 1)
    left, right = values >> shift, values & mask
    for key in keys:
        left, right = right, left ^ (_round_function(right, np.uint64(key)) & mask)
    return (left << shift) | right


def permute(within: np.ndarray, num_samples: int, keys: Sequence[int]) -> np.ndarray:
    # Half width so that 4**half_bits >= num_samples: the domain is at most 4x larger than needed,
    # so cycle-walking takes fewer than 4 Feistel passes on average.
    half_bits = max(1, ((num_samples - 1).bit_length() + 1) // 2)
    permuted = _feistel(within.astype(np.uint64), half_bits, keys)
    outside = permuted >= num_samples
    while outside.any():
        # Cycle-walking: re-encrypt until the value lands in [0, n). Since the Feistel network is a
        # bijection on the larger domain, following its cycle from a point of [0, n) yields a
        # bijection on [0, n).
        permuted[outside] = _feistel(permuted[outside], half_bits, keys)
        outside = permuted >= num_samples
    return permuted.astype(np.int64)
