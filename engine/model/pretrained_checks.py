"""What a [pretrained] source declares about itself, checked before anything is read into memory.

A transformers config.json and a rewind export's metadata are a user's files: their values are decoded
into typed, bounded msgspec structs first (`LlamaJson`; an export's architecture as the
ArchitectureSection it was written from), so a rope_theta "abc", null or 10**400, `architectures` 5 or a
block_size "64" is one line naming the file and the field, never a TypeError deep in a comparison. An
export's layout must hold exactly the blocks its architecture says (num_blocks = 10**9 would build a
billion-entry table). Then each weight file's header, which says every tensor's shape, is held to the
shapes the run's model needs, before a tensor is read: a q/k/v or gate/up of another shape is named
instead of failing in torch.cat. rewind.engine.model.pretrained and pretrained_llama raise PretrainedError with these lines.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec
import torch

from rewind.engine.model.hf_llama import LLAMA, Names, block_prefixes, split_rows
from rewind.states.config import ArchitectureSection
from rewind.states.model_size import head_width, mlp_width, qkv_rows
from rewind.states.state import ModelLayout

# A dimension, a count of layers or heads, a context length: 2**31 - 1 is past any real model's.
Size = Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
Positive = Annotated[float, msgspec.Meta(gt=0.0)]
UNSET = msgspec.UNSET
_FLAT_BLOCK = re.compile(r"stacks\.0\.blocks\.(\d+)\.(.+)")
_DERIVED = (".rotary_emb.inv_freq",)  # buffers some releases saved: skipped when loading (hf_llama)


class RopeParameters(msgspec.Struct, kw_only=True):
    """`rope_parameters` (transformers 5) or `rope_scaling`: what rewind reads of either."""

    rope_theta: Positive = 10000.0
    rope_type: str | msgspec.UnsetType = UNSET
    type: str | msgspec.UnsetType = UNSET
    factor: Positive | msgspec.UnsetType = UNSET
    low_freq_factor: Positive | msgspec.UnsetType = UNSET
    high_freq_factor: Positive | msgspec.UnsetType = UNSET
    original_max_position_embeddings: Size | msgspec.UnsetType = UNSET


class LlamaJson(msgspec.Struct, kw_only=True):
    """The keys of a Llama config.json that rewind compares with the run's config, typed. An absent key
    keeps the meaning rewind.engine.model.pretrained_llama.llama_mismatch gives it; null only where transformers
    writes it."""

    model_type: str | msgspec.UnsetType | None = UNSET
    architectures: list[str] | msgspec.UnsetType | None = UNSET
    vocab_size: Size | msgspec.UnsetType = UNSET
    hidden_size: Size | msgspec.UnsetType = UNSET
    intermediate_size: Size | msgspec.UnsetType = UNSET
    num_hidden_layers: Size | msgspec.UnsetType = UNSET
    num_attention_heads: Size | msgspec.UnsetType = UNSET
    num_key_value_heads: Size | msgspec.UnsetType | None = UNSET
    head_dim: Size | msgspec.UnsetType | None = UNSET
    max_position_embeddings: Size | msgspec.UnsetType = UNSET
    hidden_act: str | msgspec.UnsetType = UNSET
    rms_norm_eps: Positive | msgspec.UnsetType = UNSET
    rope_theta: Positive | msgspec.UnsetType = UNSET
    rope_parameters: RopeParameters | msgspec.UnsetType | None = UNSET
    rope_scaling: RopeParameters | msgspec.UnsetType | None = UNSET
    attention_bias: bool | msgspec.UnsetType = UNSET
    mlp_bias: bool | msgspec.UnsetType = UNSET
    tie_word_embeddings: bool | msgspec.UnsetType = UNSET
    use_sliding_window: bool | msgspec.UnsetType | None = UNSET
    sliding_window: Size | msgspec.UnsetType | None = UNSET


def typed(value: object, kind: type, where: str, field: str = "") -> tuple[object, str]:
    """(value as `kind`, "") or (None, 'pretrained: WHERE: FIELD.PATH: what is wrong')."""
    try:
        return msgspec.convert(value, kind), ""
    except msgspec.ValidationError as exc:
        message, _, path = str(exc).partition(" - at `$")
        path = (field + path.rstrip("`")).lstrip(".") or field or "its contents"
        return None, f"pretrained: {where}: {path}: {message}"


def llama_json_problem(hf: dict, where: str) -> str:
    """Why config.json `hf` (at `where`) holds a value of the wrong type or range ("" if none)."""
    return typed(hf, LlamaJson, where)[1]


def layout_problem(layout: ModelLayout, num_layers: int, where: str) -> str:
    """An export's layout must be the blocks its architecture counts: each stack at least one, in all
    `num_layers` (said before any table of its blocks is built)."""
    for i, stack in enumerate(layout.stacks):
        if stack.num_blocks < 1:
            return f"pretrained: {where}: layout.stacks[{i}].num_blocks: must be >= 1, got {stack.num_blocks}"
    total = sum(stack.num_blocks for stack in layout.stacks)
    if total != num_layers:
        return f"pretrained: {where}: layout: its stacks hold {total:,} blocks, its architecture.num_layers is {num_layers}"
    return ""


def llama_shapes(flat: dict[str, tuple[int, ...]], names: Names = LLAMA) -> dict[str, tuple[int, ...]]:
    """The shapes of a model's tensors (flat rewind names) under `names` (LlamaForCausalLM's by default):
    a fused qkv or gate-and-up weight as its row chunks."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in flat.items():
        if name in names.outside:
            shapes[names.outside[name]] = shape
            continue
        match = _FLAT_BLOCK.fullmatch(name)
        parts = names.block.get(match[2]) if match is not None else None
        if parts:
            pieces = split_rows(torch.empty(shape[0], 0), match[2], names)
            for part, piece in zip(parts, pieces, strict=True):
                shapes[f"model.layers.{match[1]}.{part}"] = (piece.shape[0], *shape[1:])
    return shapes


def causal_shapes(arch: ArchitectureSection) -> dict[str, tuple[int, ...]]:
    """Every tensor of a fresh one-stack causal model of a Llama-block `arch` (its attention options
    included) and its shape, flat names (rewind.engine.model.model's GPT, computed without building it)."""
    d, d_ff, width = arch.d_model, mlp_width(arch), head_width(arch)
    block = {
        "attn_norm.weight": (d,),
        "attn.qkv.weight": (qkv_rows(arch), d),
        "attn.proj.weight": (d, arch.num_heads * width),
        "mlp_norm.weight": (d,),
        "mlp.fc.weight": (2 * d_ff, d),
        "mlp.proj.weight": (d, d_ff),
    }
    if arch.qkv_bias:
        block["attn.qkv.bias"] = (qkv_rows(arch),)
    if arch.qk_norm:
        block.update({"attn.q_norm.weight": (width,), "attn.k_norm.weight": (width,)})
    shapes = {"embed.weight": (arch.vocab_size, d)}
    for k in range(arch.num_layers):
        shapes.update({f"stacks.0.blocks.{k}.{name}": shape for name, shape in block.items()})
    return {**shapes, "norm.weight": (d,), "head.weight": (arch.vocab_size, d)}


def export_shapes(flat: dict[str, tuple[int, ...]], layout: ModelLayout) -> dict[str, tuple[int, ...]]:
    """The shapes of a model's tensors (flat names) under an export's names for `layout` (a checked
    one: as many blocks as the flat model has)."""
    prefixes = block_prefixes(layout)
    return {
        prefixes[int(match[1])] + match[2] if (match := _FLAT_BLOCK.fullmatch(name)) else name: shape
        for name, shape in flat.items()
    }


def header_problem(
    header: dict, expected: dict[str, tuple[int, ...]], where: str, *, only_expected: bool
) -> str:
    """The first tensor a safetensors header declares with another shape than `expected` has for it (or,
    `only_expected`, one `expected` has not), as one line ("" if none)."""
    for name, entry in header.items():
        if name == "__metadata__" or name.endswith(_DERIVED):
            continue
        if name not in expected:
            if only_expected:
                return f"pretrained: {where}: tensor {name[:120]!r} is not one of the config's model's"
            continue
        shape = entry.get("shape")
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            return f"pretrained: {where}: tensor {name} has no shape in its header (not a safetensors file)"
        if tuple(shape) != expected[name]:
            return f"pretrained: {where}: {name} is {shape[:8]} in its header, the config's model's {list(expected[name])}"
    return ""


def number(value: object) -> object:
    """A JSON number as a float (to compare 10000 with 10000.0); anything else, or an integer past a
    float's range, as it is (it then differs from every value a config can hold)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return value
    return value


def shown(value: object) -> str:
    """A value from a user's file in a message: its repr, cut short."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**40 else f"an integer of {len(str(abs(value)))} digits"
    return text if len(text) <= 80 else text[:77] + "..."
