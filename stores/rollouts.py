"""The rollout files of a grpo run: each rollout batch kept on record, one safetensors file per batch.

A batch is written to `RUN/rollouts/<sha256>.safetensors`, named by the sha256 of its bytes, durably
before the RolloutsRecorded record that names it (path "rollouts/<sha256>.safetensors" and the sha256)
is committed, as checkpoint files are: locally a temporary file, synced, renamed into place and the
directory synced; on an object store one put, which is atomic. Writing a batch that is already there
writes nothing (same bytes, same name). Files are kept for the record: nothing deletes them.

The format (P prompts, G completions each, N = P * G; F reward functions; right-padded rows):

    prompt_sources      int64   (P,)      the prompt's dataset: an index into the stage's datasets
    prompt_rows         int64   (P,)      the prompt's row in that dataset's train split
    prompts             int64   (P, Lp)   prompt tokens, the first prompt_lengths[p] of each row real
    prompt_lengths      int64   (P,)
    completions         int64   (N, Lc)   completion n belongs to prompt n // G, as sample n % G
    completion_lengths  int64   (N,)      the eos token included when finished
    finished            int8    (N,)      1: ended with the end token; 0: cut at max_new_tokens
    sample_logprobs     float32 (N, Lc)   each token's log-prob under the sampling policy
    rewards             float32 (F, N)    per reward function; NaN where the function gave None
    advantages          float32 (N,)
    old_logprobs        float32 (N, Lc)
    reference_logprobs  float32 (N, Lc)   only when the stage has a KL reference

Metadata (strings): "reward_functions" (the F names, comma-separated, in the rows' order of
`rewards`), "group_size" (G) and "policy_step" (the step whose weights sampled); other keys may be
added. safetensors writes its metadata map in a random order (a Rust HashMap), so the whole map is
kept as one entry, METADATA_KEY, holding it as JSON with sorted keys: the same batch always makes the
same bytes.

Reading is for untrusted input: the path must be exactly "rollouts/<64 hex>.safetensors" naming the
recorded sha256, stay inside the run, be a regular file of at most MAX_ROLLOUT_BYTES, hash to the
recorded sha256, parse as safetensors (never pickle) and hold tensors `check_rollout_tensors` accepts.
Any of these failing is a RolloutError: one line. Whether the batch follows the rules a run's batches
follow (token ids within the vocabulary, rows within the context, advantages that follow from the
rewards: what needs the config and the record) is rewind.engine.posttrain.rolloutreader.rollout_problems.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

from rewind.states.admission import ROLLOUTS_DIR, rollout_path_problem
from rewind.stores import confine
from rewind.stores.fsio import Location, RefusedFile, decode_json, filesystem, fsync_dir

if TYPE_CHECKING:
    import torch

SUFFIX = ".safetensors"
MAX_ROLLOUT_BYTES = 1 << 30  # far beyond a real batch; keeps a forged file from taking a reader's memory
METADATA_KEY = "rewind_rollouts"
REQUIRED_METADATA = ("reward_functions", "group_size", "policy_step")
_DECIMAL = re.compile(r"[0-9]{1,18}", re.ASCII)

# name -> (dtype name, shape in the dimension letters of the module doc)
FORMAT = {
    "prompt_sources": ("int64", ("P",)),
    "prompt_rows": ("int64", ("P",)),
    "prompts": ("int64", ("P", "Lp")),
    "prompt_lengths": ("int64", ("P",)),
    "completions": ("int64", ("N", "Lc")),
    "completion_lengths": ("int64", ("N",)),
    "finished": ("int8", ("N",)),
    "sample_logprobs": ("float32", ("N", "Lc")),
    "rewards": ("float32", ("F", "N")),
    "advantages": ("float32", ("N",)),
    "old_logprobs": ("float32", ("N", "Lc")),
    "reference_logprobs": ("float32", ("N", "Lc")),
}
OPTIONAL = frozenset({"reference_logprobs"})


class RolloutError(ValueError):
    """A rollout batch that cannot be written, or a rollout file that cannot be read as one: one line."""


def rollout_path(sha256: str) -> str:
    """The path, relative to the run directory, of the rollout file whose bytes hash to `sha256`."""
    return f"{ROLLOUTS_DIR}/{sha256}{SUFFIX}"


def check_rollout_tensors(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> list[str]:
    """Every way `tensors` (and `metadata`, when given) break the format, one line each ([] if none)."""
    import torch

    missing = sorted(set(FORMAT) - OPTIONAL - set(tensors))
    unknown = sorted(set(tensors) - set(FORMAT))
    problems = [f"no tensor {name!r}" for name in missing] + [f"unknown tensor {name!r}" for name in unknown]
    sizes: dict[str, tuple[int, str]] = {}  # dimension letter -> (size, the tensor that set it)
    for name, (dtype, dims) in FORMAT.items():
        tensor = tensors.get(name)
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{name} is a {type(tensor).__name__}, not a tensor")
            continue
        if tensor.dtype != getattr(torch, dtype) or tensor.dim() != len(dims):
            problems.append(
                f"{name} is {str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}, "
                f"not {dtype} ({', '.join(dims)})"
            )
            continue
        for dim, size in zip(dims, tensor.shape, strict=True):
            known = sizes.setdefault(dim, (size, name))
            if known[0] != size:
                problems.append(f"{name} has {dim} = {size}, but {known[1]} has {dim} = {known[0]}")
    if problems:
        return problems  # the value checks below need every tensor there, of its shape
    return _value_problems(tensors, {dim: size for dim, (size, _) in sizes.items()}) + (
        [] if metadata is None else _metadata_problems(metadata, sizes)
    )


def _value_problems(tensors: Mapping[str, torch.Tensor], sizes: dict[str, int]) -> list[str]:
    """What the displays and the losses index by: lengths within the rows, whole groups, known finishes."""
    problems = []
    num_prompts, num_completions = sizes["P"], sizes["N"]
    if num_prompts == 0 or num_completions % num_prompts or num_completions == 0:
        problems.append(
            f"{num_completions} completions for {num_prompts} prompts: not a whole group per prompt"
        )
    if sizes["F"] == 0:
        problems.append("no reward function (rewards has no rows)")
    in_range = set()
    for name, width in (("prompt_lengths", sizes["Lp"]), ("completion_lengths", sizes["Lc"])):
        lengths = tensors[name]
        if bool(((lengths < 0) | (lengths > width)).any()):
            problems.append(f"{name} holds a length outside 0..{width}")
        else:
            in_range.add(name)
    for name in ("prompt_sources", "prompt_rows"):
        if bool((tensors[name] < 0).any()):
            problems.append(f"{name} holds a negative index")
    finished = tensors["finished"]
    if bool(((finished != 0) & (finished != 1)).any()):
        problems.append("finished holds a value other than 0 and 1")
    elif bool(((finished == 1) & (tensors["completion_lengths"] == 0)).any()):
        problems.append("a completion finished with the end token but has no tokens")
    for name, lengths in (("prompts", "prompt_lengths"), ("completions", "completion_lengths")):
        rows = tensors[name]
        if lengths in in_range and bool((rows[_within_lengths(rows, tensors[lengths])] < 0).any()):
            problems.append(f"{name} holds a negative token id")
    return problems


def _within_lengths(rows: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.arange(rows.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)


def _metadata_problems(metadata: Mapping[str, str], sizes: dict[str, tuple[int, str]]) -> list[str]:
    problems = [
        f"metadata {key!r}: {value!r} is not a string"
        for key, value in metadata.items()
        if not isinstance(key, str) or not isinstance(value, str)
    ]
    problems += [f"no metadata {key!r}" for key in REQUIRED_METADATA if key not in metadata]
    if problems:
        return problems
    num_prompts, num_completions = sizes["P"][0], sizes["N"][0]
    group_size, policy_step = metadata["group_size"], metadata["policy_step"]
    if not _DECIMAL.fullmatch(group_size) or num_prompts * int(group_size) != num_completions:
        problems.append(
            f"metadata group_size {group_size!r}, but {num_completions} completions for {num_prompts} prompts"
        )
    if not _DECIMAL.fullmatch(policy_step):
        problems.append(f"metadata policy_step {policy_step!r} is not a step")
    names = metadata["reward_functions"].split(",")
    if len(names) != sizes["F"][0] or not all(names):
        problems.append(
            f"metadata reward_functions {metadata['reward_functions']!r} does not name the "
            f"{sizes['F'][0]} rows of rewards"
        )
    return problems


def encode_rollouts(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """The bytes of a rollout file: the same for the same tensors and metadata, whatever their order.
    RolloutError (nothing written) for a batch that breaks the format or is not plain CPU tensors."""
    import safetensors.torch
    import torch

    if problems := check_rollout_tensors(tensors, metadata):
        raise RolloutError(f"rollout batch not written: {problems[0]}")
    for name, tensor in tensors.items():
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise RolloutError(
                f"rollout batch not written: {name} must be a dense CPU tensor, not {tensor.device}"
            )
    # contiguous: safetensors refuses views; detach: it goes through numpy, which refuses requires_grad
    plain = {name: tensor.detach().contiguous() for name, tensor in tensors.items()}
    entry = msgspec.json.encode(dict(metadata), order="sorted").decode()
    try:
        data = safetensors.torch.save(plain, metadata={METADATA_KEY: entry})
    except (ValueError, RuntimeError) as exc:  # e.g. two names for one storage
        raise RolloutError(f"rollout batch not written: {' '.join(str(exc).split())[:300]}") from None
    if len(data) > MAX_ROLLOUT_BYTES:
        raise RolloutError(
            f"rollout batch not written: {len(data):,} bytes, more than the {MAX_ROLLOUT_BYTES:,} "
            "a rollout file may hold"
        )
    return data


def rollout_name(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> tuple[str, str]:
    """(path relative to the run, sha256) a batch's file has, without writing it: what a re-sampling
    (`rewind replay`) compares with the record."""
    sha256 = hashlib.sha256(encode_rollouts(tensors, metadata)).hexdigest()
    return rollout_path(sha256), sha256


def write_rollouts(
    run_dir: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
) -> tuple[str, str]:
    """Write a rollout batch durably under `run_dir` (a path or fsspec URL) and return (its path relative
    to the run, its sha256): only then may a record name it. Already there, intact: nothing is written."""
    data = encode_rollouts(tensors, metadata)
    sha256 = hashlib.sha256(data).hexdigest()
    run = filesystem(run_dir)
    directory = run.join(ROLLOUTS_DIR)
    target = directory.join(sha256 + SUFFIX)
    if _holds(run, target, sha256):
        if run.is_local:
            fsync_dir(directory.path)  # its name may predate a crash before the writer synced it
        return rollout_path(sha256), sha256
    if run.is_local and not os.path.isdir(directory.path):
        os.makedirs(directory.path, exist_ok=True)
        fsync_dir(run.path)  # rollouts/ must outlive a power cut, or so would none of the files in it
    # Locally: temporary file, synced, renamed over the name, directory synced; elsewhere one put. An
    # earlier copy under this name that is damaged (it did not hash right) is replaced.
    target.write_atomic(data)
    return rollout_path(sha256), sha256


def _holds(run: Location, target: Location, sha256: str) -> bool:
    try:
        return hashlib.sha256(_read(run, target)).hexdigest() == sha256
    except (OSError, confine.NotConfined):  # absent, unreadable, too large, or not a file: (re)write it
        return False


def _read(run: Location, target: Location) -> bytes:
    """The file's bytes, bounded; confined to the run directory locally (links followed must stay in it)."""
    if run.is_local:
        return confine.read_file(run.path, [ROLLOUTS_DIR, target.name], max_size=MAX_ROLLOUT_BYTES)
    return target.read_bounded(MAX_ROLLOUT_BYTES)


def read_rollouts(run_dir: str, path: str, sha256: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of the rollout file a record names by `path` and `sha256`, every check of the
    module doc passed; RolloutError (one line) otherwise."""
    import safetensors
    import safetensors.torch

    if problem := rollout_path_problem(path, sha256):
        raise RolloutError(problem)
    run = filesystem(run_dir)
    target = run.join(*path.split("/"))
    try:
        data = _read(run, target)
    except FileNotFoundError:
        raise RolloutError(f"{path}: missing from the run directory") from None
    except confine.NotConfined as exc:
        raise RolloutError(str(exc)) from None
    except RefusedFile as exc:
        raise RolloutError(f"{path}: {exc.strerror}") from None
    if (digest := hashlib.sha256(data).hexdigest()) != sha256:
        raise RolloutError(
            f"{path}: damaged: its bytes hash to {digest[:12]}, not to the recorded {sha256[:12]}"
        )
    try:
        tensors = safetensors.torch.load(data)
    except safetensors.SafetensorError as exc:
        raise RolloutError(f"{path}: not a safetensors file ({' '.join(str(exc).split())[:200]})") from None
    metadata = _metadata(path, data)
    if problems := check_rollout_tensors(tensors, metadata):
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise RolloutError(f"{path}: not a rollout batch rewind writes: {problems[0]}{more}")
    return tensors, metadata


def _metadata(path: str, data: bytes) -> dict[str, str]:
    """The metadata map kept under METADATA_KEY of a file safetensors has already parsed."""
    (header_size,) = struct.unpack_from("<Q", data)
    try:
        header = decode_json(data[8 : 8 + header_size], dict)
        entry = header.get("__metadata__", {}).get(METADATA_KEY)
        metadata = decode_json(entry, dict[str, str]) if isinstance(entry, str) else None
    except (msgspec.DecodeError, AttributeError):
        metadata = None
    if metadata is None:
        raise RolloutError(f"{path}: not a rollout batch rewind writes: no readable {METADATA_KEY} metadata")
    return metadata
