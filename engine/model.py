"""A GPT-style decoder organised as a rack of stacks of blocks, so it can grow while training.

    GPT.embed -> [GPT.stacks[0].blocks..., GPT.stacks[1].blocks..., ...] -> GPT.norm -> GPT.head

Parameter names are stable (`stacks.0.blocks.1.attn.qkv.weight`), and initialisation is a function
of (seed, parameter name) only, so neither the global RNG nor the order modules were created in can
change the weights. Growth (`append_stack` / `prepend_stack`) adds a stack whose blocks are
initialised from their own derived stream; prepending shifts the indices of the existing stacks.

Dropout never reads the global RNG either: each dropout site draws its mask from a generator keyed
by the `dropout_seed` passed to `forward` plus the site's position, so a training loop that derives
`dropout_seed` from (seed, step, rank, micro-batch) gets the same masks after a resume, and
activation checkpointing recomputes exactly the masks of the first pass. Attention-probability
dropout is left out on purpose: scaled_dot_product_attention would draw it from the global RNG.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from rewind.engine.rng import derive_seed, torch_generator
from rewind.states.config import ArchitectureSection

INIT_STD = 0.02
NORM_EPS = 1e-5
# Output projections that write into the residual stream: scaled down with depth (GPT-2).
_RESIDUAL_PROJECTIONS = ("attn.proj.weight", "mlp.proj.weight")


def _make_norm(arch: ArchitectureSection) -> nn.Module:
    if arch.norm == "layernorm":
        return nn.LayerNorm(arch.d_model, eps=NORM_EPS)
    return nn.RMSNorm(arch.d_model, eps=NORM_EPS)


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


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on the last dim of x (B, H, T, D), halves convention (GPT-NeoX)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, arch: ArchitectureSection):
        super().__init__()
        self.num_heads = arch.num_heads
        self.qkv = nn.Linear(arch.d_model, 3 * arch.d_model, bias=False)
        self.proj = nn.Linear(arch.d_model, arch.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        head_size = width // self.num_heads
        qkv = self.qkv(x).view(batch, length, 3, self.num_heads, head_size).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, H, T, D)
        y = F.scaled_dot_product_attention(rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self, arch: ArchitectureSection):
        super().__init__()
        d_ff = arch.d_ff or 4 * arch.d_model
        self.fc = nn.Linear(arch.d_model, d_ff, bias=False)
        self.proj = nn.Linear(d_ff, arch.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dropout_seed: int | None = None
    ) -> torch.Tensor:
        attended = self.attn(self.attn_norm(x), cos, sin)
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
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dropout_seed: int | None = None
    ) -> torch.Tensor:
        recompute = self.checkpointing and self.training and torch.is_grad_enabled()
        for index, block in enumerate(self.blocks):
            block_seed = None if dropout_seed is None else derive_seed(dropout_seed, index)
            if recompute:
                # No global RNG state to preserve: dropout masks are keyed by block_seed instead.
                x = checkpoint(block, x, cos, sin, block_seed, use_reentrant=False, preserve_rng_state=False)
            else:
                x = block(x, cos, sin, block_seed)
        return x


class GPT(nn.Module):
    def __init__(self, arch: ArchitectureSection, stack_sizes: list[int] | None = None, *, seed: int = 0):
        super().__init__()
        self.arch = arch
        sizes = [arch.num_layers] if stack_sizes is None else list(stack_sizes)
        if not sizes:
            raise ValueError("a model needs at least one stack")
        # torch's default initialisers draw from the global RNG; fork it so that merely building a
        # model leaves the caller's global state untouched. The real init is `init_weights` below.
        with torch.random.fork_rng(devices=[]):
            self.embed = nn.Embedding(arch.vocab_size, arch.d_model)
            self.stacks = nn.ModuleList(Stack(arch, n) for n in sizes)
            self.norm = _make_norm(arch)
            self.head = nn.Linear(arch.d_model, arch.vocab_size, bias=False)
        cos, sin = self._rope_tables(arch)
        # Non-persistent: derived from the config, so they stay out of checkpoints.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)

    @staticmethod
    def _rope_tables(arch: ArchitectureSection) -> tuple[torch.Tensor, torch.Tensor]:
        head_size = arch.d_model // arch.num_heads
        # float64 for the angles: position * frequency loses digits in float32 at long contexts.
        exponents = torch.arange(0, head_size, 2, dtype=torch.float64) / head_size
        inverse_frequencies = 1.0 / (arch.rope_base**exponents)
        angles = torch.outer(torch.arange(arch.block_size, dtype=torch.float64), inverse_frequencies)
        return angles.cos().float(), angles.sin().float()

    @property
    def stack_sizes(self) -> list[int]:
        return [len(stack.blocks) for stack in self.stacks]

    @property
    def num_blocks(self) -> int:
        return sum(self.stack_sizes)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def init_weights(self, seed: int) -> None:
        """Re-initialise every parameter from (seed, "init", parameter name)."""
        _init_parameters(self, seed, ("init",), self.num_blocks)

    def append_stack(self, num_blocks: int, seed: int, *, function_preserving: bool = False) -> Stack:
        """Add a stack after the last one; see `_grow`."""
        return self._grow(num_blocks, seed, "append", function_preserving)

    def prepend_stack(self, num_blocks: int, seed: int, *, function_preserving: bool = False) -> Stack:
        """Add a stack before the first one (existing stacks shift to index + 1); see `_grow`."""
        return self._grow(num_blocks, seed, "prepend", function_preserving)

    def _grow(self, num_blocks: int, seed: int, position: str, function_preserving: bool) -> Stack:
        """New blocks draw from (seed, "grow", number of stacks before, position, name within the stack),
        so successive growths never repeat each other's or the original init. With
        `function_preserving`, the residual projections start at zero: the new blocks are the identity
        and the model's outputs are unchanged at the moment of growth."""
        with torch.random.fork_rng(devices=[]):
            stack = Stack(self.arch, num_blocks)
        growth = ("grow", len(self.stacks), position)
        _init_parameters(stack, seed, growth, self.num_blocks + num_blocks)
        if function_preserving:
            with torch.no_grad():
                for name, parameter in stack.named_parameters():
                    if name.endswith(_RESIDUAL_PROJECTIONS):
                        parameter.zero_()
        reference = self.head.weight
        stack.to(device=reference.device, dtype=reference.dtype)
        stack.train(self.training)
        if position == "append":
            self.stacks.append(stack)
        else:
            self.stacks.insert(0, stack)
        return stack

    def forward(self, idx: torch.Tensor, *, dropout_seed: int | None = None) -> torch.Tensor:
        """Logits (B, T, vocab_size) for token ids (B, T), T <= block_size.

        `dropout_seed` keys the dropout masks of this forward pass (needed only in training mode
        with dropout > 0); derive it from (seed, "dropout", step, rank, micro-batch)."""
        length = idx.shape[1]
        if length > self.arch.block_size:
            raise ValueError(f"sequence length {length} exceeds block_size {self.arch.block_size}")
        use_dropout = self.training and self.arch.dropout > 0
        x = self.embed(idx)
        if use_dropout:
            x = _dropout(x, self.arch.dropout, dropout_seed, "embed")
        cos, sin = self.rope_cos[:length], self.rope_sin[:length]
        for index, stack in enumerate(self.stacks):
            stack_seed = (
                derive_seed(dropout_seed, "stack", index)
                if use_dropout and dropout_seed is not None
                else None
            )
            x = stack(x, cos, sin, stack_seed)
        return self.head(self.norm(x))
