"""A prepared directory: documents tokenised once by `rewind data prepare` (or at a run's start), ready
to be memory-mapped by a dataset of kind "tokens".

    DIR/manifest.json    DataManifest: where the tokens came from and what they are
    DIR/train.bin        flat little-endian token ids (dtype below), documents joined by the
                         separator, nothing after the last
    DIR/validation.bin   the same for the validation inputs, when there were any
    DIR/tokenizer.json   a copy of the tokenizer that made them (absent for UTF-8 bytes)

A prepared directory is complete or absent: `PreparedWriter` fills a temporary sibling directory,
fsyncs every file and the directory, and only then renames it to DIR, so a crash mid-way never leaves
a DIR that looks complete (at worst a `.DIR.tmp-*` sibling, which nothing reads). The manifest's own
sha256 (`manifest_hash`) is what a run records as the dataset's `prepared` identity.

A prepared directory is user data (another machine's, a download): its files are read only if they are
regular files, the manifest and tokenizer copy whole up to a cap each (MAX_MANIFEST_BYTES,
MAX_TOKENIZER_BYTES), token files in bounded pieces; what is refused is a ManifestError of one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterable, Mapping
from importlib import metadata
from typing import Literal

import msgspec
import numpy as np

from rewind.states.data_identity import SourceFile
from rewind.stores.fsio import (
    FilesystemUnavailable,
    Location,
    decode_json,
    filesystem,
    fsync_dir,
    open_regular,
    sync_fd,
    write_new_file,
)

FORMAT = 1
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLIT_FILES = {"train": "train.bin", "validation": "validation.bin"}
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_HASH_CHUNK = 8 * 1024 * 1024
# The most a manifest may hold: about 250 bytes per source file, so a few hundred thousand inputs.
MAX_MANIFEST_BYTES = 64 << 20
# The most a tokenizer.json may hold, here and wherever rewind reads one: the largest public ones (262k
# ids with their merges) are a few tens of MB.
MAX_TOKENIZER_BYTES = 256 << 20


class ManifestError(Exception):
    """A prepared directory cannot be read or written as asked (one line, naming the directory)."""


class TokenFile(msgspec.Struct, frozen=True, kw_only=True):
    """One split's token file: its name in DIR, how many tokens and documents it holds, its size in
    bytes and sha256."""

    file: str
    num_tokens: int
    num_documents: int
    size: int
    sha256: str


class DataManifest(msgspec.Struct, frozen=True, kw_only=True):
    """What a prepared directory holds. `tokenizer`: sha256 of its tokenizer.json ("" = UTF-8 bytes);
    `separator`: the token ids between two documents; `sources`: the input files (full sha256)."""

    format: int = FORMAT
    input_kind: str
    text_field: str
    dtype: Literal["uint16", "uint32"]
    vocab_size: int
    tokenizer: str
    separator: list[int]
    sources: list[SourceFile]
    validation_sources: list[SourceFile] = []
    splits: dict[str, TokenFile]
    created_by: str = ""


def dtype_for(vocab_size: int) -> str:
    """The smallest token dtype that holds every id below `vocab_size`."""
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise ManifestError(f"a vocabulary of {vocab_size} ids does not fit in uint32 token files")


def rewind_version() -> str:
    try:
        return f"rewind {metadata.version('rewind')}"
    except metadata.PackageNotFoundError:  # a checkout that was never installed
        return "rewind 0+unknown"


def encode_manifest(manifest: DataManifest) -> bytes:
    """The manifest as written: indented JSON, fields in declaration order (so the same manifest always
    gives the same bytes, and the same `manifest_hash`)."""
    return msgspec.json.format(msgspec.json.encode(manifest), indent=1) + b"\n"


def _location(directory: str | os.PathLike[str]) -> Location:
    try:
        return filesystem(os.path.expanduser(os.fspath(directory)))
    except FilesystemUnavailable as exc:
        raise ManifestError(str(exc)) from None


def manifest_bytes(directory: str | os.PathLike[str]) -> bytes:
    """DIR/manifest.json as it is on disk (ManifestError when it cannot be read)."""
    location = _location(directory)
    try:
        return location.join(MANIFEST_FILE).read_bounded(MAX_MANIFEST_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        raise ManifestError(f"{directory}: not a prepared data directory (no {MANIFEST_FILE})") from None
    except OSError as exc:
        raise ManifestError(f"{directory}: cannot read {MANIFEST_FILE}: {exc.strerror or exc}") from None


def decode_manifest(data: bytes, where: str) -> DataManifest:
    """Parse manifest bytes, refusing a newer format and anything whose file names are not the
    expected ones (a manifest is user data: it must never name a path outside its directory)."""
    try:
        raw = decode_json(data)
    except msgspec.DecodeError as exc:
        raise ManifestError(f"{where}: {MANIFEST_FILE} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{where}: {MANIFEST_FILE} is not a JSON object")
    version = raw.get("format")
    if isinstance(version, int) and version > FORMAT:
        raise ManifestError(
            f"{where}: prepared by a newer rewind (format {version}; this one reads up to {FORMAT}): upgrade rewind"
        )
    try:
        manifest = decode_json(data, DataManifest)
    except msgspec.DecodeError as exc:
        raise ManifestError(f"{where}: {MANIFEST_FILE} is malformed: {exc}") from None
    if manifest.format != FORMAT:
        raise ManifestError(f"{where}: {MANIFEST_FILE} has unknown format {manifest.format}")
    if "train" not in manifest.splits:
        raise ManifestError(f"{where}: {MANIFEST_FILE} has no train split")
    for split, token_file in manifest.splits.items():
        if SPLIT_FILES.get(split) != token_file.file:
            raise ManifestError(f"{where}: {MANIFEST_FILE}: split {split!r} names file {token_file.file!r}")
    if manifest.vocab_size > np.iinfo(DTYPES[manifest.dtype]).max + 1:
        raise ManifestError(f"{where}: {MANIFEST_FILE}: vocab_size {manifest.vocab_size} does not fit {manifest.dtype}")
    return manifest


def read_manifest(directory: str | os.PathLike[str]) -> DataManifest:
    """The manifest of prepared directory `directory` (local or an fsspec URL)."""
    return decode_manifest(manifest_bytes(directory), os.fspath(directory))


def manifest_hash(directory: str | os.PathLike[str]) -> str:
    """sha256 of DIR/manifest.json's bytes: the prepared identity a run records."""
    return hashlib.sha256(manifest_bytes(directory)).hexdigest()


def is_prepared(directory: str | os.PathLike[str]) -> bool:
    """Whether `directory` holds a manifest (complete or not is check_prepared's question)."""
    try:
        return _location(directory).join(MANIFEST_FILE).exists()
    except (ManifestError, OSError):
        return False


def _file_sha256(location: Location, size: int) -> str:
    """sha256 of the file's first `size` bytes (its whole, when it is the size the manifest says)."""
    digest = hashlib.sha256()
    if location.is_local:
        handle = os.fdopen(open_regular(location.path)[0], "rb")
    else:
        handle = location.fs.open(location.path, "rb")
    with handle:
        while size and (chunk := handle.read(min(_HASH_CHUNK, size))):
            digest.update(chunk)
            size -= len(chunk)
    return digest.hexdigest()


def _regular_size(location: Location) -> int:
    """The size of a token file, which locally must be a regular file (RefusedFile otherwise)."""
    if not location.is_local:
        return location.size()
    fd, info = open_regular(location.path)
    os.close(fd)
    return info.st_size


def check_prepared(directory: str | os.PathLike[str], *, full: bool = False) -> list[str]:
    """Problems of a prepared directory, one line each ([] = intact): the manifest, each token file's
    size against it (and with `full` its sha256), and the tokenizer copy's sha256 (always: it is small)."""
    where = os.fspath(directory)
    try:
        manifest = read_manifest(directory)
    except ManifestError as exc:
        return [str(exc)]
    location = _location(directory)
    itemsize = DTYPES[manifest.dtype].itemsize
    problems: list[str] = []
    for split, token_file in manifest.splits.items():
        file = location.join(token_file.file)
        if token_file.size != token_file.num_tokens * itemsize:
            problems.append(f"{where}: {split}: the manifest's size {token_file.size} is not "
                            f"{token_file.num_tokens} tokens of {manifest.dtype}")
            continue
        try:
            size = _regular_size(file)
            if size != token_file.size:
                problems.append(f"{where}/{token_file.file}: {size} bytes, the manifest says {token_file.size}")
            elif full and (actual := _file_sha256(file, size)) != token_file.sha256:
                problems.append(f"{where}/{token_file.file}: contents changed (sha256 {actual[:12]}, "
                                f"manifest {token_file.sha256[:12]})")
        except FileNotFoundError:
            problems.append(f"{where}/{token_file.file}: missing")
        except OSError as exc:
            problems.append(f"{where}/{token_file.file}: cannot read: {exc.strerror or exc}")
    tokenizer = location.join(TOKENIZER_FILE)
    if manifest.tokenizer:
        try:
            actual = hashlib.sha256(tokenizer.read_bounded(MAX_TOKENIZER_BYTES)).hexdigest()
            if actual != manifest.tokenizer:
                problems.append(f"{where}/{TOKENIZER_FILE}: sha256 {actual[:12]}, the manifest says "
                                f"{manifest.tokenizer[:12]}")
        except FileNotFoundError:
            problems.append(f"{where}/{TOKENIZER_FILE}: missing")
        except OSError as exc:
            problems.append(f"{where}/{TOKENIZER_FILE}: cannot read: {exc.strerror or exc}")
    elif tokenizer.exists():
        problems.append(f"{where}/{TOKENIZER_FILE}: present, but the manifest says the tokens are UTF-8 bytes")
    return problems


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
        location = _location(out_dir)
        if not location.is_local:
            raise ManifestError(f"{out_dir}: a prepared directory is written on a local filesystem (it is "
                                "renamed into place, which object stores cannot do)")
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
