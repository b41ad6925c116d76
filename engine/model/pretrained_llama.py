"""A transformers directory of a Llama-block family (Llama, Mistral, Qwen2, Qwen3:
rewind.engine.model.hf_families) as a [pretrained] source: config.json (held to LlamaJson's types and
bounds, then compared with the run's model field by field: every difference is one line naming both
sides) and model.safetensors, or the shards model.safetensors.index.json lists; pickled weights are
refused. rewind.engine.model.pretrained.load_pretrained reads a directory through `llama_directory`.
"""

from __future__ import annotations

import os

import msgspec
import torch

from rewind.engine.model import hf_families, hf_llama, pretrained_files
from rewind.engine.model.pretrained_checks import (
    causal_shapes,
    llama_json_problem,
    llama_shapes,
    number,
    shown,
)
from rewind.engine.model.pretrained_files import PretrainedError
from rewind.states.config import Config
from rewind.states.model_size import head_width, kv_heads, mlp_width

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def llama_directory(
    directory: str, config: Config, expected: dict[str, tuple[int, ...]]
) -> tuple[dict[str, torch.Tensor], str]:
    config_path = os.path.join(directory, CONFIG_NAME)
    try:
        hf = pretrained_files.read_json(config_path)
    except FileNotFoundError:
        raise PretrainedError(
            f"pretrained: {directory} has no {CONFIG_NAME}: a transformers model directory or a rewind "
            "export (.safetensors) is expected"
        ) from None
    except OSError as exc:
        raise PretrainedError(f"pretrained: cannot read {config_path} ({exc.strerror or exc})") from None
    except msgspec.DecodeError as exc:
        raise PretrainedError(f"pretrained: cannot read {config_path} ({exc})") from None
    if not isinstance(hf, dict):
        raise PretrainedError(f"pretrained: {config_path} is not a JSON object")
    problem = llama_json_problem(hf, config_path) or llama_mismatch(hf, config, config_path)
    if problem:
        raise PretrainedError(problem)
    names = hf_families.family_names(model_type_of(hf), config.architecture)
    files = weight_files(directory)
    shapes = llama_shapes({**expected, **causal_shapes(config.architecture)}, names)
    if names.tied:  # a tied checkpoint may still hold its head (an earlier save): it is the embedding
        shapes[hf_llama.LLAMA.outside["head.weight"]] = expected["head.weight"]
    pretrained_files.check_headers(files, shapes, only_expected=True)
    tensors, identity = pretrained_files.read_weights(files, directory)
    try:
        flat = hf_llama.from_hf(tensors, names, tied=bool(hf.get("tie_word_embeddings", False)))
    except ValueError as exc:
        raise PretrainedError(f"pretrained: {directory}: {exc}") from None
    return flat, identity


def weight_files(directory: str) -> list[str]:
    index_path = os.path.join(directory, INDEX_NAME)
    if os.path.lexists(index_path):  # (read only if it is a regular file: a FIFO is refused, not skipped)
        try:
            weight_map = pretrained_files.read_json(index_path)["weight_map"]  # type: ignore[index]
            shards = sorted(set(weight_map.values()))
        except (OSError, msgspec.DecodeError, KeyError, TypeError, AttributeError) as exc:
            raise PretrainedError(f"pretrained: {index_path} is not a shard index ({exc})") from None
        for shard in shards:
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise PretrainedError(
                    f"pretrained: {index_path} names a shard outside the directory: {shard!r}"
                )
        return [os.path.join(directory, shard) for shard in shards]
    single = os.path.join(directory, WEIGHTS_NAME)
    if os.path.lexists(single):
        return [single]
    pickles = sorted(n for n in os.listdir(directory) if n.endswith((".bin", ".pt", ".pth", ".ckpt")))
    if pickles:
        raise PretrainedError(
            f"pretrained: {directory} has only pickled weights ({pickles[0]}); rewind reads safetensors only "
            "(save the model with safe_serialization)"
        )
    raise PretrainedError(f"pretrained: {directory} has no {WEIGHTS_NAME} (nor {INDEX_NAME})")


def rope_theta(hf: dict) -> float:
    """The rope base of a Llama config.json: `rope_parameters.rope_theta` (transformers 5) or
    `rope_theta` (earlier); 10000 when neither is given (LlamaConfig's default)."""
    parameters = hf.get("rope_parameters")
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        return number(parameters["rope_theta"])  # type: ignore[return-value]
    return number(hf.get("rope_theta", 10000.0))  # type: ignore[return-value]


def _rope(hf: dict) -> dict:
    """The rope scaling config.json gives: its rope_parameters (transformers 5) or rope_scaling; {}: none."""
    for key in ("rope_parameters", "rope_scaling"):
        value = hf.get(key)
        if isinstance(value, dict):
            return value
    return {}


def model_type_of(hf: dict) -> str | None:
    """The family (a key of hf_families.READ) config.json `hf` is, by model_type or else architectures."""
    if hf.get("model_type") in hf_families.READ:
        return hf["model_type"]
    archs = hf.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    if hf.get("model_type") is None:
        return next((kind for kind, name in hf_families.READ.items() if name in archs), None)
    return None


def llama_mismatch(hf: dict, config: Config, where: str) -> str | None:
    """The first way the Llama that config.json `hf` describes differs from the run's model, as one line
    naming both sides, or None when they are the same model."""
    arch = config.architecture
    model_type = model_type_of(hf)
    if model_type is None:
        archs = hf.get("architectures") or []
        read = ", ".join(f"{kind} ({name})" for kind, name in hf_families.READ.items())
        return (
            f"pretrained: {where} describes model_type {shown(hf.get('model_type'))} {shown(archs)}, not a Llama, "
            f"Mistral or Qwen: rewind reads {read}"
        )
    name = hf_families.READ[model_type]
    if config.objective.kind != "clm":
        return f"pretrained: {where} is a causal LM ({name}), objective.kind is {config.objective.kind!r}"
    if arch.norm != "rmsnorm":
        return f"pretrained: {where} is a {name} (RMSNorm), architecture.norm is {arch.norm!r}"
    if arch.mlp != "swiglu":
        return f'pretrained: {where} is a {name} (SwiGLU MLP), architecture.mlp is {arch.mlp!r}; set mlp = "swiglu"'
    family = hf_families.family_mismatch(hf, arch, where)
    if family:
        return family
    num_heads = hf.get("num_attention_heads")
    head_size = head_width(arch)
    kv_field = "architecture.num_kv_heads" if arch.num_kv_heads else "architecture.num_heads (num_kv_heads 0: as many)"
    bias = ("attention_bias", hf.get("attention_bias", False), "rewind's attention (no biases)", False)
    biases = [] if model_type == "qwen2" else [bias]  # (Qwen2's q, k, v biases are family_mismatch's)
    pairs = [
        ("vocab_size", hf.get("vocab_size"), "architecture.vocab_size", arch.vocab_size),
        ("hidden_size", hf.get("hidden_size"), "architecture.d_model", arch.d_model),
        (
            "intermediate_size",
            hf.get("intermediate_size"),
            "architecture.d_ff (0 = 4 * d_model)",
            mlp_width(arch),
        ),
        ("num_hidden_layers", hf.get("num_hidden_layers"), "architecture.num_layers", arch.num_layers),
        ("num_attention_heads", num_heads, "architecture.num_heads", arch.num_heads),
        (
            "num_key_value_heads",
            hf.get("num_key_value_heads", num_heads),
            kv_field,
            kv_heads(arch),
        ),
        (
            "head_dim",
            hf.get("head_dim") or head_size,
            "architecture.head_dim" if arch.head_dim else "d_model / num_heads",
            head_size,
        ),
        ("hidden_act", hf.get("hidden_act", "silu"), "rewind's SwiGLU gate", "silu"),
        ("rms_norm_eps", number(hf.get("rms_norm_eps", 1e-6)), "rewind's norm eps", arch.norm_eps),
        ("rope theta", number(rope_theta(hf)), "architecture.rope_base", arch.rope_base),
        *biases,
        ("mlp_bias", hf.get("mlp_bias", False), "rewind's MLP (no biases)", False),
    ]
    rope = hf_families.rope_mismatch(_rope(hf), arch)
    if rope:
        pairs.append(rope)
    if arch.tie_embeddings:  # (a tied checkpoint goes into an untied head as a copy; not the other way)
        pairs.append(("tie_word_embeddings", hf.get("tie_word_embeddings", False), "architecture.tie_embeddings", True))
    for key, theirs, field, ours in pairs:
        if theirs != ours:
            return f"pretrained: {where} has {key} {shown(theirs)}, {field} is {ours!r}"
    positions = hf.get("max_position_embeddings", arch.block_size)
    if isinstance(positions, int) and positions < arch.block_size:
        return (
            f"pretrained: {where} has max_position_embeddings {positions}, architecture.block_size is "
            f"{arch.block_size} (longer than the model was made for)"
        )
    return None
