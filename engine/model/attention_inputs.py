"""What a forward's attention needs beyond a plain causal row: per-document masks and positions for packed
rows, and the keys and values of earlier tokens for incremental decoding (`KVCache`).

Packed rows (`documents`, (B, T) ints, non-decreasing along a row): a position attends only to positions of
its own document (and, causally, not after itself), and its RoPE position counts from its document's first
position, so each document computes what it would alone in a row of its own (up to float rounding; RoPE's
scores depend on distances only, so the restart changes the rotations' angles, not what they compute).

Incremental decoding: row b's tokens sit at slots 0 .. lengths[b] - 1 of every block's key and value
buffers, and a token's RoPE position is its slot, so rows of different lengths are batched without left
padding. A call appends T tokens to every row at its own length: prompts of different lengths are given
right-padded, with the real count per row (`valid`); the padding's keys are written but never attended
(a query sees the slots up to its own) and the row's next tokens overwrite them. The cache is a plain
object the caller holds and passes to every call; the model keeps no decoding state of its own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from rewind.states.config import ArchitectureSection
from rewind.states.model_size import head_width

# Writes a block's new keys and values into the cache; returns every key and value its queries may see.
KeysValues = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def rope_tables(arch: ArchitectureSection) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (block_size, head_dim / 2), float32, of every position's angles by each frequency."""
    # float64 for the angles: position * frequency loses digits in float32 at long contexts.
    angles = torch.outer(torch.arange(arch.block_size, dtype=torch.float64), inverse_frequencies(arch))
    return angles.cos().float(), angles.sin().float()


def inverse_frequencies(arch: ArchitectureSection) -> torch.Tensor:
    """RoPE's (head_dim / 2,) inverse frequencies 1 / base^(2i / head_dim), float64, scaled by
    `architecture.rope_scaling` with transformers' formulas (modeling_rope_utils:
    `_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`), in float64 where it uses float32."""
    head_size = head_width(arch)
    exponents = torch.arange(0, head_size, 2, dtype=torch.float64) / head_size
    inverse = 1.0 / (arch.rope_base**exponents)
    scaling = arch.rope_scaling
    if scaling.type == "linear":
        return inverse / scaling.factor
    if scaling.type == "llama3":
        factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
        old_context = scaling.original_max_position_embeddings
        low_wavelength, high_wavelength = old_context / low, old_context / high
        wavelength = 2 * math.pi / inverse
        # Long wavelengths slowed by factor, short ones kept, those between smoothed from one to the other.
        llama = torch.where(wavelength > low_wavelength, inverse / factor, inverse)
        smooth = (old_context / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * llama / factor + smooth * llama
        medium = ~(wavelength < high_wavelength) * ~(wavelength > low_wavelength)
        return torch.where(medium, smoothed, llama)
    return inverse


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each position's index within its document, (B, T): 0 at every document's first position."""
    length = documents.shape[1]
    index = torch.arange(length, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def document_mask(documents: torch.Tensor, causal: bool, shape: tuple[int, int]) -> torch.Tensor:
    """(B, 1, T, T) bool, True where query t may attend key s: the same document (and s <= t if causal).
    `shape`: the tokens' (B, T), which `documents` must have."""
    if tuple(documents.shape) != tuple(shape):
        raise ValueError(f"documents has shape {tuple(documents.shape)}, the tokens {tuple(shape)}")
    if documents.dtype.is_floating_point or documents.dtype == torch.bool:
        raise ValueError(f"documents must be an integer tensor, got {documents.dtype}")
    if bool((documents[:, 1:] < documents[:, :-1]).any()):
        raise ValueError("documents must be non-decreasing along each row (packed documents are contiguous)")
    same = documents[:, :, None] == documents[:, None, :]
    if causal:
        length = documents.shape[1]
        same = same & torch.ones(length, length, dtype=torch.bool, device=documents.device).tril()
    return same[:, None]


class KVCache:
    """Every block's keys and values for incremental decoding, and how many tokens each row holds.

    Buffers are (B, heads, capacity, head_size) per block, allocated at a block's first write in the dtype
    its stack computes in. `capacity` is at most the model's block_size: a context that outgrows it is
    refused, never cropped."""

    def __init__(self, batch_size: int, capacity: int, device: torch.device | str = "cpu"):
        if batch_size <= 0 or capacity <= 0:
            raise ValueError(f"a cache needs rows and room: batch_size {batch_size}, capacity {capacity}")
        self.capacity = capacity
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.keys: dict[str, torch.Tensor] = {}
        self.values: dict[str, torch.Tensor] = {}

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def check_room(self, num_new: int) -> None:
        longest = int(self.lengths.max()) + num_new
        if longest > self.capacity:
            raise ValueError(f"a cached context of {longest} tokens exceeds the cache's {self.capacity}")

    def positions(self, num_new: int) -> torch.Tensor:
        """(B, T) slots, and so RoPE positions, of T tokens appended to every row."""
        return self.lengths[:, None] + torch.arange(num_new, device=self.lengths.device)

    def mask(self, num_new: int) -> torch.Tensor:
        """(B, 1, T, S) bool: appended token t of row b sees slots 0 .. lengths[b] + t, S the longest row's end."""
        span = int(self.lengths.max()) + num_new
        slots = torch.arange(span, device=self.lengths.device)
        return (slots[None, None, :] <= self.positions(num_new)[:, :, None])[:, None]

    def writers(self, stack_id: int, num_blocks: int, num_new: int) -> list[KeysValues]:
        """What each block of stack `stack_id` calls with its T new (B, H, T, D) keys and values."""
        slots, span = self.positions(num_new), int(self.lengths.max()) + num_new
        return [functools.partial(self._extend, f"{stack_id}.{j}", slots, span) for j in range(num_blocks)]

    def _extend(
        self, name: str, slots: torch.Tensor, span: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if name not in self.keys:
            batch, heads, _, head_size = keys.shape
            shape = (batch, heads, self.capacity, head_size)
            # Zeros, not empty memory: a masked slot's weight is 0, and 0 * NaN would still be NaN.
            self.keys[name] = keys.new_zeros(shape)
            self.values[name] = values.new_zeros(shape)
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None]
        # Advanced indices on dims 0 and 2 put (B, T) first: the (B, T, H, D) view of the new tensors.
        self.keys[name][rows, :, slots] = keys.transpose(1, 2)
        self.values[name][rows, :, slots] = values.transpose(1, 2)
        return self.keys[name][:, :, :span], self.values[name][:, :, :span]

    def advance(self, valid: torch.Tensor) -> None:
        """After a call: row b holds `valid[b]` more tokens (the rest of what it was given was padding)."""
        self.lengths = self.lengths + valid.to(self.lengths)

    def select(self, rows: torch.Tensor) -> KVCache:
        """A cache of only `rows` (indices), e.g. the rows still generating; this one is left as it was."""
        kept = KVCache(len(rows), self.capacity, self.lengths.device)
        kept.lengths = self.lengths.index_select(0, rows)
        kept.keys = {name: tensor.index_select(0, rows) for name, tensor in self.keys.items()}
        kept.values = {name: tensor.index_select(0, rows) for name, tensor in self.values.items()}
        return kept


def check_cached(cache: KVCache, idx: torch.Tensor, block_size: int) -> None:
    """ValueError unless `idx` (B, T) can be appended to `cache` within a model's `block_size`."""
    if cache.capacity > block_size:
        raise ValueError(f"a cache of {cache.capacity} tokens exceeds block_size {block_size}")
    if idx.shape[0] != cache.batch_size:
        raise ValueError(f"{idx.shape[0]} rows of tokens for a cache of {cache.batch_size} rows")
    cache.check_room(idx.shape[1])


def rope_and_mask(
    rope: tuple[torch.Tensor, torch.Tensor],
    shape: tuple[int, int],
    causal: bool,
    documents: torch.Tensor | None,
    cache: KVCache | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """cos, sin and mask for a forward of tokens of `shape` (B, T), from the model's RoPE tables `rope` (cos, sin
    by position): the tables' first rows and no mask (the plain causal row), or a position per row,
    (B, 1, T, D / 2) broadcast over the heads, and the mask of the packed documents or of the cache, as
    what is added to the attention scores (0 where allowed, -inf elsewhere; float32, cast to each block's
    dtype): made once per forward, where a bool mask would be converted again in every block."""
    cos, sin = rope
    length = shape[1]
    if documents is not None:
        mask, positions = document_mask(documents, causal, shape), document_positions(documents)
    elif cache is not None:
        mask, positions = cache.mask(length), cache.positions(length)
    else:
        return cos[:length], sin[:length], None
    additive = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, -math.inf)
    return cos[positions][:, None], sin[positions][:, None], additive
