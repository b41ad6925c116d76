"""The checkpoint store: tensors on disk, each file pinned by its sha256.

A checkpoint is a directory `RUN/checkpoints/<step:08d>-<short hash>/`: one safetensors file per group
given (model, optimizer, reference, adapters) and a `manifest.json` with every file's sha256 and every
tensor's name, shape, dtype and raw-bytes sha256 (little-endian, as safetensors stores them). The short
hash is the start of the manifest's own sha256 and the manifest holds no time or uuid, so the same
tensors and meta at the same step always get the same name.

A checkpoint exists for rewind only once a CheckpointCommitted event names it, so a write that dies half
way must leave nothing that passes for one: locally, files go into `checkpoints/.tmp-*`, are fsynced,
and the directory is renamed into place; object stores have no atomic rename, so there the manifest is
written last and a directory without one is incomplete. What the log does not name is an orphan. Reading
never unpickles: bytes are hashed, then parsed by `safetensors.torch.load`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import safetensors.torch
import torch

from rewind.stores.fsio import filesystem, fsync_dir, sync_fd, write_all

FORMAT_VERSION = 1
GROUPS = ("model", "optimizer", "reference", "adapters")
MANIFEST = "manifest.json"
CHECKPOINTS_DIR = "checkpoints"
SUFFIX = ".safetensors"
TMP_PREFIX = ".tmp-"
NAME_PATTERN = re.compile(r"\d{8,}-[0-9a-f]{8}")
_FLOAT_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
SUPPORTED_DTYPES = frozenset({*_FLOAT_DTYPES, *_INTEGER_DTYPES})
_CHUNK_BYTES = 1 << 22
GroupsIn = Mapping[str, Mapping[str, torch.Tensor]]  # group -> tensor name -> tensor


class CheckpointError(Exception):
    """A checkpoint cannot be written or read as asked."""


class CheckpointNotFound(CheckpointError):
    """No directory of that name: never written, deleted, or the wrong run."""


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


class CheckpointWritten(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine puts in its CheckpointCommitted event once `write` returns."""

    name: str
    manifest_sha256: str
    files: dict[str, str]


class CheckpointStore:
    """Checkpoints of one run, under `run_dir` (a local path or an fsspec URL such as `memory://...`)."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        location = filesystem(run_dir).join(CHECKPOINTS_DIR)
        self._fs, self.root, self._is_local = location.fs, location.path, location.is_local

    def write(self, step: int, groups: GroupsIn, meta: Mapping[str, Any] | None = None) -> CheckpointWritten:
        """Write a checkpoint durably and return its name and hashes; only then may the log name it."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint step must be a non-negative int, got {step!r}")
        if not groups or not set(groups) <= set(GROUPS):
            raise CheckpointError(
                f"checkpoint groups must be some of {', '.join(GROUPS)}; got {sorted(groups)}"
            )
        canonical_meta = _canonical_meta(meta or {})
        # Files in name order, so the manifest (and hence the name) never depends on dict order.
        # Every tensor is checked before the first byte is written: bad input leaves nothing behind.
        ordered = [(group, _checked_tensors(group, tensors)) for group, tensors in sorted(groups.items())]
        if self._is_local:
            return self._write_local(step, ordered, canonical_meta)
        return self._write_object_store(step, ordered, canonical_meta)

    def _write_local(self, step: int, ordered: list, meta: dict[str, Any]) -> CheckpointWritten:
        _make_dirs_durably(self.root)
        tmp = _join(self.root, f"{TMP_PREFIX}{step:08d}-{os.urandom(8).hex()}")
        os.mkdir(tmp)
        try:
            entries = []
            for group, tensors in ordered:
                # One group in memory at a time: a model's optimizer state can be large.
                data, entry = _serialize(group, tensors)
                _write_file_durably(_join(tmp, entry.name), data)
                entries.append(entry)
            manifest_bytes, written = _manifest(step, entries, meta)
            _write_file_durably(_join(tmp, MANIFEST), manifest_bytes)
            fsync_dir(tmp)
        except Exception:  # e.g. a full disk; a killed process leaves the orphan for remove_orphans
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        final = _join(self.root, written.name)
        if os.path.isdir(final):
            # Same name = same content by construction, e.g. a step rewritten after a resume.
            if not self.verify(written.name, written.files):
                shutil.rmtree(tmp)
                return written
            _remove_local_dir(final, self.root)  # a damaged copy under this name: replace it
        os.rename(tmp, final)
        fsync_dir(self.root)
        return written

    def _write_object_store(self, step: int, ordered: list, meta: dict[str, Any]) -> CheckpointWritten:
        # The name depends on every file's hash, and there is no rename to fix it up afterwards, so
        # all files are serialized in memory before the first byte is written.
        payloads = [_serialize(group, tensors) for group, tensors in ordered]
        manifest_bytes, written = _manifest(step, [entry for _, entry in payloads], meta)
        final = _join(self.root, written.name)
        if self._fs.exists(_join(final, MANIFEST)) and not self.verify(written.name, written.files):
            return written
        self._fs.makedirs(final, exist_ok=True)
        for data, entry in payloads:
            self._fs.pipe_file(_join(final, entry.name), data)
        self._fs.pipe_file(_join(final, MANIFEST), manifest_bytes)  # last: marks the checkpoint complete
        return written

    def load_manifest(self, name: str) -> Manifest:
        """The manifest, checked against the hash embedded in the checkpoint's name."""
        data = self._read(name, MANIFEST)
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
        return manifest

    def load(
        self,
        name: str,
        files: Mapping[str, str] | None = None,
        groups: Iterable[str] | None = None,
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Tensors per group, every file verified against the manifest and against `files` (the hashes
        the CheckpointCommitted event recorded) when given. `groups` limits what is read."""
        manifest = self.load_manifest(name)
        for file, problem in _expected_file_problems(manifest, files):
            raise CheckpointCorrupt(name, file, problem)  # the first one says enough
        entries = {entry.name.removesuffix(SUFFIX): entry for entry in manifest.files}
        wanted = list(entries) if groups is None else list(groups)
        result: dict[str, dict[str, torch.Tensor]] = {}
        for group in wanted:
            if group not in entries:
                raise CheckpointError(f"checkpoint {name} has no {group!r} group (has: {', '.join(entries)})")
            entry = entries[group]
            data = self._read(name, entry.name)
            if problem := _hash_problem(hashlib.sha256(data).hexdigest(), entry):
                raise CheckpointCorrupt(name, entry.name, problem)
            tensors = safetensors.torch.load(data)
            # The hash matched, so only a buggy writer could get here; cheap enough to rule out anyway.
            expected = sorted((t.name, t.dtype, t.shape) for t in entry.tensors)
            if sorted((k, _dtype_name(t), list(t.shape)) for k, t in tensors.items()) != expected:
                raise CheckpointCorrupt(
                    name, entry.name, "tensor names, dtypes or shapes differ from the manifest"
                )
            result[group] = tensors
        return result

    def verify(self, name: str, files: Mapping[str, str] | None = None) -> list[str]:
        """Every problem found (missing directory or file, hash mismatch), as lines; never raises."""
        try:
            manifest = self.load_manifest(name)
        except CheckpointError as exc:
            return [str(exc)]
        found = _expected_file_problems(manifest, files)
        for entry in manifest.files:
            try:
                problem = _hash_problem(self._hash_file(_join(self.root, name, entry.name)), entry)
            except FileNotFoundError:
                problem = "missing"
            if problem:
                found.append((entry.name, problem))
        return [str(CheckpointCorrupt(name, file, problem)) for file, problem in found]

    def names_on_disk(self) -> list[str]:
        """Every directory under checkpoints/ that rewind could have made (checkpoints and temporaries)."""
        try:
            listing = self._fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        bases = [os.path.basename(i["name"].rstrip("/")) for i in listing if i["type"] == "directory"]
        return sorted(base for base in bases if base.startswith(TMP_PREFIX) or NAME_PATTERN.fullmatch(base))

    def orphans(self, committed_names: Iterable[str]) -> list[str]:
        """Directories the log does not name (incomplete writes, temporaries, checkpoints of superseded
        steps). Call with the run lock held: a concurrent writer's temporary looks like an orphan."""
        committed = set(committed_names)
        return [name for name in self.names_on_disk() if name.startswith(TMP_PREFIX) or name not in committed]

    def remove_orphans(self, committed_names: Iterable[str]) -> list[str]:
        removed = self.orphans(committed_names)
        for name in removed:
            self._remove(name)
        return removed

    def delete(self, name: str) -> None:
        """Remove a checkpoint; deleting one that is already gone is not an error (crash recovery)."""
        _check_name(name)
        self._remove(name)

    def _remove(self, base: str) -> None:
        path = _join(self.root, base)
        if self._is_local:
            if os.path.isdir(path):
                _remove_local_dir(path, self.root)
            return
        if self._fs.exists(path):
            # Manifest first, so a half-deleted checkpoint reads as incomplete, never as complete.
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(_join(path, MANIFEST))
            self._fs.rm(path, recursive=True)

    def _read(self, name: str, file: str) -> bytes:
        _check_name(name)
        directory = _join(self.root, name)
        try:
            return self._fs.cat_file(_join(directory, file))
        except FileNotFoundError:
            if not self._fs.isdir(directory):
                raise CheckpointNotFound(f"checkpoint {name} not found under {self.root}") from None
            raise CheckpointCorrupt(name, file, "missing") from None

    def _hash_file(self, path: str) -> str:
        digest = hashlib.sha256()
        with self._fs.open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK_BYTES):
                digest.update(chunk)
        return digest.hexdigest()


def group_file(group: str, tensors: Mapping[str, torch.Tensor]) -> tuple[str, str]:
    """(file name, sha256) that a checkpoint holding these tensors records for the group: a re-execution
    can check its live tensors against a CheckpointCommitted event even after retention deleted the files."""
    _, entry = _serialize(group, _checked_tensors(group, tensors))
    return entry.name, entry.sha256


def _join(*parts: str) -> str:
    # fsspec paths are "/"-separated on every platform and for every protocol.
    return "/".join(part.rstrip("/") if i == 0 else part.strip("/") for i, part in enumerate(parts))


def _check_name(name: str) -> None:
    # Also keeps "../x" and absolute paths from ever reaching the filesystem.
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise CheckpointError(f"{name!r} is not a checkpoint name (expected <step:08d>-<8 hex digits>)")


def _canonical_meta(meta: Mapping[str, Any]) -> dict[str, Any]:
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


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")  # "bfloat16", as in the manifest


def _tensor_sha256(tensor: torch.Tensor) -> str:
    # Flattened first: a 0-dim tensor cannot be viewed as bytes, a 1-dim one can (even when empty).
    return hashlib.sha256(tensor.reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _checked_tensors(group: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    checked: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        where = f"{group}/{key}"
        if not isinstance(key, str) or not key:
            raise CheckpointError(f"tensor names must be non-empty strings, got {key!r} in group {group}")
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{where} is a {type(tensor).__name__}, not a tensor")
        if tensor.device.type != "cpu" or tensor.layout != torch.strided:
            raise CheckpointError(f"{where} must be a dense CPU tensor, not {tensor.device} {tensor.layout}")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise CheckpointError(f"{where} has dtype {tensor.dtype}, which checkpoints do not store")
        if not tensor.is_contiguous():
            raise CheckpointError(f"{where} is not contiguous (snapshot tensors with .contiguous())")
        checked[key] = tensor.detach()  # safetensors goes through numpy, which refuses requires_grad
    return checked


def _serialize(group: str, checked: dict[str, torch.Tensor]) -> tuple[bytes, FileEntry]:
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


def _manifest(step: int, entries: list[FileEntry], meta: dict[str, Any]) -> tuple[bytes, CheckpointWritten]:
    manifest = Manifest(format_version=FORMAT_VERSION, step=step, files=entries, meta=meta)
    # "deterministic" sorts dict keys (meta), so equal content always gives equal bytes.
    encoded = msgspec.json.encode(manifest, order="deterministic")
    data = msgspec.json.format(encoded, indent=2) + b"\n"
    digest = hashlib.sha256(data).hexdigest()
    name = f"{step:08d}-{digest[:8]}"
    return data, CheckpointWritten(name=name, manifest_sha256=digest, files=manifest.file_hashes())


def _hash_problem(digest: str, entry: FileEntry) -> str | None:
    return None if digest == entry.sha256 else f"sha256 {digest} != manifest {entry.sha256}"


def _expected_file_problems(manifest: Manifest, files: Mapping[str, str] | None) -> list[tuple[str, str]]:
    """Differences between the manifest's file hashes and those the log recorded."""
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


def _write_file_durably(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data)
        sync_fd(fd)
    finally:
        os.close(fd)


def _make_dirs_durably(path: str) -> None:
    # checkpoints/ itself must survive a power cut, or so would none of the checkpoints in it.
    if not os.path.isdir(path):
        os.makedirs(path, exist_ok=True)
        fsync_dir(os.path.dirname(path))


def _remove_local_dir(path: str, root: str) -> None:
    # Rename out of the way first: if we die mid-delete, what is left is a .tmp- orphan, not a
    # checkpoint with files missing.
    doomed = _join(root, f"{TMP_PREFIX}deleted-{os.urandom(8).hex()}")
    os.rename(path, doomed)
    fsync_dir(root)
    shutil.rmtree(doomed)
