"""The checkpoint store: where a checkpoint's files go, how they get there durably, and reading them back.

A checkpoint is a directory `RUN/checkpoints/<step:08d>-<short hash>/`: one safetensors file per group
given (model, optimizer, reference, adapters), a `manifest.json` pinning each file by its sha256 and, in
format 2, `written.json` saying how far the log reached when it was written. What those bytes are, and
the name they give the checkpoint, is `stores/manifest.py`; this module only writes, reads, verifies and
deletes them.

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
from typing import TYPE_CHECKING, Any

from rewind.stores import confine, temporaries
from rewind.stores.fsio import filesystem, fsync_dir, write_new_file
from rewind.stores.manifest import FORMAT_VERSION as FORMAT_VERSION
from rewind.stores.manifest import FORMAT_WITH_LOG_SEQ as FORMAT_WITH_LOG_SEQ
from rewind.stores.manifest import MANIFEST as MANIFEST
from rewind.stores.manifest import SUFFIX as SUFFIX
from rewind.stores.manifest import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from rewind.stores.manifest import WRITTEN as WRITTEN
from rewind.stores.manifest import CheckpointCorrupt as CheckpointCorrupt
from rewind.stores.manifest import CheckpointError as CheckpointError
from rewind.stores.manifest import CheckpointWritten as CheckpointWritten
from rewind.stores.manifest import FileEntry as FileEntry
from rewind.stores.manifest import Manifest as Manifest
from rewind.stores.manifest import TensorEntry as TensorEntry
from rewind.stores.manifest import (
    canonical_meta,
    checked_tensors,
    decode_manifest,
    decode_written,
    deserialize_group,
    encode_manifest,
    encode_written,
    hash_problem,
    logged_file_problems,
    serialize_group,
)
from rewind.stores.manifest import group_file as group_file
from rewind.stores.temporaries import TEMPORARIES, is_temporary

if TYPE_CHECKING:
    import torch  # for annotations only: reading and verifying checkpoints never imports it

GROUPS = ("model", "optimizer", "reference", "adapters")
CHECKPOINTS_DIR = "checkpoints"
TMP_PREFIX = ".tmp-"
# Where resume moves complete checkpoints the log does not name: kept, never deleted, and out of the
# way of a rewrite under the same name. Not a checkpoint name, so nothing treats it as one.
ORPHANED_DIR = "orphaned"
NAME_PATTERN = re.compile(r"\d{8,}-[0-9a-f]{8}")
_CHUNK_BYTES = 1 << 22
# A manifest is a few hundred bytes per tensor: this is far beyond any real one, and keeps a forged
# one from taking the memory of the process that reads it.
MAX_MANIFEST_BYTES = 64 << 20
MAX_WRITTEN_BYTES = 4096
GroupsIn = Mapping[str, Mapping[str, "torch.Tensor"]]  # group -> tensor name -> tensor


class CheckpointNotFound(CheckpointError):
    """No directory of that name: never written, deleted, or the wrong run."""


class CheckpointStore:
    """Checkpoints of one run, under `run_dir` (a local path or an fsspec URL such as `memory://...`)."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        run = filesystem(run_dir)
        self.run_dir = run_dir
        location = run.join(CHECKPOINTS_DIR)
        self._fs, self.root, self._is_local = location.fs, location.path, location.is_local
        self._run_root = run.path  # what every local read is confined to

    def write(
        self,
        step: int,
        groups: GroupsIn,
        meta: Mapping[str, Any] | None = None,
        *,
        log_seq: int | None = None,
        format_version: int = FORMAT_VERSION,
    ) -> CheckpointWritten:
        """Write a checkpoint durably and return its name and hashes; only then may the log name it.
        `log_seq`: the last record durable in the log as it is written (None: not recorded, as in a fork's
        copy of its parent's checkpoint); format 2 keeps it beside the manifest, format 1 in its meta."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"checkpoint step must be a non-negative int, got {step!r}")
        if not groups or not set(groups) <= set(GROUPS):
            raise CheckpointError(
                f"checkpoint groups must be some of {', '.join(GROUPS)}; got {sorted(groups)}"
            )
        in_meta = format_version == FORMAT_WITH_LOG_SEQ and log_seq is not None
        checked_meta = canonical_meta({**(meta or {}), "log_seq": log_seq} if in_meta else meta or {})
        beside = encode_written(log_seq) if log_seq is not None and not in_meta else None
        # Files in name order, so the manifest (and hence the name) never depends on dict order.
        # Every tensor is checked before the first byte is written: bad input leaves nothing behind.
        ordered = [(group, checked_tensors(group, tensors)) for group, tensors in sorted(groups.items())]
        if self._is_local:
            return self._write_local(step, ordered, checked_meta, format_version, beside)
        return self._write_object_store(step, ordered, checked_meta, format_version, beside)

    def _write_local(
        self, step: int, ordered: list, meta: dict[str, Any], format_version: int, beside: bytes | None
    ) -> CheckpointWritten:
        _make_dirs_durably(self.root)
        tmp = _join(self.root, f"{TMP_PREFIX}{step:08d}-{os.urandom(8).hex()}")
        os.mkdir(tmp)
        try:
            entries = []
            for group, tensors in ordered:
                # One group in memory at a time: a model's optimizer state can be large.
                data, entry = serialize_group(group, tensors)
                write_new_file(_join(tmp, entry.name), data)
                entries.append(entry)
            manifest_bytes, written = encode_manifest(step, entries, meta, format_version)
            if beside is not None:
                write_new_file(_join(tmp, WRITTEN), beside)
            write_new_file(_join(tmp, MANIFEST), manifest_bytes)
            fsync_dir(tmp)
        except Exception:  # e.g. a full disk; a killed process leaves the orphan for remove_orphans
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        final = _join(self.root, written.name)
        if os.path.isdir(final):
            # Same name = same content by construction, e.g. a step rewritten after a resume (its
            # WRITTEN may date it earlier: still a true bound on how far the log reached).
            if not self.verify(written.name, written.files):
                shutil.rmtree(tmp)
                return written
            _remove_local_dir(final, self.root)  # a damaged copy under this name: replace it
        os.rename(tmp, final)
        fsync_dir(self.root)
        return written

    def _write_object_store(
        self, step: int, ordered: list, meta: dict[str, Any], format_version: int, beside: bytes | None
    ) -> CheckpointWritten:
        # The name depends on every file's hash, and there is no rename to fix it up afterwards, so
        # all files are serialized in memory before the first byte is written.
        payloads = [serialize_group(group, tensors) for group, tensors in ordered]
        entries = [entry for _, entry in payloads]
        manifest_bytes, written = encode_manifest(step, entries, meta, format_version)
        final = _join(self.root, written.name)
        if self._fs.exists(_join(final, MANIFEST)) and not self.verify(written.name, written.files):
            return written
        self._fs.makedirs(final, exist_ok=True)
        for data, entry in payloads:
            self._fs.pipe_file(_join(final, entry.name), data)
        if beside is not None:
            self._fs.pipe_file(_join(final, WRITTEN), beside)
        self._fs.pipe_file(_join(final, MANIFEST), manifest_bytes)  # last: marks the checkpoint complete
        return written

    def load_manifest(self, name: str) -> Manifest:
        """The manifest, checked against the hash embedded in the checkpoint's name."""
        return decode_manifest(name, self._read(name, MANIFEST, max_size=MAX_MANIFEST_BYTES))

    def log_seq(self, name: str, manifest: Manifest) -> int | None:
        """How far the log reached when checkpoint `name` (whose `manifest` was loaded) was written: the
        last record durable then, or None where nothing (readable) records it: a release before
        `log_seq`, a fork's copy, a damaged or missing WRITTEN file."""
        if manifest.format_version == FORMAT_WITH_LOG_SEQ:
            recorded = manifest.meta.get("log_seq")
            readable = isinstance(recorded, int) and not isinstance(recorded, bool) and recorded >= -1
            return recorded if readable else None
        try:
            return decode_written(self._read(name, WRITTEN, max_size=MAX_WRITTEN_BYTES))
        except CheckpointError:  # missing, too large, not a regular file
            return None

    def load(
        self,
        name: str,
        files: Mapping[str, str] | None = None,
        groups: Iterable[str] | None = None,
    ) -> dict[str, dict[str, torch.Tensor]]:
        """Tensors per group, every file verified against the manifest and against `files` (the hashes
        the CheckpointCommitted event recorded) when given. `groups` limits what is read."""
        manifest = self.load_manifest(name)
        for file, problem in logged_file_problems(manifest, files):
            raise CheckpointCorrupt(name, file, problem)  # the first one says enough
        entries = {entry.name.removesuffix(SUFFIX): entry for entry in manifest.files}
        wanted = list(entries) if groups is None else list(groups)
        result: dict[str, dict[str, torch.Tensor]] = {}
        for group in wanted:
            if group not in entries:
                raise CheckpointError(f"checkpoint {name} has no {group!r} group (has: {', '.join(entries)})")
            entry = entries[group]
            result[group] = deserialize_group(name, entry, self._read(name, entry.name, expected_size=entry.num_bytes))
        return result

    def verify(self, name: str, files: Mapping[str, str] | None = None) -> list[str]:
        """Every problem found (missing directory or file, hash mismatch), as lines; never raises."""
        try:
            manifest = self.load_manifest(name)
        except CheckpointError as exc:
            return [str(exc)]
        found = logged_file_problems(manifest, files)
        for entry in manifest.files:
            try:
                problem = hash_problem(self._hash_file(name, entry), entry)
            except FileNotFoundError:
                problem = "missing"
            except confine.NotConfined as exc:
                problem = str(exc)
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
        return sorted(base for base in bases if is_temporary(CHECKPOINTS_DIR, base) or NAME_PATTERN.fullmatch(base))

    def orphans(self, committed_names: Iterable[str]) -> list[str]:
        """Directories the log does not name (incomplete writes, temporaries, checkpoints of superseded
        steps). Call with the run lock held: a concurrent writer's temporary looks like an orphan."""
        committed = set(committed_names)
        return [name for name in self.names_on_disk() if name not in committed]

    def set_aside_orphans(self, committed_names: Iterable[str]) -> tuple[list[str], list[str]]:
        """(removed, moved): this store's own temporaries are removed (nothing was ever committed from
        them, or their deletion was on record), every other orphan is moved under `orphaned/`, never
        deleted: a checkpoint the log does not name may be one whose record was lost. Lock held: a
        resume calls this once its RunResumed is on record, and so it also removes the temporaries a
        killed writer left in the run's other directories (rewind.stores.temporaries; `removed` names
        those by their path in the run)."""
        removed, moved = [], []
        for name in self.orphans(committed_names):
            if is_temporary(CHECKPOINTS_DIR, name):
                self._remove(name)
                removed.append(name)
            else:
                self._set_aside(name)
                moved.append(name)
        removed += temporaries.remove(str(self.run_dir), tuple(d for d in TEMPORARIES if d != CHECKPOINTS_DIR))
        return removed, moved

    def set_aside_names(self) -> list[str]:
        """What resumes moved under `orphaned/` so far."""
        try:
            listing = self._fs.ls(_join(self.root, ORPHANED_DIR), detail=False)
        except FileNotFoundError:
            return []
        return sorted(os.path.basename(str(path).rstrip("/")) for path in listing)

    def _set_aside(self, name: str) -> None:
        aside = _join(self.root, ORPHANED_DIR)
        target, num_taken = _join(aside, name), 0
        while self._fs.exists(target):  # an earlier orphan of the same name: keep both
            num_taken += 1
            target = _join(aside, f"{name}.{num_taken}")
        if self._is_local:
            _make_dirs_durably(aside)
            os.rename(_join(self.root, name), target)
            fsync_dir(self.root)
            return
        self._fs.mv(_join(self.root, name), target, recursive=True)

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

    def _read(self, name: str, file: str, *, expected_size: int | None = None, max_size: int | None = None) -> bytes:
        _check_name(name)
        directory = _join(self.root, name)
        try:
            if self._is_local:
                where = [CHECKPOINTS_DIR, name, file]
                return confine.read_file(self._run_root, where, expected_size=expected_size, max_size=max_size)
            path = _join(directory, file)
            size = self._fs.size(path)  # checked before reading, as confine does locally
            limit = expected_size if expected_size is not None else max_size
            if limit is not None and size > limit:
                raise CheckpointCorrupt(name, file, f"{size:,} bytes, more than the {limit:,} it may have")
            return self._fs.cat_file(path)
        except confine.NotConfined as exc:
            raise CheckpointCorrupt(name, file, str(exc)) from None
        except FileNotFoundError:
            if not self._fs.isdir(directory):
                raise CheckpointNotFound(f"checkpoint {name} not found under {self.root}") from None
            raise CheckpointCorrupt(name, file, "missing") from None

    def _hash_file(self, name: str, entry: FileEntry) -> str:
        if self._is_local:
            return confine.hash_file(self._run_root, [CHECKPOINTS_DIR, name, entry.name], expected_size=entry.num_bytes)
        digest = hashlib.sha256()
        with self._fs.open(_join(self.root, name, entry.name), "rb") as handle:
            while chunk := handle.read(_CHUNK_BYTES):
                digest.update(chunk)
        return digest.hexdigest()


def _join(*parts: str) -> str:
    # fsspec paths are "/"-separated on every platform and for every protocol.
    return "/".join(part.rstrip("/") if i == 0 else part.strip("/") for i, part in enumerate(parts))


def _check_name(name: str) -> None:
    # Also keeps "../x" and absolute paths from ever reaching the filesystem.
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise CheckpointError(f"{name!r} is not a checkpoint name (expected <step:08d>-<8 hex digits>)")


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
