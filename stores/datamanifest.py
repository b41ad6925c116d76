"""A prepared directory: documents tokenised once by `rewind data prepare` (or at a run's start), ready
to be memory-mapped by a dataset of kind "tokens".

    DIR/manifest.json    DataManifest: where the tokens came from and what they are
    DIR/train.bin        flat little-endian token ids (dtype below), documents joined by the
                         separator, nothing after the last
    DIR/validation.bin   the same for the validation inputs, when there were any
    DIR/tokenizer.json   a copy of the tokenizer that made them (absent for UTF-8 bytes)

A prepared directory is complete or absent: `PreparedWriter` (rewind.stores.preparedwriter) fills a
temporary sibling directory, fsyncs every file and the directory, and only then renames it to DIR, so a
crash mid-way never leaves a DIR that looks complete (at worst a `.DIR.tmp-*` sibling, which nothing reads). The manifest's own
sha256 (`manifest_hash`) is what a run records as the dataset's `prepared` identity.

A prepared directory is user data (another machine's, a download): its files are read only if they are
regular files, the manifest and tokenizer copy whole up to a cap each (MAX_MANIFEST_BYTES,
MAX_TOKENIZER_BYTES), token files in bounded pieces; what is refused is a ManifestError of one line.
"""

from __future__ import annotations

import hashlib
import os
from importlib import metadata
from typing import Literal

import msgspec
import numpy as np

from rewind.states.data_identity import SourceFile
from rewind.stores.fsio import (
    FilesystemUnavailable,
    Location,
    filesystem,
)
from rewind.stores.untrusted import decode_json, open_regular

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


def location_of(directory: str | os.PathLike[str]) -> Location:
    """Where the prepared directory `directory` is (a path or URL); ManifestError when it cannot be."""
    try:
        return filesystem(os.path.expanduser(os.fspath(directory)))
    except FilesystemUnavailable as exc:
        raise ManifestError(str(exc)) from None


def manifest_bytes(directory: str | os.PathLike[str]) -> bytes:
    """DIR/manifest.json as it is on disk (ManifestError when it cannot be read)."""
    location = location_of(directory)
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
        return location_of(directory).join(MANIFEST_FILE).exists()
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
    location = location_of(directory)
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
