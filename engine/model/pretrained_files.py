"""Reading a [pretrained] source's files, all of them untrusted: a weight file only once its header
(at most MAX_HEADER_BYTES, safetensors' own limit) says where every tensor lies and the file's size is
exactly what that header describes, JSON up to MAX_JSON_BYTES through msgspec, and every file only if it
is a regular file (a FIFO would block, /dev/zero never ends). Shared by both kinds of source
(rewind.engine.model.pretrained_llama, rewind.engine.model.pretrained); anything wrong is a one-line PretrainedError.
"""

from __future__ import annotations

import hashlib
import os
import struct

import msgspec
import safetensors.torch
import torch

from rewind.engine.model.pretrained_checks import header_problem
from rewind.stores.fsio import filesystem
from rewind.stores.untrusted import decode_json, open_regular

# config.json and the shard index: a few KB and a few hundred KB in real models.
MAX_JSON_BYTES = 16 << 20
# A safetensors header (safetensors refuses a longer one itself).
MAX_HEADER_BYTES = 100_000_000


class PretrainedError(Exception):
    """The pretrained weights cannot start this run (one line: which file, what differs)."""


def read_weights(paths: list[str], where: str) -> tuple[dict[str, torch.Tensor], str]:
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
            raise PretrainedError(
                f"pretrained: {path} is not a readable safetensors file (no header of a possible length)"
            )
        data = os.pread(fd, length, 8)
    finally:
        os.close(fd)
    try:
        header = decode_json(data, dict[str, dict])
    except msgspec.DecodeError as exc:
        raise PretrainedError(
            f"pretrained: {path} is not a readable safetensors file (its header: {exc})"
        ) from None
    end = 0
    for name, entry in header.items():
        offsets = entry.get("data_offsets")
        if name == "__metadata__":
            continue
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise PretrainedError(
                f"pretrained: {path} is not a readable safetensors file (tensor {name[:80]!r} has no place)"
            )
        end = max(end, offsets[1])
    if 8 + length + end != info.st_size:
        raise PretrainedError(
            f"pretrained: {path}: {info.st_size:,} bytes, but its header describes {8 + length + end:,} (cut short "
            "or not a safetensors file)"
        )
    return header, info.st_size


def read_json(path: str) -> object:
    """A JSON file of a model directory (config.json, the shard index). OSError, msgspec.DecodeError."""
    return decode_json(filesystem(path).read_bounded(MAX_JSON_BYTES))


def check_headers(files: list[str], expected: dict[str, tuple[int, ...]], *, only_expected: bool) -> None:
    """Each weight file's header against the shapes the run's model needs, before any tensor is read
    (rewind.engine.model.pretrained_checks.header_problem)."""
    for file in files:
        try:
            header, _ = safetensors_header(file)
        except OSError as exc:
            raise PretrainedError(f"pretrained: cannot read {file} ({exc.strerror or exc})") from None
        if problem := header_problem(header, expected, file, only_expected=only_expected):
            raise PretrainedError(problem)


# --- a transformers Llama directory -------------------------------------------------------------
