"""A GPT-style decoder organised as a rack of stacks of blocks, so it can grow while training.

    GPT.embed -> [GPT.stacks[0].blocks..., GPT.stacks[1].blocks..., ...] -> GPT.norm -> GPT.head

Parameter names are stable (`stacks.0.blocks.1.attn.qkv.weight`), and initialisation is a function
of (seed, parameter name) only, so neither the global RNG nor the order modules were created in can
change the weights. Stacks are named by a stable identity, not their position: growth adds a stack
whose blocks are initialised from their own derived stream (`init_new_stack`; rewind.engine.run.growth builds
the grown model), and prepending renames nothing.

Dropout never reads the global RNG either: each dropout site draws its mask from a generator keyed
by the `dropout_seed` passed to `forward` plus the site's position, so a training loop that derives
`dropout_seed` from (seed, step, rank, micro-batch) gets the same masks after a resume, and
activation checkpointing recomputes exactly the masks of the first pass. Attention-probability
dropout is left out on purpose: scaled_dot_product_attention would draw it from the global RNG.

Two optional inputs of `forward` change what attention sees (rewind.engine.model.attention_inputs): `documents`, for rows
packed with several documents (each attends within itself, positions restarting at 0), and `cache`, for
incremental decoding (a prefill, then a token per row per call, each row at its own length). Without
them a forward computes exactly what it always did.

A block's attention, with the options of today's open models (grouped-query attention, a head width of its
own, q/k/v biases, q/k norms), is rewind.engine.model.attention's; RoPE's tables, scaled or not, are
rewind.engine.model.attention_inputs'. `tie_embeddings` makes the head's weight the embedding's parameter.
With every option at its default the model is the one above, parameter for parameter and bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rewind.engine.model.attention import Attention
from rewind.engine.model.attention import rotate as rotate  # (re-exported: a block's RoPE)
from rewind.engine.model.attention_inputs import KeysValues, KVCache, check_cached, rope_and_mask, rope_tables
from rewind.engine.model.rng import derive_seed, torch_generator
from rewind.states.config import ArchitectureSection
from rewind.states.model_size import mlp_width

# What the fused loss computes in place of the head: f(final hidden states, head weight).
HeadFunction = Callable[[torch.Tensor, torch.Tensor], Any]

INIT_STD = 0.02
NORM_EPS = ArchitectureSection().norm_eps  # architecture.norm_eps's default, which exports compare with
# Output projections that write into the residual stream: scaled down with depth (GPT-2).
_RESIDUAL_PROJECTIONS = ("attn.proj.weight", "mlp.proj.weight")


def _make_norm(arch: ArchitectureSection) -> nn.Module:
    if arch.norm == "layernorm":
        return nn.LayerNorm(arch.d_model, eps=arch.norm_eps)
    return nn.RMSNorm(arch.d_model, eps=arch.norm_eps)


def _dropout(x: torch.Tensor, p: float, seed: int | None, site: str) -> torch.Tensor:
    """Inverted dropout with a mask drawn from the stream (seed, site), not from the global RNG."""
    if seed is None:
        raise ValueError("dropout > 0 in training mode needs forward(..., dropout_seed=...)")
    generator = torch_generator(seed, site, device=x.device)
    keep = torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) >= p
    return x * keep / (1.0 - p)


def _init_parameters(module: nn.Module, seed: int, purpose: tuple[str | int, ...], depth: int) -> None:
    """Every parameter of `module` from the stream (seed, *purpose, its name within `module`):
    normal(0, 0.02) weights, residual projections scaled by 1/sqrt(2 * depth), norms one, biases zero."""
    norm_parameters = {
        f"{name}.{pname}" if name else pname
        for name, sub in module.named_modules()
        if isinstance(sub, (nn.LayerNorm, nn.RMSNorm))
        for pname, _ in sub.named_parameters(recurse=False)
    }
    residual_std = INIT_STD / math.sqrt(2 * depth)
    with torch.no_grad():
        for name, parameter in module.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
            elif name in norm_parameters:
                parameter.fill_(1.0)
            else:
                std = residual_std if name.endswith(_RESIDUAL_PROJECTIONS) else INIT_STD
                # Drawn in float32 on CPU, then copied: the same weights on any device or dtype.
                generator = torch_generator(seed, *purpose, name)
                values = torch.empty(parameter.shape, dtype=torch.float32)
                parameter.copy_(values.normal_(0.0, std, generator=generator))


class MLP(nn.Module):
    """gelu: proj(gelu(fc(x))). swiglu: one `fc` of 2 * d_ff rows, the gate's first and the up
    projection's next, so proj(silu(gate) * up) is Llama's MLP under the parameter names gelu has
    (LoRA targets, growth's zeroed `mlp.proj` and init by name apply unchanged)."""

    def __init__(self, arch: ArchitectureSection):
        super().__init__()
        d_ff = mlp_width(arch)
        self.gated = arch.mlp == "swiglu"
        self.fc = nn.Linear(arch.d_model, 2 * d_ff if self.gated else d_ff, bias=False)
        self.proj = nn.Linear(d_ff, arch.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.fc(x).chunk(2, dim=-1)
            return self.proj(F.silu(gate) * up)
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, arch: ArchitectureSection):
        super().__init__()
        self.dropout = arch.dropout
        self.attn_norm = _make_norm(arch)
        self.attn = Attention(arch)
        self.mlp_norm = _make_norm(arch)
        self.mlp = MLP(arch)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        dropout_seed: int | None = None,
        causal: bool = True,
        mask: torch.Tensor | None = None,
        kv: KeysValues | None = None,
    ) -> torch.Tensor:
        attended = self.attn(self.attn_norm(x), cos, sin, causal, mask, kv)
        if self.training and self.dropout > 0:
            attended = _dropout(attended, self.dropout, dropout_seed, "attn")
        x = x + attended
        transformed = self.mlp(self.mlp_norm(x))
        if self.training and self.dropout > 0:
            transformed = _dropout(transformed, self.dropout, dropout_seed, "mlp")
        return x + transformed


class Stack(nn.Module):
    """A run of consecutive blocks: the unit the model grows by."""

    def __init__(self, arch: ArchitectureSection, num_blocks: int):
        super().__init__()
        if num_blocks <= 0:
            raise ValueError(f"a stack needs at least one block, got {num_blocks}")
        self.checkpointing = arch.activation_checkpointing
        self.blocks = nn.ModuleList(Block(arch) for _ in range(num_blocks))

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        dropout_seed: int | None = None,
        causal: bool = True,
        mask: torch.Tensor | None = None,
        kvs: list[KeysValues] | None = None,
    ) -> torch.Tensor:
        """`mask` as Attention's; `kvs`: each block's cache writer (incremental decoding)."""
        recompute = self.checkpointing and self.training and torch.is_grad_enabled()
        for index, block in enumerate(self.blocks):
            block_seed = None if dropout_seed is None else derive_seed(dropout_seed, index)
            kv = None if kvs is None else kvs[index]
            if recompute:
                # No global RNG state to preserve: dropout masks are keyed by block_seed instead.
                arguments = (x, cos, sin, block_seed, causal, mask, kv)
                x = checkpoint(block, *arguments, use_reentrant=False, preserve_rng_state=False)
            else:
                x = block(x, cos, sin, block_seed, causal, mask, kv)
        return x


class GPT(nn.Module):
    """Embedding, stacks of blocks in `order` (input side first), final norm, head.

    Stacks live in `stacks` under their identity (`stacks.<id>.blocks.<j>...`), not their position, so
    a stack prepended later (id 1 before id 0) renames nothing. A model of one stack has the names a
    one-stack ModuleList had (`stacks.0.blocks...`), which older checkpoints use."""

    def __init__(
        self,
        arch: ArchitectureSection,
        stack_sizes: list[int] | None = None,
        *,
        seed: int = 0,
        stack_ids: list[int] | None = None,
        vocab_size: int | None = None,
        num_time_levels: int = 0,
    ):
        """`stack_sizes` in order from the input side, with identities `stack_ids` (default 0, 1, ...).
        `vocab_size` (default the architecture's): rows of the embedding and outputs of the head, one
        more than the data's when an objective adds a mask token. `num_time_levels`: a learned time
        embedding added to the token embedding (masked diffusion with time as input)."""
        super().__init__()
        self.arch = arch
        sizes = [arch.num_layers] if stack_sizes is None else list(stack_sizes)
        if not sizes:
            raise ValueError("a model needs at least one stack")
        ids = list(range(len(sizes))) if stack_ids is None else list(stack_ids)
        if len(ids) != len(sizes) or len(set(ids)) != len(ids):
            raise ValueError(f"stack ids {ids} do not name {len(sizes)} distinct stacks")
        vocab = arch.vocab_size if vocab_size is None else vocab_size
        # torch's default initialisers draw from the global RNG; fork it so that merely building a
        # model leaves the caller's global state untouched. The real init is `init_weights` below.
        with torch.random.fork_rng(devices=[]):
            self.embed = nn.Embedding(vocab, arch.d_model)
            self.time_embed = nn.Embedding(num_time_levels, arch.d_model) if num_time_levels else None
            # Created in id order, so parameter order (and so the optimizer's) follows identities too.
            self.stacks = nn.ModuleDict({str(i): Stack(arch, n) for i, n in sorted(zip(ids, sizes, strict=True))})
            self.norm = _make_norm(arch)
            self.head = nn.Linear(arch.d_model, vocab, bias=False)
            if arch.tie_embeddings:  # one parameter, named embed.weight (named_parameters lists it once)
                self.head.weight = self.embed.weight
        self.order: list[int] = ids
        self.causal = True  # the objective's attention (masked objectives attend both ways)
        cos, sin = self._rope_tables(arch)
        # Non-persistent: derived from the config, so they stay out of checkpoints.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)

    @staticmethod
    def _rope_tables(arch: ArchitectureSection) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(arch)

    def stack(self, stack_id: int) -> Stack:
        return self.stacks[str(stack_id)]  # type: ignore[return-value]

    def ordered_stacks(self) -> list[tuple[int, Stack]]:
        """(id, stack) from the input side to the output side."""
        return [(i, self.stack(i)) for i in self.order]

    @property
    def stack_sizes(self) -> list[int]:
        return [len(stack.blocks) for _, stack in self.ordered_stacks()]

    @property
    def num_blocks(self) -> int:
        return sum(self.stack_sizes)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def init_weights(self, seed: int) -> None:
        """Re-initialise every parameter from (seed, "init", parameter name)."""
        _init_parameters(self, seed, ("init",), self.num_blocks)

    def embed_tokens(self, idx: torch.Tensor, levels: torch.Tensor | None, dropout_seed: int | None) -> torch.Tensor:
        x = self.embed(idx)
        if self.time_embed is not None:
            if levels is None:
                raise ValueError("this model embeds a time level per row: forward(..., levels=...)")
            x = x + self.time_embed(levels)[:, None, :]
        if self.training and self.arch.dropout > 0:
            x = _dropout(x, self.arch.dropout, dropout_seed, "embed")
        return x

    def run_stacks(
        self,
        x: torch.Tensor,
        positions: range,
        dropout_seed: int | None,
        documents: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """The stacks at `positions` (in order) on the residual stream x. Each stack computes in its own
        dtype (a bf16 stack among fp32 ones) and hands the stream on in the dtype it came in.
        `documents` / `cache`: see `forward`."""
        length, stream_dtype = x.shape[1], x.dtype
        cos, sin, mask = rope_and_mask((self.rope_cos, self.rope_sin), x.shape[:2], self.causal, documents, cache)
        use_dropout = self.training and self.arch.dropout > 0 and dropout_seed is not None
        for position in positions:
            stack_id = self.order[position]
            stack = self.stack(stack_id)
            # Keyed by identity: a stack keeps its dropout stream when another is prepended.
            stack_seed = derive_seed(dropout_seed, "stack", stack_id) if use_dropout else None
            dtype = stack_dtype(stack)
            # The RoPE tables too: float32 tables would promote a bf16 stack's queries and keys to float32.
            kvs = None if cache is None else cache.writers(stack_id, len(stack.blocks), length)
            x = stack(x.to(dtype), cos.to(dtype), sin.to(dtype), stack_seed, self.causal, mask, kvs)
            x = x.to(stream_dtype)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))

    def forward(
        self,
        idx: torch.Tensor,
        *,
        dropout_seed: int | None = None,
        levels: torch.Tensor | None = None,
        portion: str = "whole",
        head_fn: HeadFunction | None = None,
        documents: torch.Tensor | None = None,
        cache: KVCache | None = None,
        valid: torch.Tensor | None = None,
    ) -> Any:
        """Logits (B, T, vocab) for token ids (B, T), T <= block_size.

        `dropout_seed` keys the dropout masks of this forward pass (needed only in training mode
        with dropout > 0); derive it from (seed, "dropout", step, micro-batch). `levels`: each row's
        time level, for a model with a time embedding. `portion`: "whole"; "trunk" (the residual
        stream entering the last stack: `trunk_output`); "from_trunk" (idx is that stream: only the
        last stack, the final norm and the head run). `head_fn(final hidden states, head weight)`, when
        given, is computed in place of the head and returned (the fused loss owns the head matmul and
        never holds every position's logits). Every portion is a call of the module itself, so FSDP2
        gathers the root's parameters (embedding, norm, head) for it.

        `documents` (B, T) ints, non-decreasing along a row: the document of each position of a packed row;
        attention stays within a document (causal or not, as the objective's) and RoPE positions restart
        at 0 at each document's first position. `cache` (rewind.engine.model.attention_inputs.KVCache): idx (B, T) are
        appended to each row of the cache at its own length (a prefill, then a token per call), attend to
        what the cache holds, and the cache is advanced by `valid` (B,) tokens per row (default T; the rest
        right padding); only the whole model, and not in training with dropout."""
        if cache is not None:
            if portion != "whole" or documents is not None or (self.training and self.arch.dropout > 0):
                raise ValueError("a cache serves whole-model forwards of unpacked rows, without dropout")
            check_cached(cache, idx, self.arch.block_size)
        if portion == "from_trunk":
            x = self.run_stacks(idx, range(len(self.order) - 1, len(self.order)), dropout_seed, documents)
        else:
            length = idx.shape[1]
            if length > self.arch.block_size:
                raise ValueError(f"sequence length {length} exceeds block_size {self.arch.block_size}")
            x = self.embed_tokens(idx, levels if portion == "whole" else None, dropout_seed)
            if portion == "trunk":
                return self.run_stacks(x, range(len(self.order) - 1), dropout_seed, documents)
            x = self.run_stacks(x, range(len(self.order)), dropout_seed, documents, cache)
        if cache is not None:
            cache.advance(torch.full_like(cache.lengths, idx.shape[1]) if valid is None else valid)
        if head_fn is not None:
            return head_fn(self.norm(x), self.head.weight)
        return self.logits(x)

    def forward_from_trunk(self, hidden: torch.Tensor, *, dropout_seed: int | None = None, head_fn: HeadFunction | None = None) -> Any:
        """Logits from the trunk's output `hidden` (what `trunk_output` gives): only the last stack, the
        final norm and the head run. With a frozen trunk, this and `forward` compute the same bits."""
        return self(hidden, dropout_seed=dropout_seed, portion="from_trunk", head_fn=head_fn)

    def trunk_output(self, idx: torch.Tensor, *, dropout_seed: int | None = None) -> torch.Tensor:
        """The residual stream entering the last stack: the embedding and every stack before it."""
        return self(idx, dropout_seed=dropout_seed, portion="trunk")


def stack_dtype(stack: nn.Module) -> torch.dtype:
    """The dtype a stack computes in: that of its norms (never quantised, cast with the stack)."""
    return stack.blocks[0].attn_norm.weight.dtype  # type: ignore[union-attr, index]


def init_new_stack(stack: Stack, seed: int, stack_id: int, depth: int, *, function_preserving: bool = False) -> None:
    """A new stack's blocks from the stream (seed, "grow", stack id, name within the stack), so growths
    never repeat each other's draws or the original init. `function_preserving` zeroes the residual
    output projections: every new block is then the identity and the model's outputs are unchanged."""
    _init_parameters(stack, seed, ("grow", stack_id), depth)
    if function_preserving:
        with torch.no_grad():
            for name, parameter in stack.named_parameters():
                if name.endswith(_RESIDUAL_PROJECTIONS):
                    parameter.zero_()
