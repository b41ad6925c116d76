"""Frozen trunk weights, written once and shared by every checkpoint that holds them.

Once a stack of a growing model is frozen (or quantised to NF4), its base weights never change again,
so rewriting them at every checkpoint interval would only cost time and disk. They go to
`RUN/trunks/<sha256>.safetensors` instead, named by the sha256 of their bytes: a checkpoint's manifest
lists the hash of each frozen stack's file (`meta["trunks"]`), and the manifest itself is pinned by the
CheckpointCommitted event, so the log pins the trunk too. Loading checks the bytes against the name.
An NF4 stack stores its float weights here, from which quantisation is redone on load.

Files are never rewritten (same name = same bytes) and never deleted with a checkpoint: several
checkpoints share them. Writing is durable before a checkpoint may name the file (temporary name,
sync, rename locally; on object stores the content-addressed name makes a half-written object
detectable by its hash).
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import TYPE_CHECKING

from rewind.stores import confine, temporaries
from rewind.stores.checkpoints import CheckpointCorrupt, CheckpointError, CheckpointStore
from rewind.stores.fsio import filesystem, fsync_dir
from rewind.stores.manifest import checked_tensors

if TYPE_CHECKING:
    import torch  # annotations only: `rewind verify` checks trunk files without torch

TRUNKS_DIR = "trunks"
SUFFIX = ".safetensors"
_SHA256 = re.compile(r"[0-9a-f]{64}")


def serialize(tensors: dict[str, torch.Tensor]) -> tuple[bytes, str]:
    """(bytes, sha256) of a trunk file: the same tensors always give the same bytes."""
    import safetensors.torch

    checked = checked_tensors("trunk", dict(sorted(tensors.items())))
    data = safetensors.torch.save(checked)
    return data, hashlib.sha256(data).hexdigest()


class TrunkStore:
    def __init__(self, run_dir: str | os.PathLike[str]):
        run = filesystem(run_dir)
        self._location = run.join(TRUNKS_DIR)
        self._fs, self.root, self._is_local = self._location.fs, self._location.path, self._location.is_local
        self._run_root = run.path

    def _path(self, digest: str) -> str:
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise CheckpointError(f"{digest!r} is not a trunk file name (a sha256)")
        return f"{self.root.rstrip('/')}/{digest}{SUFFIX}"

    def exists(self, digest: str) -> bool:
        return bool(self._fs.exists(self._path(digest)))

    def write(self, data: bytes, digest: str) -> None:
        """Store `data` under its hash `digest` unless a good copy is there already (atomically and
        durably: fsio's write_atomic, the directory made durable first)."""
        if hashlib.sha256(data).hexdigest() != digest:
            raise CheckpointError("trunk bytes do not match the hash they are stored under")
        self._path(digest)  # checks the name
        if self.exists(digest):
            try:
                self.read(digest)
                return
            except CheckpointError:
                pass  # a damaged copy: write it again
        if self._is_local and not os.path.isdir(self.root):
            self._location.makedirs()
            fsync_dir(os.path.dirname(self.root))
        elif not self._is_local:
            self._location.makedirs()
        self._location.join(f"{digest}{SUFFIX}").write_atomic(data)
        if self._is_local:
            # What a killed writer left (only the run's lock holder writes here, so none is in flight):
            # rewind's own temporaries by their exact names, never a file of someone else's.
            temporaries.remove(self._run_root, (TRUNKS_DIR,))

    def load(self, digest: str) -> dict[str, torch.Tensor]:
        """The tensors of trunk file `digest`, after checking its bytes hash to its name."""
        import safetensors.torch

        return safetensors.torch.load(self.read(digest))

    def copy_to(self, other: TrunkStore, digest: str) -> None:
        """Store trunk file `digest` in another run directory too (a fork's), verified on the way."""
        other.write(self.read(digest), digest)

    def read(self, digest: str) -> bytes:
        """The bytes of trunk file `digest`, checked to hash to its name."""
        path = self._path(digest)
        name = f"{TRUNKS_DIR}/{digest[:12]}"
        try:
            if self._is_local:
                data = confine.read_file(self._run_root, [TRUNKS_DIR, f"{digest}{SUFFIX}"])
            else:
                data = self._fs.cat_file(path)
        except FileNotFoundError:
            raise CheckpointCorrupt(name, f"{digest}{SUFFIX}", "missing") from None
        except confine.NotConfined as exc:
            raise CheckpointCorrupt(name, f"{digest}{SUFFIX}", str(exc)) from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise CheckpointCorrupt(name, f"{digest}{SUFFIX}", "its bytes do not hash to its name")
        return data


def checkpoint_weights(run_dir: str, name: str, files: dict[str, str] | None) -> dict[str, dict[str, torch.Tensor]]:
    """A checkpoint's model by role, whole: `model` holds every base weight (its own and the frozen
    stacks' from RUN/trunks/), `adapters` the LoRA tensors (empty without). Unwrapped names."""
    store = CheckpointStore(run_dir)
    manifest = store.load_manifest(name)
    present = {entry.name.removesuffix(SUFFIX) for entry in manifest.files}
    groups = store.load(name, files, groups=[g for g in ("model", "adapters") if g in present])
    weights = dict(groups["model"])
    trunks = TrunkStore(run_dir)
    for digest in manifest.meta.get("trunks", {}).values():
        weights.update(trunks.load(digest))
    return {"model": weights, "adapters": dict(groups.get("adapters", {}))}
