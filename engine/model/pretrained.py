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
describes, so nothing is allocated for a size the file does not have: rewind.engine.model.pretrained_files.
A transformers directory is read by rewind.engine.model.pretrained_llama, a rewind export here. What the files declare (config.json's
values, an export's metadata and layout, every tensor's shape in a header) is held to types, bounds and the
run's model before a tensor is read: rewind.engine.model.pretrained_checks.
"""

from __future__ import annotations

import dataclasses
import os

import msgspec
import torch

from rewind.engine.model import hf_llama, pretrained_files
from rewind.engine.model.layout import is_adapter, unwrapped
from rewind.engine.model.pretrained_checks import export_shapes, layout_problem, number, typed
from rewind.engine.model.pretrained_files import PretrainedError
from rewind.engine.model.pretrained_llama import CONFIG_NAME, llama_directory
from rewind.states.check_continuation import model_vocab_size, num_time_levels
from rewind.states.config import ArchitectureSection, Config, ObjectiveSection
from rewind.states.model_size import head_width, mlp_width, qkv_rows
from rewind.states.state import ModelLayout
from rewind.stores.untrusted import decode_json

FORMAT_KEY, FORMAT = "rewind.format", "1"
ARCHITECTURE_KEY, OBJECTIVE_KEY, LAYOUT_KEY = "rewind.architecture", "rewind.objective", "layout"
TOKENIZER_KEY = "rewind.tokenizer"  # sha256 of the tokenizer the ids belong to ("" = UTF-8 bytes)
# What a rewind export must agree on with the run (block_size apart: a shorter context is fine).
_SHAPE_FIELDS = (
    "vocab_size", "d_model", "num_layers", "num_heads", "norm", "mlp", "rope_base",
    "num_kv_heads", "head_dim", "norm_eps", "qkv_bias", "qk_norm", "tie_embeddings", "rope_scaling",
)  # fmt: skip
_MAX_NAMES_SHOWN = 3

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
        tensors, identity = llama_directory(resolved, config, expected_shapes(config))
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
    if any(type(m).__name__ == "Linear4bit" for m in model.modules()):
        raise PretrainedError("pretrained: weights go into the plain model, before any stack is quantised")
    live = {unwrapped(n): t for n, t in model.state_dict().items() if not is_adapter(n)}
    _check_fit(tensors, {name: tuple(t.shape) for name, t in live.items()}, "the weights", "the model")
    with torch.no_grad():
        for name, target in live.items():
            target.copy_(tensors[name])


def expected_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a fresh one-stack plain model of `config` and its shape (rewind.engine.model.model's
    GPT, computed without building it: a large model is not allocated twice)."""
    arch = config.architecture
    d, d_ff = arch.d_model, mlp_width(arch)
    vocab = model_vocab_size(config.objective, arch.vocab_size)
    norm = {"weight": (d,), "bias": (d,)} if arch.norm == "layernorm" else {"weight": (d,)}
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, d)}
    levels = num_time_levels(config.objective)
    if levels:
        shapes["time_embed.weight"] = (levels, d)
    block = {
        "attn.qkv.weight": (qkv_rows(arch), d),
        "attn.proj.weight": (d, arch.num_heads * head_width(arch)),
        "mlp.fc.weight": (2 * d_ff if arch.mlp == "swiglu" else d_ff, d),
        "mlp.proj.weight": (d, d_ff),
    }
    if arch.qkv_bias:
        block["attn.qkv.bias"] = (qkv_rows(arch),)
    if arch.qk_norm:
        block.update({"attn.q_norm.weight": (head_width(arch),), "attn.k_norm.weight": (head_width(arch),)})
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




# --- a rewind export ------------------------------------------------------------------------------


def _rewind_export(path: str, config: Config) -> tuple[dict[str, torch.Tensor], str]:
    try:
        metadata = pretrained_files.safetensors_header(path)[0].get("__metadata__") or {}
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
    pretrained_files.check_headers([path], export_shapes(expected_shapes(config), layout), only_expected=False)
    tensors, identity = pretrained_files.read_weights([path], path)
    try:
        return hf_llama.flat_weights(tensors, layout), identity
    except ValueError as exc:
        raise PretrainedError(f"pretrained: {path}: {exc}") from None


def rewind_mismatch(theirs: dict, objective: ObjectiveSection, config: Config, where: str) -> str | None:
    """The first difference between the architecture (and objective) a rewind export was made with and
    the run's, as one line naming both sides, or None."""
    arch = config.architecture
    ours = msgspec.to_builtins(arch)
    defaults = msgspec.to_builtins(ArchitectureSection())
    theirs = {**defaults, **theirs}
    # The export's values as it wrote them (a struct's constructor checks no types): the same rule as ours.
    theirs["d_ff"] = mlp_width(ArchitectureSection(d_model=theirs["d_model"], d_ff=theirs["d_ff"]))
    ours["d_ff"] = mlp_width(arch)
    for key in (*_SHAPE_FIELDS, "d_ff"):
        a, b = number(theirs[key]), number(ours[key])
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
        found = (pretrained_files.safetensors_header(path)[0].get("__metadata__") or {}).get(TOKENIZER_KEY)
    except (OSError, PretrainedError):  # (any unreadable file: load_pretrained reports it in one line)
        return None
    return found if isinstance(found, str) else None
