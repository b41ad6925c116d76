"""Token streams and how their rows are split into train and validation.

A token stream is a flat array of token ids: a local file memory-mapped read-only (no copy of the
selected rows until they are gathered), or a file on any fsspec filesystem, read window by window
with ranged reads. Streams are cut into non-overlapping windows of block_size + 1 tokens; a trailing
partial window is dropped.

A file can change under a run that reads it (rewritten, replaced, truncated). Reading a mapped page
past the end of a truncated file kills the process with SIGBUS, which Python cannot catch safely, so
the file's size is checked before every gather (one fstat; a truncation that lands between that check
and the gather, microseconds, is not covered) and `max_token` reads with plain reads. `change()` tells
whether the file still is what was opened (its stat, and a hash of the fingerprint's sampled blocks):
the loop asks before each checkpoint (rewind.engine.data.rundata.check_unchanged), so that no checkpoint of
a run is taken on data it did not record.

`RowSplit` says which rows of a source are validation and which train:
- "tail": the last floor(n * fraction) rows (what rewind did before runs had the "data_identity" feature);
- "random": a fixed pseudo-random choice of floor(n * fraction) rows, through a keyed permutation of
  [0, n) (rewind.engine.data.permutation): validation row i is row pi(i), train row j is row pi(num_validation
  + j). O(1) per lookup, no index array, exact counts, and the same choice for the same file in every run
  (the key is fixed, not the run's seed), so runs on one corpus validate on the same rows;
- "file": a validation source of its own (DataSource.validation_path): all rows of each.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import stat
import weakref

import numpy as np

from rewind.engine.data.permutation import permute, round_keys
from rewind.stores.datafiles import FINGERPRINT_BLOCK, NUM_FINGERPRINT_BLOCKS, fingerprint_offsets
from rewind.stores.fsio import filesystem

# The key of validation carving: part of the definition of the "random" split. Changing it moves every
# run's validation rows.
SPLIT_SEED = 0x5B17_DA7A
# Sources up to this many rows hold their carving as an array (built once, 2 MiB): a lookup is then an
# index, not a Feistel walk. The same rows either way.
CACHED_ORDER_MAX_ROWS = 1 << 18


class TokenFileError(Exception):
    """A token file cannot be read: missing, unreadable, or not a whole number of tokens."""


class TokenStream:
    """Token ids [0, num_tokens) of one file; `windows(rows, width)` gathers whole windows."""

    path: str
    num_tokens: int
    dtype: np.dtype

    def windows(self, rows: np.ndarray, width: int) -> np.ndarray:
        raise NotImplementedError

    def max_token(self) -> int:
        """The largest id in the stream (reads all of it)."""
        raise NotImplementedError

    def change(self) -> str:
        """How the file differs from what was opened, as far as a cheap look tells ("" = not at all)."""
        raise NotImplementedError


# Read by `max_token` at a time: 16 MiB.
_SCAN_BYTES = 1 << 24


class LocalTokenStream(TokenStream):
    def __init__(self, path: str, dtype: str):
        self.path, self.dtype = path, np.dtype(dtype)
        self._fd, opened = _open_regular(path)
        weakref.finalize(self, os.close, self._fd)
        self._num_bytes = opened.st_size
        _check_size(path, self._num_bytes, self.dtype)
        self.num_tokens = self._num_bytes // self.dtype.itemsize
        # What `change` compares with: the file as opened, and its sampled blocks.
        self._opened = _stat_key(opened)
        self._sample = self._sample_digest()
        if self._num_bytes:  # (mmap refuses an empty file; "too small" is reported later)
            mapped = mmap.mmap(self._fd, self._num_bytes, access=mmap.ACCESS_READ)
            self._array = np.frombuffer(mapped, dtype=self.dtype)
        else:
            self._array = np.zeros(0, dtype=self.dtype)
        self._views: dict[int, np.ndarray] = {}  # width -> the file as rows of that width (no copy)

    def windows(self, rows: np.ndarray, width: int) -> np.ndarray:
        view = self._views.get(width)
        if view is None:
            num_windows = self.num_tokens // width
            view = self._views[width] = self._array[: num_windows * width].reshape(num_windows, width)
        if os.fstat(self._fd).st_size < self._num_bytes:  # a mapped page past the end: SIGBUS
            raise TokenFileError(self._truncated())
        return view[rows].astype(np.int64)  # fancy indexing copies only the selected windows

    def max_token(self) -> int:
        largest = -1
        for start in range(0, self._num_bytes, _SCAN_BYTES):
            wanted = min(_SCAN_BYTES, self._num_bytes - start)
            piece = os.pread(self._fd, wanted, start)
            if len(piece) != wanted:
                raise TokenFileError(self._truncated())
            largest = max(largest, int(np.frombuffer(piece, dtype=self.dtype).max()))
        return largest

    def change(self) -> str:
        try:
            now = _stat_key(os.stat(self.path))
        except OSError as exc:
            return f"{self.path}: {exc.strerror or exc} (it was there when the run opened it)"
        if now != self._opened:
            size = f"{now[0]:,} bytes, {self._opened[0]:,} when opened"
            size = "the same size" if now[0] == self._opened[0] else size
            return f"{self.path}: changed since the run opened it ({size}, modified or replaced)"
        if self._sample_digest() != self._sample:
            return f"{self.path}: its contents changed since the run opened it (same size and times)"
        return ""

    def _sample_digest(self) -> str:
        """A hash of the blocks the data fingerprint samples (rewind.stores.datafiles), read from the
        opened file: at most NUM_FINGERPRINT_BLOCKS x FINGERPRINT_BLOCK bytes."""
        size = self._num_bytes
        block = FINGERPRINT_BLOCK if size > NUM_FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK else size
        digest = hashlib.sha256()
        for offset in fingerprint_offsets(size):
            digest.update(os.pread(self._fd, block, offset))
        return digest.hexdigest()

    def _truncated(self) -> str:
        now = os.fstat(self._fd).st_size
        return f"{self.path}: cut to {now:,} bytes while the run read it ({self._num_bytes:,} when opened)"


class RemoteTokenStream(TokenStream):
    """A token file on an object store: each window is one ranged read (fsspec `cat_ranges`, which
    backends batch and run concurrently)."""

    def __init__(self, url: str, dtype: str):
        self.path, self.dtype = url, np.dtype(dtype)
        location = filesystem(url)
        self._fs, self._where = location.fs, location.path
        try:
            num_bytes = int(self._fs.size(self._where))
        except FileNotFoundError:
            raise TokenFileError(f"{url}: file not found") from None
        _check_size(url, num_bytes, self.dtype)
        self.num_tokens = num_bytes // self.dtype.itemsize
        self._opened = self._key()

    def windows(self, rows: np.ndarray, width: int) -> np.ndarray:
        span = width * self.dtype.itemsize
        starts = [int(r) * span for r in rows]
        blobs = self._fs.cat_ranges([self._where] * len(starts), starts, [s + span for s in starts])
        out = np.empty((len(starts), width), dtype=np.int64)
        for i, blob in enumerate(blobs):
            if isinstance(blob, BaseException) or len(blob) != span:
                raise TokenFileError(f"{self.path}: a window could not be read whole (the file changed?)")
            out[i] = np.frombuffer(blob, dtype=self.dtype)
        return out

    def change(self) -> str:
        try:
            now = self._key()
        except FileNotFoundError:
            return f"{self.path}: gone (it was there when the run opened it)"
        if now == self._opened:
            return ""
        return f"{self.path}: changed since the run opened it (modified or replaced)"

    def _key(self) -> str:
        """The filesystem's own key of the file's properties (fsspec `ukey`: an object's ETag, a local
        file's size and times)."""
        return str(self._fs.ukey(self._where))

    def max_token(self) -> int:
        with self._fs.open(self._where, "rb") as handle:
            largest = -1
            while chunk := handle.read(1 << 24):
                values = np.frombuffer(chunk, dtype=self.dtype)
                if values.size:
                    largest = max(largest, int(values.max()))
            return largest


def _check_size(path: str, num_bytes: int, dtype: np.dtype) -> None:
    if num_bytes % dtype.itemsize:
        raise TokenFileError(f"{path}: size {num_bytes} bytes is not a multiple of {dtype.itemsize} ({dtype.name})")


def _stat_key(info: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a file rewritten or replaced: size, modification time, device and inode."""
    return info.st_size, info.st_mtime_ns, info.st_dev, info.st_ino


def _open_regular(path: str) -> tuple[int, os.stat_result]:
    """(fd, its stat) of the regular file at `path`; TokenFileError for anything else (a FIFO would
    block the reader, a device never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TokenFileError(f"{path}: file not found") from None
    except OSError as exc:
        raise TokenFileError(f"{path}: cannot read: {exc.strerror or exc}") from None
    info = os.fstat(fd)
    if stat.S_ISREG(info.st_mode):
        return fd, info
    os.close(fd)
    if stat.S_ISDIR(info.st_mode):
        raise TokenFileError(f"{path}: is a directory without a manifest.json (not prepared by `rewind data prepare`)")
    raise TokenFileError(f"{path}: not a regular file")


def open_stream(path: str, dtype: str) -> TokenStream:
    """A local path (or file:// URL) is memory-mapped; any other fsspec URL is read by ranges."""
    location = filesystem(path)
    if location.is_local:
        return LocalTokenStream(location.path, dtype)
    return RemoteTokenStream(path, dtype)


def holdout_problem(num_rows: int, fraction: float, unit: str = "rows") -> str:
    """Why `num_rows` rows carved by `validation_fraction` `fraction` hold none out (RowSplit keeps
    int(num_rows * fraction) for validation), with what would hold one out; "" when they hold one out."""
    if int(num_rows * fraction) >= 1:
        return ""
    needed = max(1, math.ceil(1 / fraction))
    while int(needed * fraction) < 1:  # 1 / fraction rounded, as the product is
        needed += 1
    ways = f"it needs at least {needed} {unit}, or a validation_path"
    larger = math.ceil(100 / num_rows) / 100 if num_rows else 1.0
    while larger < 1 and int(num_rows * larger) < 1:
        larger = round(larger + 0.01, 2)
    ways += f", or a validation_fraction of at least {larger}" if larger < 1 else ""
    counted, hold = (f"1 {unit.removesuffix('s')}", "holds") if num_rows == 1 else (f"{num_rows} {unit}", "hold")
    return f"{counted} with validation_fraction {fraction} {hold} out none for validation: {ways}"


class RowSplit:
    """Which of a source's `num_rows` rows each split reads: `row(split, indices)` -> source rows."""

    def __init__(self, num_rows: int, mode: str, fraction: float, num_validation_rows: int = 0):
        self.mode = mode
        if mode == "file":  # train: every row of the train source; validation: of its own source
            self.num_train, self.num_validation = num_rows, num_validation_rows
        else:
            self.num_validation = int(num_rows * fraction)
            self.num_train = num_rows - self.num_validation
        self._num_rows = num_rows
        self._keys = round_keys(SPLIT_SEED, "validation rows", num_rows) if mode == "random" else ()
        self._order: np.ndarray | None = None  # the whole permutation, for sources small enough to hold it

    def count(self, split: str) -> int:
        return self.num_train if split == "train" else self.num_validation

    def rows(self, split: str, indices: np.ndarray) -> np.ndarray:
        """Source rows of `indices` of `split` (of the validation source itself when mode is "file")."""
        if self.mode == "file":
            return indices
        offset = 0 if split == "train" else self.num_train
        if self.mode == "tail":
            return indices + offset
        # random: the permutation's first num_validation outputs are validation, the rest train.
        positions = indices + (self.num_validation if split == "train" else 0)
        if self._num_rows < 2:
            return positions
        if self._num_rows <= CACHED_ORDER_MAX_ROWS:
            if self._order is None:
                self._order = permute(np.arange(self._num_rows, dtype=np.int64), self._num_rows, self._keys)
            return self._order[positions]
        return permute(positions.astype(np.int64), self._num_rows, self._keys)
