"""Weights a run starts from instead of random ones (`[pretrained] path`): a transformers Llama directory
(config.json + model.safetensors, or shards listed by model.safetensors.index.json) or a file written by
`rewind export RUN --to FILE.safetensors` (its metadata carries the architecture and the layout).

`load_pretrained` checks the source against the run's config (every architecture mismatch is one
line naming both sides: a run never starts from weights that do not mean what its config says) and
returns the tensors under the names of a fresh one-stack model of that config (`stacks.0.blocks.<k>`,
a grown export's stacks renamed in their order), in float32, and the weights' identity: the sha256 of
the weight file's bytes (of the shards' bytes in the order of their names, for a sharded directory),
the bytes the tensors were read from, so what is on record is what was loaded. `apply_pretrained` puts
them into a freshly built plain model. Only safetensors and JSON are read, never a pickle.

What a user points [pretrained] at is untrusted: every file is read only if it is a regular file (a FIFO
would block, /dev/zero never ends), JSON up to MAX_JSON_BYTES and through msgspec (nesting too deep is
malformed, not a RecursionError), and a weight file only once its header (at most MAX_HEADER_BYTES,
safetensors' own limit) says where every tensor lies and the file's size is exactly what that header
describes, so nothing is allocated for a size the file does not have. What the files declare (config.json's
values, an export's metadata and layout, every tensor's shape in a header) is held to types, bounds and the
run's model before a tensor is read: rewind.engine.pretrained_checks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct

import msgspec
import safetensors.torch
import torch

from rewind.engine import hf_llama
from rewind.engine.model import NORM_EPS
from rewind.engine.pretrained_checks import (
    export_shapes,
    header_problem,
    layout_problem,
    llama_json_problem,
    llama_shapes,
    typed,
)
from rewind.states.config import ArchitectureSection, Config, ObjectiveSection
from rewind.states.state import ModelLayout
from rewind.stores.fsio import decode_json, filesystem, open_regular

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
FORMAT_KEY, FORMAT = "rewind.format", "1"
ARCHITECTURE_KEY, OBJECTIVE_KEY, LAYOUT_KEY = "rewind.architecture", "rewind.objective", "layout"
TOKENIZER_KEY = "rewind.tokenizer"  # sha256 of the tokenizer the ids belong to ("" = UTF-8 bytes)
# What a rewind export must agree on with the run (block_size apart: a shorter context is fine).
_SHAPE_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "norm", "mlp", "rope_base")
_MAX_NAMES_SHOWN = 3
# config.json and the shard index: a few KB and a few hundred KB in real models.
MAX_JSON_BYTES = 16 << 20
# A safetensors header (safetensors refuses a longer one itself).
MAX_HEADER_BYTES = 100_000_000


class PretrainedError(Exception):
    """The pretrained weights cannot start this run (one line: which file, what differs)."""


@dataclasses.dataclass(frozen=True)
class Pretrained:
    tensors: dict[str, torch.Tensor]  # flat names of a fresh model of the config, float32
    identity: str  # sha256 of the weight bytes (see the module docstring)
    path: str  # the source as resolved
    kind: str  # "llama" (a transformers directory) or "rewind" (an `export --to` file)


def load_pretrained(path: str, config: Config, base_dir: str | os.PathLike[str] | None = None) -> Pretrained:
    """The weights at `path` (relative paths from `base_dir` when given) for a run of `config`, checked
    to fit it: see the module docstring. PretrainedError (one line) for anything that does not fit."""
    resolved = os.path.expanduser(path)
    if base_dir is not None and not os.path.isabs(resolved):
        resolved = os.path.join(base_dir, resolved)
    if os.path.isdir(resolved):
        tensors, identity = _llama_directory(resolved, config)
        kind = "llama"
    elif os.path.isfile(resolved):
        if os.path.basename(resolved) == CONFIG_NAME:
            raise PretrainedError(f"pretrained: {resolved}: give the directory that holds it, not the config file")
        tensors, identity = _rewind_export(resolved, config)
        kind = "rewind"
    else:
        raise PretrainedError(f"pretrained: {resolved}: no such file or directory")
    _check_shapes(tensors, config, resolved)
    return Pretrained(tensors=tensors, identity=identity, path=resolved, kind=kind)


def apply_pretrained(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` (flat names, as `load_pretrained` gives) into a freshly built plain model, in place:
    every base weight must be given with its shape, and nothing else (PretrainedError names the first
    few that are not). Each value is cast to its parameter's dtype (a bf16 stack rounds)."""
    from rewind.engine.layout import is_adapter, unwrapped

    if any(type(m).__name__ == "Linear4bit" for m in model.modules()):
        raise PretrainedError("pretrained: weights go into the plain model, before any stack is quantised")
    live = {unwrapped(n): t for n, t in model.state_dict().items() if not is_adapter(n)}
    _check_fit(tensors, {name: tuple(t.shape) for name, t in live.items()}, "the weights", "the model")
    with torch.no_grad():
        for name, target in live.items():
            target.copy_(tensors[name])


def expected_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a fresh one-stack plain model of `config` and its shape (rewind.engine.model's
    GPT, computed without building it: a large model is not allocated twice)."""
    from rewind.engine.objectives import model_vocab_size, num_time_levels

    arch = config.architecture
    d, d_ff = arch.d_model, hf_llama.d_ff_of(arch)
    vocab = model_vocab_size(config.objective, arch.vocab_size)
    norm = {"weight": (d,), "bias": (d,)} if arch.norm == "layernorm" else {"weight": (d,)}
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    levels = num_time_levels(config.objective)
    if levels:
        shapes["time_embed.weight"] = (levels, d)
    block = {
        "attn.qkv.weight": (3 * d, d),
        "attn.proj.weight": (d, d),
        "mlp.fc.weight": (2 * d_ff if arch.mlp == "swiglu" else d_ff, d),
        "mlp.proj.weight": (d, d_ff),
    }
    for k in range(arch.num_layers):
        prefix = f"stacks.0.blocks.{k}."
        for norm_name in ("attn_norm", "mlp_norm"):
            shapes.update({f"{prefix}{norm_name}.{p}": s for p, s in norm.items()})
        shapes.update({prefix + name: s for name, s in block.items()})
    shapes.update({f"norm.{p}": s for p, s in norm.items()})
    shapes["head.weight"] = (vocab, d)
    return shapes


def _check_shapes(tensors: dict[str, torch.Tensor], config: Config, where: str) -> None:
    _check_fit(tensors, expected_shapes(config), f"the weights in {where}", "the config's model")


def _check_fit(tensors: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], given: str, model: str) -> None:
    """Every tensor of `expected` given, with its shape, and nothing else: else PretrainedError naming
    the first few that are not."""
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise PretrainedError(
            f"pretrained: {given} do not fit {model}: missing {missing[:_MAX_NAMES_SHOWN]}, "
            f"unexpected {unexpected[:_MAX_NAMES_SHOWN]}"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise PretrainedError(f"pretrained: {given}: {name} is {list(tensors[name].shape)}, {model}'s {list(shape)}")


def _read_weights(paths: list[str], where: str) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of safetensors files `paths` and the sha256 of their bytes in that order, both from
    the same bytes (read once)."""
    digest = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = {}
    for file in paths:
        try:
            _, size = safetensors_header(file)
            data = filesystem(file).read_bounded(size)
        except OSError as exc:
            raise PretrainedError(f"pretrained: cannot read {file} ({exc.strerror or exc})") from None
        digest.update(data)
        try:
            tensors.update(safetensors.torch.load(data))
        except Exception as exc:  # safetensors raises its own SafetensorError for malformed files
            raise PretrainedError(f"pretrained: {file} is not a readable safetensors file ({exc})") from None
    if not tensors:
        raise PretrainedError(f"pretrained: {where} holds no tensors")
    return tensors, digest.hexdigest()


def safetensors_header(path: str) -> tuple[dict, int]:
    """(header, size) of the safetensors file at `path`, read from its first bytes alone: PretrainedError
    unless the header is a JSON object of tensors whose data lies back to back after it, ending exactly
    at the end of the file. OSError (RefusedFile included) when it cannot be read as a regular file."""
    fd, info = open_regular(path)
    try:
        head = os.pread(fd, 8, 0)
        (length,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
        if not 2 <= length <= min(MAX_HEADER_BYTES, info.st_size - 8):
            raise PretrainedError(f"pretrained: {path} is not a readable safetensors file (no header of a possible length)")
        data = os.pread(fd, length, 8)
    finally:
        os.close(fd)
    try:
        header = decode_json(data, dict[str, dict])
    except msgspec.DecodeError as exc:
        raise PretrainedError(f"pretrained: {path} is not a readable safetensors file (its header: {exc})") from None
    end = 0
    for name, entry in header.items():
        offsets = entry.get("data_offsets")
        if name == "__metadata__":
            continue
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise PretrainedError(f"pretrained: {path} is not a readable safetensors file (tensor {name[:80]!r} has no place)")
        end = max(end, offsets[1])
    if 8 + length + end != info.st_size:
        raise PretrainedError(
            f"pretrained: {path}: {info.st_size:,} bytes, but its header describes {8 + length + end:,} (cut short "
            "or not a safetensors file)"
        )
    return header, info.st_size


def _read_json(path: str) -> object:
    """A JSON file of a model directory (config.json, the shard index). OSError, msgspec.DecodeError."""
    return decode_json(filesystem(path).read_bounded(MAX_JSON_BYTES))


def _check_headers(files: list[str], expected: dict[str, tuple[int, ...]], *, only_expected: bool) -> None:
    """Each weight file's header against the shapes the run's model needs, before any tensor is read
    (rewind.engine.pretrained_checks.header_problem)."""
    for file in files:
        try:
            header, _ = safetensors_header(file)
        except OSError as exc:
            raise PretrainedError(f"pretrained: cannot read {file} ({exc.strerror or exc})") from None
        if problem := header_problem(header, expected, file, only_expected=only_expected):
            raise PretrainedError(problem)


# --- a transformers Llama directory -------------------------------------------------------------


def _llama_directory(directory: str, config: Config) -> tuple[dict[str, torch.Tensor], str]:
    config_path = os.path.join(directory, CONFIG_NAME)
    try:
        hf = _read_json(config_path)
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
    files = _weight_files(directory)
    _check_headers(files, llama_shapes(expected_shapes(config)), only_expected=True)
    tensors, identity = _read_weights(files, directory)
    try:
        flat = hf_llama.from_llama(tensors, tied=bool(hf.get("tie_word_embeddings", False)))
    except ValueError as exc:
        raise PretrainedError(f"pretrained: {directory}: {exc}") from None
    return flat, identity


def _weight_files(directory: str) -> list[str]:
    index_path = os.path.join(directory, INDEX_NAME)
    if os.path.lexists(index_path):  # (read only if it is a regular file: a FIFO is refused, not skipped)
        try:
            weight_map = _read_json(index_path)["weight_map"]  # type: ignore[index]
            shards = sorted(set(weight_map.values()))
        except (OSError, msgspec.DecodeError, KeyError, TypeError, AttributeError) as exc:
            raise PretrainedError(f"pretrained: {index_path} is not a shard index ({exc})") from None
        for shard in shards:
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise PretrainedError(f"pretrained: {index_path} names a shard outside the directory: {shard!r}")
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
        return _number(parameters["rope_theta"])  # type: ignore[return-value]
    return _number(hf.get("rope_theta", 10000.0))  # type: ignore[return-value]


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
        return f"pretrained: {where} is a Llama (SwiGLU MLP), architecture.mlp is {arch.mlp!r}; set mlp = \"swiglu\""
    num_heads = hf.get("num_attention_heads")
    head_size = arch.d_model // arch.num_heads
    pairs = [
        ("vocab_size", hf.get("vocab_size"), "architecture.vocab_size", arch.vocab_size),
        ("hidden_size", hf.get("hidden_size"), "architecture.d_model", arch.d_model),
        ("intermediate_size", hf.get("intermediate_size"), "architecture.d_ff (0 = 4 * d_model)", hf_llama.d_ff_of(arch)),
        ("num_hidden_layers", hf.get("num_hidden_layers"), "architecture.num_layers", arch.num_layers),
        ("num_attention_heads", num_heads, "architecture.num_heads", arch.num_heads),
        ("num_key_value_heads", hf.get("num_key_value_heads", num_heads), "architecture.num_heads (rewind has a "
         "key/value head per query head)", arch.num_heads),
        ("head_dim", hf.get("head_dim", head_size), "d_model / num_heads", head_size),
        ("hidden_act", hf.get("hidden_act", "silu"), "rewind's SwiGLU gate", "silu"),
        ("rms_norm_eps", _number(hf.get("rms_norm_eps", 1e-6)), "rewind's norm eps", NORM_EPS),
        ("rope theta", _number(rope_theta(hf)), "architecture.rope_base", arch.rope_base),
        ("rope type", _rope_type(hf), "rewind's rope", "default"),
        ("attention_bias", hf.get("attention_bias", False), "rewind's attention (no biases)", False),
        ("mlp_bias", hf.get("mlp_bias", False), "rewind's MLP (no biases)", False),
    ]
    for key, theirs, field, ours in pairs:
        if theirs != ours:
            return f"pretrained: {where} has {key} {_shown(theirs)}, {field} is {ours!r}"
    positions = hf.get("max_position_embeddings", arch.block_size)
    if isinstance(positions, int) and positions < arch.block_size:
        return (
            f"pretrained: {where} has max_position_embeddings {positions}, architecture.block_size is "
            f"{arch.block_size} (longer than the model was made for)"
        )
    return None


def _number(value: object) -> object:
    """A JSON number as a float (to compare 10000 with 10000.0); anything else, or an integer past a
    float's range, as it is (it then differs from every value a config can hold)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            return value
    return value


def _shown(value: object) -> str:
    """A value from a user's file in a message: its repr, cut short."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**40 else f"an integer of {len(str(abs(value)))} digits"
    return text if len(text) <= 80 else text[:77] + "..."


# --- a rewind export ------------------------------------------------------------------------------


def _rewind_export(path: str, config: Config) -> tuple[dict[str, torch.Tensor], str]:
    try:
        metadata = safetensors_header(path)[0].get("__metadata__") or {}
    except OSError as exc:
        raise PretrainedError(f"pretrained: cannot read {path} ({exc.strerror or exc})") from None
    if not all(isinstance(value, str) for value in metadata.values()):
        raise PretrainedError(f"pretrained: {path} is not a readable safetensors file (metadata that is not text)")
    if metadata.get(FORMAT_KEY) != FORMAT or ARCHITECTURE_KEY not in metadata or LAYOUT_KEY not in metadata:
        raise PretrainedError(
            f"pretrained: {path} carries no rewind architecture in its metadata (not written by `rewind export "
            "--to` of this release); export it again, or give a transformers Llama directory"
        )
    try:
        theirs = decode_json(metadata[ARCHITECTURE_KEY], dict)
        layout = decode_json(metadata[LAYOUT_KEY], ModelLayout)
        objective = decode_json(metadata.get(OBJECTIVE_KEY, "{}"), ObjectiveSection)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PretrainedError(f"pretrained: {path} has unreadable rewind metadata ({exc})") from None
    architecture, problem = typed(theirs, ArchitectureSection, path, "rewind.architecture")
    if problem:
        raise PretrainedError(problem)
    theirs = msgspec.to_builtins(architecture)
    num_layers = theirs["num_layers"]
    problem = rewind_mismatch(theirs, objective, config, path) or layout_problem(layout, num_layers, path)
    if problem:
        raise PretrainedError(problem)
    _check_headers([path], export_shapes(expected_shapes(config), layout), only_expected=False)
    tensors, identity = _read_weights([path], path)
    try:
        return hf_llama.flat_weights(tensors, layout), identity
    except ValueError as exc:
        raise PretrainedError(f"pretrained: {path}: {exc}") from None


def rewind_mismatch(theirs: dict, objective: ObjectiveSection, config: Config, where: str) -> str | None:
    """The first difference between the architecture (and objective) a rewind export was made with and
    the run's, as one line naming both sides, or None."""
    from rewind.engine.objectives import model_vocab_size, num_time_levels

    arch = config.architecture
    ours = msgspec.to_builtins(arch)
    defaults = msgspec.to_builtins(ArchitectureSection())
    theirs = {**defaults, **theirs}
    theirs["d_ff"] = theirs["d_ff"] or 4 * theirs["d_model"]
    ours["d_ff"] = hf_llama.d_ff_of(arch)
    for key in (*_SHAPE_FIELDS, "d_ff"):
        a, b = _number(theirs[key]), _number(ours[key])
        if a != b:
            return f"pretrained: {where} has architecture.{key} {theirs[key]!r}, architecture.{key} is {ours[key]!r}"
    if theirs["block_size"] < arch.block_size:
        return (
            f"pretrained: {where} has architecture.block_size {theirs['block_size']}, architecture.block_size is "
            f"{arch.block_size} (longer than the model was made for)"
        )
    same_model = (
        model_vocab_size(objective, arch.vocab_size) == model_vocab_size(config.objective, arch.vocab_size)
        and num_time_levels(objective) == num_time_levels(config.objective)
        and (objective.kind == "clm") == (config.objective.kind == "clm")
    )
    if not same_model:
        mine = config.objective
        if objective.kind == mine.kind:  # diffusion both: the time embedding differs
            return (
                f"pretrained: {where} has objective time {objective.time!r} with {num_time_levels(objective)} "
                f"embedded levels, objective.time is {mine.time!r} with {num_time_levels(mine)}"
            )
        return f"pretrained: {where} has objective.kind {objective.kind!r}, objective.kind is {mine.kind!r}"
    return None


def tokenizer_of_export(path: str) -> str | None:
    """The tokenizer sha256 a rewind `--to` file records ("" = UTF-8 bytes; None: it does not say, or the
    file is not one: load_pretrained says what is wrong with it)."""
    try:
        found = (safetensors_header(path)[0].get("__metadata__") or {}).get(TOKENIZER_KEY)
    except (OSError, PretrainedError):  # (any unreadable file: load_pretrained reports it in one line)
        return None
    return found if isinstance(found, str) else None
