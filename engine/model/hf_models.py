"""rewind's causal model as a transformers model: for each block kind, the transformers architecture that
computes it exactly, its config.json, and its names for rewind's weights and LoRA adapters.

Every rewind block is pre-norm (x + attn(norm(x)), then x + mlp(norm(x))), with bias-free linear layers,
full key/value heads, RoPE over the whole head in the halves convention (transformers' `rotate_half`) with
frequencies 1 / base^(2i / head_size), and the model ends in a final norm and an untied head. Only the
norm (RMSNorm, or LayerNorm with a bias; eps 1e-5) and the MLP (SwiGLU, or fc -> exact, erf GELU -> proj)
vary, and for each of the four a transformers architecture is exactly that block once configured with
no biases, no dropout and full rotary heads:

    norm       mlp     architecture            its MLP                        and
    rmsnorm    swiglu  LlamaForCausalLM         gate_proj, up_proj, down_proj
    rmsnorm    gelu    ArceeForCausalLM         up_proj, down_proj             hidden_act "gelu"
    layernorm  gelu    Starcoder2ForCausalLM    c_fc, c_proj                   use_bias false, no sliding window
    layernorm  swiglu  StableLmForCausalLM      gate_proj, up_proj, down_proj  partial_rotary_factor 1

All four name the rest as Llama does (rewind.engine.model.hf_llama), a LayerNorm's bias beside its weight.
The attention options of today's open models (grouped-query heads, head_dim, norm_eps, q/k/v biases, q/k
norms, tied embeddings, rope scaling) are written for the Llama block, as Llama, Qwen2 (qkv_bias) or Qwen3
(qk_norm): rewind.engine.model.hf_families; the other three are written with none of them yet.
A masked objective (mlm, diffusion) attends both ways and adds a mask token: no causal LM computes it.
"""

from __future__ import annotations

import dataclasses

import torch

from rewind.engine.model import hf_families, hf_llama
from rewind.engine.model.hf_llama import LLAMA, Names
from rewind.engine.model.model import NORM_EPS
from rewind.states.config import ArchitectureSection, Config
from rewind.states.state import ModelLayout


@dataclasses.dataclass(frozen=True)
class Family:
    """A transformers architecture: its names for rewind's tensors, model_type and its own config keys."""

    names: Names
    model_type: str
    keys: dict[str, object]


class NotExpressible(Exception):
    """No transformers model computes the run's model (one line: why)."""


def _names(architecture: str, *, mlp: dict[str, tuple[str, ...]], norm_bias: bool) -> Names:
    block = {**LLAMA.block, **mlp}
    outside = dict(LLAMA.outside)
    if norm_bias:
        block.update({"attn_norm.bias": ("input_layernorm.bias",), "mlp_norm.bias": ("post_attention_layernorm.bias",)})
        outside["norm.bias"] = "model.norm.bias"
    return Names(architecture, block, outside)


_PLAIN_MLP = {"mlp.fc.weight": ("mlp.up_proj.weight",)}
_NO_BIAS = {"attention_bias": False, "mlp_bias": False}
FAMILIES: dict[tuple[str, str], Family] = {
    ("rmsnorm", "swiglu"): Family(LLAMA, hf_llama.MODEL_TYPE, hf_llama.LLAMA_KEYS),
    ("rmsnorm", "gelu"): Family(
        _names("ArceeForCausalLM", mlp=_PLAIN_MLP, norm_bias=False),
        "arcee",
        {"hidden_act": "gelu", "rms_norm_eps": NORM_EPS, **_NO_BIAS},
    ),
    ("layernorm", "gelu"): Family(
        _names(
            "Starcoder2ForCausalLM",
            mlp={"mlp.fc.weight": ("mlp.c_fc.weight",), "mlp.proj.weight": ("mlp.c_proj.weight",)},
            norm_bias=True,
        ),
        "starcoder2",
        {
            "hidden_act": "gelu",
            "norm_epsilon": NORM_EPS,
            "use_bias": False,
            "sliding_window": None,
            "residual_dropout": 0.0,
            "embedding_dropout": 0.0,
        },
    ),
    ("layernorm", "swiglu"): Family(
        _names("StableLmForCausalLM", mlp={}, norm_bias=True),
        "stablelm",
        {
            "hidden_act": "silu",
            "layer_norm_eps": NORM_EPS,
            "use_qkv_bias": False,
            "qk_layernorm": False,
            "use_parallel_residual": False,
            "hidden_dropout": 0.0,
            # transformers 5 reads it from rope_parameters (see hf_config), earlier releases from here
            "partial_rotary_factor": 1.0,
        },
    ),
}


def family_of(config: Config) -> Family:
    """The transformers architecture that computes a run of `config` (a Llama block's family follows its
    attention options: rewind.engine.model.hf_families); NotExpressible when none does."""
    objective = config.objective
    if objective.kind != "clm":
        extra = " and a time embedding" if objective.kind == "diffusion" and objective.time == "input" else ""
        raise NotExpressible(
            f"objective.kind is {objective.kind!r}: its model attends both ways and adds a mask token{extra}, "
            "which no transformers causal LM has"
        )
    arch = config.architecture
    unwritten = hf_llama.unexported_options(arch)
    if unwritten:
        raise NotExpressible(f"{', '.join(unwritten)}: no transformers model rewind writes computes it")
    if (arch.norm, arch.mlp) == ("rmsnorm", "swiglu"):
        model_type = hf_families.written_model_type(arch)
        names = hf_families.family_names(model_type, arch)
        return Family(names, model_type, hf_families.family_keys(model_type, arch))
    family = FAMILIES[(arch.norm, arch.mlp)]
    if not arch.tie_embeddings:
        return family
    outside = {k: v for k, v in family.names.outside.items() if k != "head.weight"}
    return dataclasses.replace(family, names=dataclasses.replace(family.names, outside=outside, tied=True))


def hf_config(
    family: Family, arch: ArchitectureSection, *, num_layers: int, eos_token_id: int | None = None
) -> dict[str, object]:
    """config.json of `family`'s model of `arch` with `num_layers` blocks in all."""
    config = hf_llama.causal_lm_config(
        arch,
        architecture=family.names.architecture,
        model_type=family.model_type,
        num_layers=num_layers,
        eos_token_id=eos_token_id,
    )
    config.update(family.keys)
    if "partial_rotary_factor" in family.keys:
        config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": family.keys["partial_rotary_factor"]}  # type: ignore[dict-item]
    return config


def hf_weights(weights: dict[str, torch.Tensor], layout: ModelLayout, family: Family) -> dict[str, torch.Tensor]:
    """Base weights of a model of `layout` under `family`'s names, float32 (hf_llama.Unmapped for a
    tensor without a place there, ValueError for one outside the layout)."""
    return hf_llama.to_hf(hf_llama.flat_weights(weights, layout), family.names)


def hf_adapters(
    adapters: dict[str, torch.Tensor], layout: ModelLayout, family: Family
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, float]]]:
    """LoRA pairs of a model of `layout` (unwrapped names, `<module>.lora_A.weight`) as adapters of
    `family`'s modules, and each module's (rank, alpha). A fused layer's pair becomes one pair per part:
    lora_A copied, lora_B split into the parts' rows, so each part's B @ A is its rows of the fused
    B @ A. Names and stacks outside the mapping are ValueErrors naming one."""
    position = {prefix: k for k, prefix in enumerate(hf_llama.block_prefixes(layout))}
    specs = {spec.stack: spec for spec in layout.stacks}
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, tuple[int, float]] = {}
    for name, tensor in adapters.items():
        module, _, kind = name.partition(".lora_")
        stack, _, within = module.partition(".blocks.")
        block, _, layer = within.partition(".")
        prefix = f"{stack}.blocks.{block}."
        parts = family.names.block.get(f"{layer}.weight")
        if kind not in ("A.weight", "B.weight") or prefix not in position or parts is None:
            raise ValueError(f"adapter {name} has no place in a {family.names.architecture}")
        spec = specs[int(stack.removeprefix("stacks."))]
        pieces = [tensor] * len(parts) if kind == "A.weight" else hf_llama.split_rows(tensor, f"{layer}.weight", family.names)
        for part, piece in zip(parts, pieces, strict=True):
            target = f"model.layers.{position[prefix]}.{part.removesuffix('.weight')}"
            tensors[f"{target}.lora_{kind}"] = piece.clone()  # copies: safetensors refuses shared memory
            modules[target] = (spec.adapter_rank, spec.adapter_alpha)
    return tensors, modules


def computed_weights(
    weights: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], layout: ModelLayout, arch: ArchitectureSection
) -> dict[str, torch.Tensor]:
    """The float32 base weights the run's model computes with, `adapters` merged: W + (alpha / rank) * B @ A
    (in float32) for every LoRA pair given (none: the unmerged base), where W of an NF4 stack is its NF4
    weight dequantised (what the run's layers compute with; the float weights it was quantised from are
    not what the adapters were trained against). Nothing is ever re-quantised."""
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
    float32: quantised exactly as the run quantises (rewind.engine.model.layout.quantise_stack)."""
    import bitsandbytes as bnb
    from msgspec.structs import replace

    from rewind.engine.model.layout import LINEAR_LAYERS, quantise_stack
    from rewind.engine.model.model import Stack

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
