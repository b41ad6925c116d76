"""Writing a prepared directory (its layout and reading: rewind.stores.datamanifest) all at once.

`PreparedWriter` fills a temporary sibling directory (`.DIR.tmp-*`), syncs every file and the
directory, writes the manifest last, and only then renames it to DIR: a crash mid-way never leaves a
DIR that looks complete. A non-empty DIR is replaced only when asked (overwrite), and put back as it
was if the rename fails. Each split's sha256 is computed from the bytes as they are written.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping

import numpy as np

from rewind.states.data_identity import SourceFile
from rewind.stores.datamanifest import (
    DTYPES,
    MANIFEST_FILE,
    SPLIT_FILES,
    TOKENIZER_FILE,
    DataManifest,
    ManifestError,
    TokenFile,
    encode_manifest,
    location_of,
    rewind_version,
)
from rewind.stores.fsio import fsync_dir, sync_fd, write_new_file


class _SplitFile:
    def __init__(self, path: str):
        self.path = path
        self.handle = open(path, "xb")  # noqa: SIM115 (closed by commit / abort)
        self.digest = hashlib.sha256()
        self.num_tokens = 0

    def append(self, tokens: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(tokens)).cast("B")
        self.digest.update(data)
        self.handle.write(data)
        self.num_tokens += tokens.size

    def finish(self) -> None:
        self.handle.flush()
        sync_fd(self.handle.fileno())
        self.handle.close()


class PreparedWriter:
    """Writes a prepared directory all at once (see the module doc). Use as a context manager: an
    exception inside it removes the temporary directory and leaves `out_dir` as it was.

        with PreparedWriter(out_dir, dtype="uint16") as writer:
            writer.append("train", tokens)  # as many times as needed, per split
            manifest = writer.commit(...)
    """

    def __init__(self, out_dir: str | os.PathLike[str], *, dtype: str, overwrite: bool = False):
        location = location_of(out_dir)
        if not location.is_local:
            raise ManifestError(
                f"{out_dir}: a prepared directory is written on a local filesystem (it is "
                "renamed into place, which object stores cannot do)"
            )
        if dtype not in DTYPES:
            raise ManifestError(f"unknown token dtype {dtype!r} (expected uint16 or uint32)")
        self.out_dir = location.path
        self.dtype = DTYPES[dtype]
        self.dtype_name = dtype
        self.overwrite = overwrite
        parent, name = os.path.split(self.out_dir)
        os.makedirs(parent, exist_ok=True)
        self._tmp = os.path.join(parent, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        os.mkdir(self._tmp)
        self._files: dict[str, _SplitFile] = {}
        self._done = False

    def __enter__(self) -> PreparedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._done:
            self.abort()

    def append(self, split: str, tokens: np.ndarray) -> None:
        """Add tokens at the end of `split`'s file. An id the dtype cannot hold is an error, never
        wrapped around (the caller's vocabulary check makes it impossible; this makes it certain)."""
        if split not in SPLIT_FILES:
            raise ManifestError(f"unknown split {split!r} (expected one of {', '.join(SPLIT_FILES)})")
        tokens = np.asarray(tokens)
        if tokens.dtype != self.dtype and tokens.size:
            low, high = int(tokens.min()), int(tokens.max())
            if low < 0 or high > np.iinfo(self.dtype).max:
                raise ManifestError(f"token id {high if low >= 0 else low} does not fit {self.dtype_name}")
        if split not in self._files:
            self._files[split] = _SplitFile(os.path.join(self._tmp, SPLIT_FILES[split]))
        self._files[split].append(tokens.astype(self.dtype, copy=False))

    def num_tokens(self, split: str) -> int:
        return self._files[split].num_tokens if split in self._files else 0

    def commit(
        self,
        *,
        input_kind: str,
        text_field: str,
        vocab_size: int,
        tokenizer_json: str | None,
        separator: list[int],
        sources: list[SourceFile],
        validation_sources: Iterable[SourceFile] = (),
        num_documents: Mapping[str, int],
    ) -> DataManifest:
        """Sync everything, write the manifest and rename the directory into place."""
        if "train" not in self._files:
            self.append("train", np.zeros(0, dtype=self.dtype))
        splits = {}
        for split, file in self._files.items():
            file.finish()
            splits[split] = TokenFile(
                file=SPLIT_FILES[split],
                num_tokens=file.num_tokens,
                num_documents=int(num_documents.get(split, 0)),
                size=file.num_tokens * self.dtype.itemsize,
                sha256=file.digest.hexdigest(),
            )
        tokenizer = ""
        if tokenizer_json is not None:
            data = tokenizer_json.encode("utf-8")
            tokenizer = hashlib.sha256(data).hexdigest()
            write_new_file(os.path.join(self._tmp, TOKENIZER_FILE), data)
        manifest = DataManifest(
            input_kind=input_kind,
            text_field=text_field,
            dtype=self.dtype_name,  # type: ignore[arg-type]
            vocab_size=vocab_size,
            tokenizer=tokenizer,
            separator=list(separator),
            sources=list(sources),
            validation_sources=list(validation_sources),
            splits=splits,
            created_by=rewind_version(),
        )
        write_new_file(os.path.join(self._tmp, MANIFEST_FILE), encode_manifest(manifest))
        fsync_dir(self._tmp)
        self._move_into_place()
        self._done = True
        return manifest

    def _move_into_place(self) -> None:
        parent, name = os.path.split(self.out_dir)
        old = None
        if os.path.lexists(self.out_dir) and (not os.path.isdir(self.out_dir) or os.listdir(self.out_dir)):
            if not self.overwrite:
                raise ManifestError(f"{self.out_dir}: exists and is not empty")
            old = os.path.join(parent, f".{name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            os.rename(self.out_dir, old)
        # rename() replaces an empty directory in one step, and refuses a non-empty one.
        try:
            os.rename(self._tmp, self.out_dir)
        except BaseException:
            if old is not None:  # put the previous one back: replaced, or as it was, never neither
                with contextlib.suppress(OSError):
                    os.rename(old, self.out_dir)
            raise
        fsync_dir(parent)
        if old is not None:
            _remove(old)

    def abort(self) -> None:
        for file in self._files.values():
            with contextlib.suppress(OSError):
                file.handle.close()
        _remove(self._tmp)
        self._done = True


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


def write_prepared(
    out_dir: str | os.PathLike[str],
    splits: Mapping[str, Iterable[np.ndarray] | np.ndarray],
    *,
    dtype: str,
    num_documents: Mapping[str, int],
    overwrite: bool = False,
    **manifest_fields,
) -> DataManifest:
    """Write a whole prepared directory at once: each split's tokens (an array, or arrays written one
    after another), then the manifest (`manifest_fields`: PreparedWriter.commit's keywords)."""
    with PreparedWriter(out_dir, dtype=dtype, overwrite=overwrite) as writer:
        for split, parts in splits.items():
            for part in [parts] if isinstance(parts, np.ndarray) else parts:
                writer.append(split, part)
        return writer.commit(num_documents=num_documents, **manifest_fields)
