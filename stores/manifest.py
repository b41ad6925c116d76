"""What a checkpoint holds, as bytes: safetensors files and the manifest that pins each of them.

One group of tensors (model, optimizer, ...) becomes one safetensors file; the manifest records every
file's sha256 and every tensor's name, shape, dtype and raw-bytes sha256 (little-endian, as safetensors
stores them). The manifest is canonical JSON with no time or uuid in it, and a checkpoint's name is its
step and the start of the manifest's own sha256, so the same tensors and meta at the same step always
give the same bytes and the same name: a changed byte here renames every checkpoint ever written.

Format 2 (runs started with the "content_named_checkpoints" feature) holds only what defines the
training state, so the manifest's sha256 is a content digest: a run killed and resumed names its
checkpoints as the run that never stopped did. How far the log reached when it was written (`log_seq`)
sits beside the manifest (WRITTEN). Format 1 (runs started earlier, for life) also holds `log_seq` and
the KL reference's name in its meta, so the same state written after a resume was named apart.

No file system here: `stores/checkpoints.py` decides where these bytes go and reads them back. Parsing
never unpickles: bytes are hashed first, then parsed by `safetensors.torch.load`. torch and safetensors
are imported by the functions that handle tensors, so reading and checking a manifest (`rewind verify`,
`rewind state`) never imports torch.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    import torch

FORMAT_VERSION = 2
FORMAT_WITH_LOG_SEQ = 1  # what runs started before "content_named_checkpoints" write, for life
MANIFEST = "manifest.json"
WRITTEN = "written.json"  # beside a format 2 manifest: `Written`
SUFFIX = ".safetensors"
# By the names the manifest records (`TensorEntry.dtype`).
_FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")
_INTEGER_DTYPES = ("int64", "int32", "int16", "int8", "uint8", "bool")
SUPPORTED_DTYPES = frozenset({*_FLOAT_DTYPES, *_INTEGER_DTYPES})
_GROUP_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(Exception):
    """A checkpoint cannot be written or read as asked."""


class CheckpointCorrupt(CheckpointError):
    """What is on disk is not what was written: a missing file or a hash that does not match."""

    def __init__(self, checkpoint: str, file: str, problem: str):
        super().__init__(f"checkpoint {checkpoint} is corrupt: {file}: {problem}")
        self.checkpoint = checkpoint
        self.file = file


class TensorEntry(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    dtype: str  # torch dtype without the "torch." prefix, e.g. "bfloat16"
    shape: list[int]
    sha256: str  # of the tensor's raw (little-endian, row-major) bytes


class FileEntry(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    num_bytes: int
    sha256: str
    tensors: list[TensorEntry]


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    format_version: int
    step: int
    files: list[FileEntry]
    meta: dict[str, Any] = {}

    def file_hashes(self) -> dict[str, str]:
        return {entry.name: entry.sha256 for entry in self.files}


class Written(msgspec.Struct, frozen=True, kw_only=True):
    """When a format 2 checkpoint was written: the last record durable in the log then (see
    rewind.engine.run.journal). Not part of the manifest, so not of the name: it differs between a straight
    run and a resumed one that hold the same state."""

    log_seq: int


class CheckpointWritten(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine puts in its CheckpointCommitted event once `write` returns."""

    name: str
    manifest_sha256: str
    files: dict[str, str]


# --- writing ---------------------------------------------------------------------------------------


def group_file(group: str, tensors: Mapping[str, torch.Tensor]) -> tuple[str, str]:
    """(file name, sha256) that a checkpoint holding these tensors records for the group: a re-execution
    can check its live tensors against a CheckpointCommitted event even after retention deleted the files."""
    _, entry = serialize_group(group, checked_tensors(group, tensors))
    return entry.name, entry.sha256


def canonical_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
    """Meta as it will read back (tuples become lists); refused if JSON would change it."""
    try:
        canonical = msgspec.json.decode(msgspec.json.encode(dict(meta)))
    except (TypeError, msgspec.EncodeError) as exc:
        raise CheckpointError(f"checkpoint meta is not JSON: {exc}") from None
    # JSON turns NaN/inf into null and int keys into strings: the comparison catches both.
    if canonical != _as_json(dict(meta)):
        raise CheckpointError("checkpoint meta does not survive JSON (a NaN/inf float or a non-string key?)")
    return canonical


def _as_json(value: Any) -> Any:
    # Tuples as lists, the way JSON gives them back; everything else as is.
    if isinstance(value, list | tuple):
        return [_as_json(item) for item in value]
    if isinstance(value, dict):
        return {key: _as_json(item) for key, item in value.items()}
    return value


def checked_tensors(group: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The group's tensors, detached, once each is known to be storable; CheckpointError otherwise."""
    import torch

    checked: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        where = f"{group}/{key}"
        if not isinstance(key, str) or not key:
            raise CheckpointError(f"tensor names must be non-empty strings, got {key!r} in group {group}")
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{where} is a {type(tensor).__name__}, not a tensor")
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise CheckpointError(f"{where} must be a dense CPU tensor, not {tensor.device} {tensor.layout}")
        if _dtype_name(tensor) not in SUPPORTED_DTYPES:
            raise CheckpointError(f"{where} has dtype {tensor.dtype}, which checkpoints do not store")
        if not tensor.is_contiguous():
            raise CheckpointError(f"{where} is not contiguous (snapshot tensors with .contiguous())")
        checked[key] = tensor.detach()  # safetensors goes through numpy, which refuses requires_grad
    return checked


def serialize_group(group: str, checked: dict[str, torch.Tensor]) -> tuple[bytes, FileEntry]:
    """The group's safetensors file and its manifest entry; `checked` comes from `checked_tensors`."""
    import safetensors.torch

    try:
        data = safetensors.torch.save(checked)
    except (ValueError, RuntimeError) as exc:  # e.g. tied tensors sharing storage
        raise CheckpointError(f"cannot save group {group}: {' '.join(str(exc).split())[:300]}") from None
    entries = [
        TensorEntry(name=key, dtype=_dtype_name(t), shape=list(t.shape), sha256=_tensor_sha256(t))
        for key, t in sorted(checked.items())
    ]
    digest = hashlib.sha256(data).hexdigest()
    return data, FileEntry(name=group + SUFFIX, num_bytes=len(data), sha256=digest, tensors=entries)


def encode_manifest(
    step: int, entries: list[FileEntry], meta: dict[str, Any], format_version: int = FORMAT_VERSION
) -> tuple[bytes, CheckpointWritten]:
    """The manifest's bytes and the checkpoint's name and hashes; `meta` comes from `canonical_meta`."""
    if format_version not in (FORMAT_WITH_LOG_SEQ, FORMAT_VERSION):
        raise CheckpointError(f"checkpoint format {format_version!r} is not one this rewind writes")
    manifest = Manifest(format_version=format_version, step=step, files=entries, meta=meta)
    # "deterministic" sorts dict keys (meta), so equal content always gives equal bytes.
    encoded = msgspec.json.encode(manifest, order="deterministic")
    data = msgspec.json.format(encoded, indent=2) + b"\n"
    digest = hashlib.sha256(data).hexdigest()
    name = f"{step:08d}-{digest[:8]}"
    return data, CheckpointWritten(name=name, manifest_sha256=digest, files=manifest.file_hashes())


def encode_written(log_seq: int) -> bytes:
    """The bytes of the WRITTEN file beside a format 2 manifest."""
    return msgspec.json.encode(Written(log_seq=log_seq)) + b"\n"


def decode_written(data: bytes) -> int | None:
    """The log_seq a WRITTEN file records, or None where it does not read as one: no name pins it, so a
    damaged one dates nothing (rewind.stores.orphans then bounds the log by the checkpoint's step)."""
    try:
        written = msgspec.json.decode(data, type=Written)
    except msgspec.DecodeError:
        return None
    return written.log_seq if written.log_seq >= -1 else None


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")  # "bfloat16", as in the manifest


def _tensor_sha256(tensor: torch.Tensor) -> str:
    import torch

    # Flattened first: a 0-dim tensor cannot be viewed as bytes, a 1-dim one can (even when empty).
    return hashlib.sha256(tensor.reshape(-1).view(torch.uint8).numpy()).hexdigest()


# --- reading and checking ----------------------------------------------------------------------------


def decode_manifest(name: str, data: bytes) -> Manifest:
    """The manifest of checkpoint `name` from its bytes, checked against the hash embedded in the name."""
    digest = hashlib.sha256(data).hexdigest()
    if not name.endswith("-" + digest[:8]):
        raise CheckpointCorrupt(name, MANIFEST, f"sha256 {digest[:8]}... does not match the name")
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except msgspec.DecodeError as exc:
        raise CheckpointCorrupt(name, MANIFEST, f"unreadable ({exc})") from None
    if manifest.format_version > FORMAT_VERSION:
        version = manifest.format_version
        raise CheckpointError(f"checkpoint {name} has format {version}, newer than this rewind reads")
    if problem := _shape_problem(name, manifest):
        raise CheckpointCorrupt(name, MANIFEST, problem)
    return manifest


def _shape_problem(name: str, manifest: Manifest) -> str:
    """What makes a manifest that decodes unusable ("" if nothing): its file entries are names read
    from an untrusted directory, so each must be a plain `<group>.safetensors` name, listed once, with
    a size and a sha256 a real file can have; the step must be the one the checkpoint's name gives."""
    prefix = name.split("-", 1)[0]
    if not prefix.isdigit() or int(prefix) != manifest.step:
        return f"records step {manifest.step}, the checkpoint's name says {prefix}"
    seen: set[str] = set()
    for entry in manifest.files:
        group = entry.name.removesuffix(SUFFIX)
        if not entry.name.endswith(SUFFIX) or not _GROUP_NAME.fullmatch(group):
            return f"file entry {entry.name!r} is not a plain <group>{SUFFIX} name"
        if entry.name in seen:
            return f"file entry {entry.name!r} is listed twice"
        seen.add(entry.name)
        if entry.num_bytes < 0 or not _SHA256.fullmatch(entry.sha256):
            return f"file entry {entry.name!r} has an impossible size or sha256"
    return ""


def deserialize_group(name: str, entry: FileEntry, data: bytes) -> dict[str, torch.Tensor]:
    """The tensors of one file of checkpoint `name`, its bytes checked against the manifest entry first."""
    if problem := hash_problem(hashlib.sha256(data).hexdigest(), entry):
        raise CheckpointCorrupt(name, entry.name, problem)
    import safetensors.torch

    tensors = safetensors.torch.load(data)
    # The hash matched, so only a buggy writer could get here; cheap enough to rule out anyway.
    expected = sorted((t.name, t.dtype, t.shape) for t in entry.tensors)
    if sorted((k, _dtype_name(t), list(t.shape)) for k, t in tensors.items()) != expected:
        raise CheckpointCorrupt(name, entry.name, "tensor names, dtypes or shapes differ from the manifest")
    return tensors


def hash_problem(digest: str, entry: FileEntry) -> str | None:
    """Why a file whose sha256 is `digest` is not the one `entry` records, or None when it is."""
    return None if digest == entry.sha256 else f"sha256 {digest} != manifest {entry.sha256}"


def logged_file_problems(manifest: Manifest, files: Mapping[str, str] | None) -> list[tuple[str, str]]:
    """Differences between the manifest's file hashes and those the log recorded, as (file, problem)."""
    if files is None:
        return []
    actual = manifest.file_hashes()
    problems = [(file, "logged but not in the manifest") for file in sorted(set(files) - set(actual))]
    for file, digest in sorted(actual.items()):
        if file not in files:
            problems.append((file, "in the manifest but not named by the log"))
        elif digest != files[file]:
            problems.append((file, f"manifest sha256 {digest} != logged {files[file]}"))
    return problems
