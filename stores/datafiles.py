"""The identity of a data file (rewind.states.data_identity.SourceFile), local or on any fsspec filesystem.

The fingerprint is cheap enough for every resume of a run over a large corpus: a sha256 of the size and
of `NUM_FINGERPRINT_BLOCKS` blocks of `FINGERPRINT_BLOCK` bytes at evenly spaced offsets (the first and
the last block included), so it reads at most 1 MiB of any file. It notices a file replaced, truncated,
extended or re-tokenised; an edit that keeps the size and touches none of the sampled blocks is what
`rewind verify --data` (the full sha256) is for.

A local file is read only if it is a regular file (rewind.stores.untrusted.open_regular): a token file
replaced by a FIFO would block a resume's fingerprint forever, one linked to /dev/zero would never let
`rewind verify --data` finish hashing.
"""

from __future__ import annotations

import hashlib
import os

from rewind.states.data_identity import SourceFile
from rewind.stores.fsio import filesystem
from rewind.stores.untrusted import open_regular

NUM_FINGERPRINT_BLOCKS = 16
FINGERPRINT_BLOCK = 64 * 1024
_HASH_CHUNK = 8 * 1024 * 1024


def fingerprint_offsets(size: int) -> list[int]:
    """Where the fingerprint's blocks start: the whole file when it is small, else evenly spread."""
    if size <= NUM_FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK:
        return [0] if size else []
    last = size - FINGERPRINT_BLOCK
    return [last * i // (NUM_FINGERPRINT_BLOCKS - 1) for i in range(NUM_FINGERPRINT_BLOCKS)]


def _read_blocks(handle, size: int) -> hashlib._Hash:
    digest = hashlib.sha256(f"rewind-fingerprint-1:{size}:".encode())
    # A small file is read whole (one block of its size); a large one in blocks that never overlap.
    block = FINGERPRINT_BLOCK if size > NUM_FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK else size
    for offset in fingerprint_offsets(size):
        handle.seek(offset)
        digest.update(handle.read(block))
    return digest


def file_identity(path: str | os.PathLike[str], *, full: bool = False) -> SourceFile:
    """(size, fingerprint, and with `full` the sha256 of every byte) of the file at `path` (a local path
    or an fsspec URL). FileNotFoundError / OSError (RefusedFile: not a regular file) leave as they are,
    for the caller to put in one line."""
    location = filesystem(str(path))
    fs, where = location.fs, location.path
    if location.is_local:
        fd, info = open_regular(where)
        size, handle = info.st_size, os.fdopen(fd, "rb")
    else:
        size, handle = int(fs.size(where)), fs.open(where, "rb")
    with handle:
        fingerprint = _read_blocks(handle, size).hexdigest()
        content = ""
        if full:
            handle.seek(0)
            digest = hashlib.sha256()
            left = size  # the bytes the size names: a file that keeps growing is not followed
            while left and (chunk := handle.read(min(_HASH_CHUNK, left))):
                digest.update(chunk)
                left -= len(chunk)
            content = digest.hexdigest()
    return SourceFile(path=str(path), size=size, fingerprint=fingerprint, sha256=content)


def bytes_identity(data: bytes) -> str:
    """sha256 of bytes held in memory (a tokenizer file, a manifest)."""
    return hashlib.sha256(data).hexdigest()
