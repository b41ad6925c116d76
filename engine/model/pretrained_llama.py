"""A transformers Llama directory as a [pretrained] source: config.json (held to LlamaJson's types and
bounds, then compared with the run's model field by field: every difference is one line naming both
sides) and model.safetensors, or the shards model.safetensors.index.json lists; pickled weights are
refused. rewind.engine.model.pretrained.load_pretrained reads a directory through `llama_directory`.
"""

from __future__ import annotations

import os

import msgspec
import torch

from rewind.engine.model import hf_llama, pretrained_files
from rewind.engine.model.model import NORM_EPS
from rewind.engine.model.pretrained_checks import llama_json_problem, llama_shapes, number, shown
from rewind.engine.model.pretrained_files import PretrainedError
from rewind.states.config import Config
from rewind.states.model_size import mlp_width

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
    files = weight_files(directory)
    pretrained_files.check_headers(files, llama_shapes(expected), only_expected=True)
    tensors, identity = pretrained_files.read_weights(files, directory)
    try:
        flat = hf_llama.from_llama(tensors, tied=bool(hf.get("tie_word_embeddings", False)))
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


def _rope_type(hf: dict) -> str:
    for key in ("rope_parameters", "rope_scaling"):
        value = hf.get(key)
        if isinstance(value, dict):
            return str(value.get("rope_type", value.get("type", "default")))
    return "default"


def llama_mismatch(hf: dict, config: Config, where: str) -> str | None:
    """The first way the Llama that config.json `hf` describes differs from the run's model, as one line
    naming both sides, or None when they are the same model."""
    arch = config.architecture
    archs = hf.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    if hf.get("model_type") != hf_llama.MODEL_TYPE and hf_llama.ARCHITECTURE not in archs:
        return (
            f"pretrained: {where} describes model_type {hf.get('model_type')!r} {archs}, not a Llama "
            f"({hf_llama.ARCHITECTURE}), the only transformers model rewind reads"
        )
    if config.objective.kind != "clm":
        return f"pretrained: {where} is a causal LM ({hf_llama.ARCHITECTURE}), objective.kind is {config.objective.kind!r}"
    if arch.norm != "rmsnorm":
        return f"pretrained: {where} is a Llama (RMSNorm), architecture.norm is {arch.norm!r}"
    if arch.mlp != "swiglu":
        return f'pretrained: {where} is a Llama (SwiGLU MLP), architecture.mlp is {arch.mlp!r}; set mlp = "swiglu"'
    unwritten = hf_llama.unexported_options(arch)
    if unwritten:
        return f"pretrained: {where} is read as a plain Llama; {', '.join(unwritten)} not yet (issue 35's next slice)"
    num_heads = hf.get("num_attention_heads")
    head_size = arch.d_model // arch.num_heads
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
            "architecture.num_heads (rewind has a key/value head per query head)",
            arch.num_heads,
        ),
        ("head_dim", hf.get("head_dim", head_size), "d_model / num_heads", head_size),
        ("hidden_act", hf.get("hidden_act", "silu"), "rewind's SwiGLU gate", "silu"),
        ("rms_norm_eps", number(hf.get("rms_norm_eps", 1e-6)), "rewind's norm eps", NORM_EPS),
        ("rope theta", number(rope_theta(hf)), "architecture.rope_base", arch.rope_base),
        ("rope type", _rope_type(hf), "rewind's rope", "default"),
        ("attention_bias", hf.get("attention_bias", False), "rewind's attention (no biases)", False),
        ("mlp_bias", hf.get("mlp_bias", False), "rewind's MLP (no biases)", False),
    ]
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
