"""rewind's model <-> transformers' `LlamaForCausalLM`: its config.json, and the tensors under either side's
names (a `Names` table; rewind.engine.model.hf_models gives the tables of the other block kinds).

A causal rewind model with RMSNorm and a SwiGLU MLP is a Llama block for block (pre-norm, no biases,
untied embedding and head, RoPE in the halves convention, which is what transformers' `rotate_half`
computes, with the same frequencies 1 / base^(2i / head_size)):

    embed.weight                              model.embed_tokens.weight
    <block k>.attn_norm.weight                model.layers.k.input_layernorm.weight
    <block k>.attn.qkv.weight  rows [q; k; v]  model.layers.k.self_attn.{q,k,v}_proj.weight
    <block k>.attn.proj.weight                model.layers.k.self_attn.o_proj.weight
    <block k>.mlp_norm.weight                 model.layers.k.post_attention_layernorm.weight
    <block k>.mlp.fc.weight  rows [gate; up]  model.layers.k.mlp.{gate,up}_proj.weight
    <block k>.mlp.proj.weight                 model.layers.k.mlp.down_proj.weight
    norm.weight                               model.norm.weight
    head.weight                               lm_head.weight

Block k counts from the input side across the stacks in the model's order (a grown model's stack
identities are not positions: `flat_weights` renames them first). The "flat" names are those of a
fresh one-stack model, `stacks.0.blocks.k...`, the form both directions go through.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from rewind.engine.model.model import INIT_STD, NORM_EPS
from rewind.states.config import ArchitectureSection
from rewind.states.model_size import head_width, kv_heads, mlp_width
from rewind.states.state import ModelLayout

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
_BLOCK = re.compile(r"stacks\.(\d+)\.blocks\.(\d+)\.(.+)")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some transformers releases saved with the weights: functions of the config, which is checked.
_DERIVED = (".rotary_emb.inv_freq",)
# rewind's rope_scaling fields of each scaled rope type (transformers names them the same).
ROPE_FIELDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclasses.dataclass(frozen=True)
class Names:
    """A transformers architecture's names for rewind's tensors. `block`: a name within a block -> the
    names within its layer (`model.layers.<k>.`) of the tensor's row chunks, in order (a fused qkv or
    gate-and-up weight is split into equal chunks, or into `rows`' counts where it names the tensor: q, k
    and v of grouped-query heads); `outside`: the tensors outside the blocks; `tied`: the head is the
    embedding (tie_word_embeddings), written once as it."""

    architecture: str
    block: dict[str, tuple[str, ...]]
    outside: dict[str, str]
    rows: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    tied: bool = False


LLAMA = Names(
    ARCHITECTURE,
    block={
        "attn_norm.weight": ("input_layernorm.weight",),
        "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        "attn.proj.weight": ("self_attn.o_proj.weight",),
        "mlp_norm.weight": ("post_attention_layernorm.weight",),
        "mlp.fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
        "mlp.proj.weight": ("mlp.down_proj.weight",),
    },
    outside={"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "head.weight": "lm_head.weight"},
)


class Unmapped(Exception):
    """A tensor has no place in the transformers model (one line: which)."""


def causal_lm_config(
    arch: ArchitectureSection, *, architecture: str, model_type: str, num_layers: int, eos_token_id: int | None
) -> dict[str, object]:
    """The config.json keys every transformers architecture rewind writes shares (a model of `arch` with
    `num_layers` blocks in all; the norm's and the MLP's keys are each architecture's own). The rope base
    is written as transformers 5 spells it (`rope_parameters.rope_theta`) and as earlier releases and
    other readers do (`rope_theta`, and a scaling as `rope_scaling`); 5.x reads either. bos / eos are None unless the tokenizer has an
    end-of-text token: the bytes vocabulary has no special tokens, and defaults such as Llama's (1, 2)
    would make two ordinary bytes stop generation."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.d_model,
        "intermediate_size": mlp_width(arch),
        "num_hidden_layers": num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": kv_heads(arch),
        "head_dim": head_width(arch),
        "max_position_embeddings": arch.block_size,
        "rope_parameters": rope_parameters(arch),
        "rope_theta": float(arch.rope_base),
        **({} if arch.rope_scaling.type == "none" else {"rope_scaling": rope_scaling(arch)}),
        "attention_dropout": 0.0,
        "tie_word_embeddings": arch.tie_embeddings,
        "initializer_range": INIT_STD,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": "float32",  # transformers 5's key; earlier releases read torch_dtype
        "torch_dtype": "float32",
    }


LLAMA_KEYS = {"hidden_act": "silu", "rms_norm_eps": NORM_EPS, "attention_bias": False, "mlp_bias": False}


def llama_config(
    arch: ArchitectureSection, *, num_layers: int, eos_token_id: int | None = None
) -> dict[str, object]:
    """config.json of the LlamaForCausalLM a model of `arch` with `num_layers` blocks in all is."""
    common = causal_lm_config(
        arch, architecture=ARCHITECTURE, model_type=MODEL_TYPE, num_layers=num_layers, eos_token_id=eos_token_id
    )
    return {**common, **LLAMA_KEYS}


def unexported_options(arch: ArchitectureSection) -> list[str]:
    """The architecture options of `arch` that no transformers model rewind writes or reads computes: a
    model with any is not the model they would describe. A Llama block (RMSNorm + SwiGLU) has them all
    (rewind.engine.model.hf_families: Llama, Qwen2 for qkv_bias, Qwen3 for qk_norm) but qkv_bias with
    qk_norm; the other block kinds' families are written with none yet. Tied embeddings are every
    family's tie_word_embeddings."""
    if (arch.norm, arch.mlp) == ("rmsnorm", "swiglu"):
        return ["architecture.qkv_bias with architecture.qk_norm"] if arch.qkv_bias and arch.qk_norm else []
    default = ArchitectureSection()
    unwritten = {
        "num_kv_heads": kv_heads(arch) != arch.num_heads,
        "head_dim": head_width(arch) * arch.num_heads != arch.d_model,
        "norm_eps": arch.norm_eps != default.norm_eps,
        "qkv_bias": arch.qkv_bias,
        "qk_norm": arch.qk_norm,
        "rope_scaling": arch.rope_scaling.type != "none",
    }
    return [f"architecture.{name}" for name, unwritten_here in unwritten.items() if unwritten_here]


def rope_parameters(arch: ArchitectureSection) -> dict[str, object]:
    """transformers' rope_parameters of `arch`'s RoPE: its type ("default" when unscaled), base, and the
    scaled type's fields under the names transformers gives them (the same as rewind's)."""
    scaling = arch.rope_scaling
    kind = "default" if scaling.type == "none" else scaling.type
    return {"rope_type": kind, "rope_theta": float(arch.rope_base), **rope_fields(arch)}


def rope_scaling(arch: ArchitectureSection) -> dict[str, object]:
    """The rope_scaling key of releases before transformers 5 (the scaled type and its fields)."""
    return {"rope_type": arch.rope_scaling.type, **rope_fields(arch)}


def rope_fields(arch: ArchitectureSection) -> dict[str, object]:
    scaling = arch.rope_scaling
    return {name: getattr(scaling, name) for name in ROPE_FIELDS.get(scaling.type, ())}


def block_prefixes(layout: ModelLayout) -> list[str]:
    """`stacks.<id>.blocks.<j>.` of every block, from the input side."""
    return [f"stacks.{spec.stack}.blocks.{j}." for spec in layout.stacks for j in range(spec.num_blocks)]


def flat_weights(weights: dict[str, torch.Tensor], layout: ModelLayout) -> dict[str, torch.Tensor]:
    """Base weights of a model of `layout` (stack identities) under the names of one stack holding every
    block in order (`stacks.0.blocks.<k>.`), float32. A tensor of a stack or block the layout has not is
    a ValueError (weights and layout of different models)."""
    position = {prefix: k for k, prefix in enumerate(block_prefixes(layout))}
    flat = {}
    for name, tensor in weights.items():
        match = _BLOCK.fullmatch(name)
        if match is None:
            flat[name] = tensor.float()
            continue
        prefix = f"stacks.{match[1]}.blocks.{match[2]}."
        if prefix not in position:
            raise ValueError(f"tensor {name} belongs to no block of the layout")
        flat[f"stacks.0.blocks.{position[prefix]}.{match[3]}"] = tensor.float()
    return flat


def to_hf(flat: dict[str, torch.Tensor], names: Names) -> dict[str, torch.Tensor]:
    """Flat rewind weights (see `flat_weights`) under the transformers names `names` gives, contiguous
    float32. Any name outside the mapping (a time embedding, an adapter) is an Unmapped."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in flat.items():
        tensor = tensor.detach().float()
        if names.tied and name == "head.weight":  # the embedding, written once under its own name
            continue
        if name in names.outside:
            out[names.outside[name]] = tensor.contiguous()
            continue
        match = _BLOCK.fullmatch(name)
        parts = names.block.get(match[3]) if match is not None and match[1] == "0" else None
        if parts is None:
            raise Unmapped(f"tensor {name} has no place in a {names.architecture}")
        for part, piece in zip(parts, split_rows(tensor, match[3], names), strict=True):
            out[f"model.layers.{match[2]}.{part}"] = piece.contiguous()
    return out


def split_rows(tensor: torch.Tensor, name: str, names: Names) -> tuple[torch.Tensor, ...]:
    """A fused tensor (`name` within a block) as the row chunks of its parts under `names`."""
    rows = names.rows.get(name)
    return tensor.split(list(rows), dim=0) if rows else tensor.chunk(len(names.block[name]), dim=0)


def to_llama(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Flat rewind weights under LlamaForCausalLM's names (`to_hf` with LLAMA)."""
    return to_hf(flat, LLAMA)


def from_llama(tensors: dict[str, torch.Tensor], *, tied: bool = False) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM tensors under flat rewind names (`from_hf` with LLAMA)."""
    return from_hf(tensors, LLAMA, tied=tied)


def from_hf(tensors: dict[str, torch.Tensor], names: Names, *, tied: bool = False) -> dict[str, torch.Tensor]:
    """Tensors under `names`' transformers names as flat rewind names (q, k, v and gate, up fused back),
    float32. `tied`: the checkpoint shares embedding and head (tie_word_embeddings), so lm_head may be
    absent and the head starts as a copy of the embedding (a run's untied head is its own parameter;
    a tied run's is the embedding). Saved rotary frequency buffers are skipped; other names outside the
    mapping and missing pieces are ValueErrors naming one."""
    inverse = {v: k for k, v in names.outside.items()}
    part_of = {part: (fused, i) for fused, parts in names.block.items() for i, part in enumerate(parts)}
    flat: dict[str, torch.Tensor] = {}
    pieces: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (block, rewind name) -> part index -> tensor
    for name, tensor in tensors.items():
        if name.endswith(_DERIVED) or (names.tied and name == "lm_head.weight"):  # tied: the embedding's copy
            continue
        tensor = tensor.detach().float()
        if name in inverse:
            flat[inverse[name]] = tensor
            continue
        match = _LAYER.fullmatch(name)
        if match is None or match[2] not in part_of:
            raise ValueError(f"tensor {name} is not one of {names.architecture}'s")
        fused, index = part_of[match[2]]
        pieces.setdefault((f"stacks.0.blocks.{int(match[1])}.", fused), {})[index] = tensor
    for (block, fused), parts in pieces.items():
        wanted = names.block[fused]
        if len(parts) != len(wanted):
            layer = block.removeprefix("stacks.0.blocks.").rstrip(".")
            missing = ", ".join(f"model.layers.{layer}.{wanted[i]}" for i in range(len(wanted)) if i not in parts)
            raise ValueError(f"the checkpoint lacks {missing} (its layer's other projections are there)")
        flat[block + fused] = torch.cat([parts[i] for i in range(len(wanted))], dim=0)
    if "head.weight" not in flat and tied and "embed.weight" in flat:
        flat["head.weight"] = flat["embed.weight"].clone()
    return flat
