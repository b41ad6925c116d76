"""rewind's model <-> transformers' `LlamaForCausalLM`: which configs are a Llama, its config.json, and the
tensors under either side's names.

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

import re

import torch

from rewind.engine.model import INIT_STD, NORM_EPS
from rewind.states.config import ArchitectureSection, Config
from rewind.states.state import ModelLayout

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
_BLOCK = re.compile(r"stacks\.(\d+)\.blocks\.(\d+)\.(.+)")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Within a block: rewind's name -> the Llama layer's (the fused qkv and fc are split, see below).
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.proj.weight": "mlp.down_proj.weight",
}
_SPLITS = {
    "attn.qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "mlp.fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
# Buffers some transformers releases saved with the weights: functions of the config, which is checked.
_DERIVED = (".rotary_emb.inv_freq",)
_OUTSIDE = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "head.weight": "lm_head.weight"}


class NotLlama(Exception):
    """The model is not one that LlamaForCausalLM computes exactly (one line: why, and what to change)."""


def llama_refusal(config: Config) -> str | None:
    """Why a run of `config` cannot be written as a LlamaForCausalLM, or None when it can."""
    arch, objective = config.architecture, config.objective
    if objective.kind != "clm":
        extra = " and a time embedding" if objective.kind == "diffusion" and objective.time == "input" else ""
        return (
            f"objective.kind is {objective.kind!r}: its model attends both ways and adds a mask token{extra}, "
            "which LlamaForCausalLM (causal, next token) has not"
        )
    if arch.norm != "rmsnorm":
        return f"architecture.norm is {arch.norm!r}: Llama normalises with RMSNorm; train with norm = \"rmsnorm\""
    if arch.mlp != "swiglu":
        return f"architecture.mlp is {arch.mlp!r}: Llama's MLP is SwiGLU; train with architecture.mlp = \"swiglu\""
    return None


def check_llama(config: Config) -> None:
    reason = llama_refusal(config)
    if reason is not None:
        raise NotLlama(reason)


def d_ff_of(arch: ArchitectureSection) -> int:
    return arch.d_ff or 4 * arch.d_model


def llama_config(
    arch: ArchitectureSection, *, num_layers: int, eos_token_id: int | None = None
) -> dict[str, object]:
    """config.json of the LlamaForCausalLM a model of `arch` with `num_layers` blocks in all is. The rope
    base is written as transformers 5 spells it (`rope_parameters.rope_theta`) and as earlier releases
    and other readers do (`rope_theta`); 5.x reads either. bos / eos are None unless the tokenizer has an
    end-of-text token: the bytes vocabulary has no special tokens, and Llama's defaults (1, 2) would make
    two ordinary bytes stop generation."""
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.d_model,
        "intermediate_size": d_ff_of(arch),
        "num_hidden_layers": num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_heads,
        "head_dim": arch.d_model // arch.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": arch.block_size,
        "rms_norm_eps": NORM_EPS,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(arch.rope_base)},
        "rope_theta": float(arch.rope_base),
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": INIT_STD,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": "float32",  # transformers 5's key; earlier releases read torch_dtype
        "torch_dtype": "float32",
    }


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


def to_llama(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Flat rewind weights (see `flat_weights`) under LlamaForCausalLM's names, contiguous float32. Any
    name outside the mapping (a time embedding, an adapter) is a NotLlama."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in flat.items():
        tensor = tensor.detach().float()
        if name in _OUTSIDE:
            out[_OUTSIDE[name]] = tensor.contiguous()
            continue
        match = _BLOCK.fullmatch(name)
        if match is None or match[1] != "0":
            raise NotLlama(f"tensor {name} has no place in a LlamaForCausalLM")
        layer, rest = f"model.layers.{match[2]}.", match[3]
        if rest in _BLOCK_NAMES:
            out[layer + _BLOCK_NAMES[rest]] = tensor.contiguous()
        elif rest in _SPLITS:
            parts = _SPLITS[rest]
            for part, piece in zip(parts, tensor.chunk(len(parts), dim=0), strict=True):
                out[layer + part] = piece.contiguous()
        else:
            raise NotLlama(f"tensor {name} has no place in a LlamaForCausalLM")
    return out


def from_llama(tensors: dict[str, torch.Tensor], *, tied: bool = False) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM tensors under flat rewind names (q, k, v and gate, up fused back), float32.
    `tied`: the checkpoint shares embedding and head (tie_word_embeddings), so lm_head may be absent
    and the head starts as a copy of the embedding (rewind's head is its own parameter). Saved rotary
    frequency buffers are skipped; other names outside the mapping and missing pieces are ValueErrors
    naming one."""
    inverse = {v: k for k, v in _OUTSIDE.items()}
    block_inverse = {v: k for k, v in _BLOCK_NAMES.items()}
    split_parts = {part: (fused, i) for fused, parts in _SPLITS.items() for i, part in enumerate(parts)}
    flat: dict[str, torch.Tensor] = {}
    pieces: dict[tuple[str, str], dict[int, torch.Tensor]] = {}  # (block, fused name) -> part index -> tensor
    for name, tensor in tensors.items():
        if name.endswith(_DERIVED):
            continue
        tensor = tensor.detach().float()
        if name in inverse:
            flat[inverse[name]] = tensor
            continue
        match = _LAYER.fullmatch(name)
        if match is None:
            raise ValueError(f"tensor {name} is not one of LlamaForCausalLM's")
        block, rest = f"stacks.0.blocks.{int(match[1])}.", match[2]
        if rest in block_inverse:
            flat[block + block_inverse[rest]] = tensor
        elif rest in split_parts:
            fused, index = split_parts[rest]
            pieces.setdefault((block, fused), {})[index] = tensor
        else:
            raise ValueError(f"tensor {name} is not one of LlamaForCausalLM's")
    for (block, fused), parts in pieces.items():
        wanted = _SPLITS[fused]
        if len(parts) != len(wanted):
            layer = block.removeprefix("stacks.0.blocks.").rstrip(".")
            missing = ", ".join(f"model.layers.{layer}.{wanted[i]}" for i in range(len(wanted)) if i not in parts)
            raise ValueError(f"the checkpoint lacks {missing} (its layer's other projections are there)")
        flat[block + fused] = torch.cat([parts[i] for i in range(len(wanted))], dim=0)
    if "head.weight" not in flat and tied and "embed.weight" in flat:
        flat["head.weight"] = flat["embed.weight"].clone()
    return flat


def merged_weights(
    weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], layout: ModelLayout, arch: ArchitectureSection
) -> dict[str, torch.Tensor]:
    """The float32 base weights of the model a run computes with: every LoRA pair merged as
    W + (alpha / rank) * B @ A (in float32), where W of an NF4 stack is its NF4 weight dequantised (what
    the run's layers compute with; the float weights it was quantised from are not what the adapters
    were trained against). Nothing is ever re-quantised."""
    merged = {name: tensor.float() for name, tensor in weights.items()}
    for spec in layout.stacks:
        if spec.base == "nf4":
            merged.update(_nf4_round_trip(merged, spec.stack, spec.num_blocks, arch))
    scales = {spec.stack: spec.adapter_alpha / spec.adapter_rank for spec in layout.stacks if spec.adapter_rank > 0}
    for name, a in sorted(adapters.items()):
        if ".lora_A." not in name:
            continue
        module = name.removesuffix(".lora_A.weight")
        b = adapters.get(f"{module}.lora_B.weight")
        base = f"{module}.weight"
        stack = int(module.split(".")[1]) if module.startswith("stacks.") else None
        if b is None or base not in merged or stack not in scales:
            raise ValueError(f"adapter {name} has no lora_B, base weight or adapted stack to merge into")
        merged[base] = merged[base] + scales[stack] * (b.float() @ a.float())
    return merged


def _nf4_round_trip(
    weights: dict[str, torch.Tensor], stack_id: int, num_blocks: int, arch: ArchitectureSection
) -> dict[str, torch.Tensor]:
    """The linear weights of NF4 stack `stack_id` as its quantised layers hold them, dequantised to
    float32: quantised exactly as the run quantises (rewind.engine.layout.quantise_stack)."""
    import bitsandbytes as bnb
    from msgspec.structs import replace

    from rewind.engine.layout import LINEAR_LAYERS, quantise_stack
    from rewind.engine.model import Stack

    prefix = f"stacks.{stack_id}."
    with torch.random.fork_rng(devices=[]):
        stack = Stack(replace(arch, activation_checkpointing=False), num_blocks)
    own = {name.removeprefix(prefix): t for name, t in weights.items() if name.startswith(prefix)}
    stack.load_state_dict(own, strict=True)
    quantise_stack(stack)
    out = {}
    for j, block in enumerate(stack.blocks):
        for path in LINEAR_LAYERS:
            owner, _, attribute = path.rpartition(".")
            layer = getattr(getattr(block, owner), attribute)
            values = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
            out[f"{prefix}blocks.{j}.{path}.weight"] = values.float()
    return out
