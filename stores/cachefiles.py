"""The files of an activation cache (rewind.stores.activations says what a cache is and the order in
which they are written): its spec, chunk records and manifest, zarr.json checked before zarr reads it
and the array checked against its spec, chunk files read into a caller's buffer, records written and
chunks synced in groups, and a cache removed only when it holds nothing a cache does not.

Chunks are written as the bytes zarr would write (raw little-endian values, the last chunk padded with
zeros, then the crc32c, little-endian), beside the chunk and renamed over it as zarr's LocalStore does,
so zarr reads the cache as its own; they are read back straight into a caller's buffer (zarr's codec
pipeline runs several times slower than the storage under it on this kind of data, and its write path
cost about three times the raw write).

A cache is untrusted on disk like any file: every local file of it is opened only if it is a regular
file and not a link, records and manifests are read up to a cap, and zarr.json is held to a size and a
nesting depth before zarr's own json.loads sees it. No torch here; zarr only where an array is opened.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import stat
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from rewind.stores import fsio
from rewind.stores.fsio import Location

if TYPE_CHECKING:
    import zarr  # imported where an array is opened: see rewind.stores.activations


FORMAT_VERSION = 1


ATTRIBUTE = "rewind_activation_cache"


ARRAY_META = "zarr.json"


MANIFEST = "complete.json"


RECORDS_DIR = "done"


CRC_SIZE = 4  # zarr's crc32c codec appends the checksum, little-endian, after the chunk's bytes


MAX_RECORD_BYTES = 1 << 12


# zarr.json as rewind writes it is under 2 KB, 5 levels deep; zarr parses it whole with json.loads.
MAX_META_BYTES = 1 << 16


MAX_META_DEPTH = 16


SYNC_THREADS = 8  # a group's chunk syncs issued at once, for the filesystem to commit together


# A spec's dtype (a torch dtype's name) -> how zarr stores it: bfloat16 travels as its uint16 bit patterns.
DTYPES = {"float32": np.dtype("<f4"), "bfloat16": np.dtype("<u2")}


# A chunk, or what a write killed half way leaves of a chunk (written beside it, then renamed, as
# zarr's LocalStore names it) or of zarr.json.
_CHUNK_NAME = re.compile(r"c\.\d+\.0\.0|(c\.\d+\.0|zarr)\.[0-9a-f]{32}\.partial")


_IDENTITY = re.compile(r"(?:[0-9a-f]{64})?", re.ASCII)


class CacheError(Exception):
    """A cache that cannot be used as asked: absent, damaged, or called with bad arguments."""


class CacheIncomplete(CacheError):
    """Rows were asked for whose chunks have no completion record yet."""


@dataclass(frozen=True)
class CacheSpec:
    num_rows: int
    seq_len: int
    width: int
    dtype: str  # "float32" or "bfloat16" (torch dtype names)
    rows_per_chunk: int
    # What made it, as the log records it (rewind.stores.cachebinding.cache_identity: a sha256); "" in a
    # cache written before caches carried one, and in caches that are not a run's (benchmarks, tests).
    identity: str = ""

    def __post_init__(self) -> None:
        for name in ("num_rows", "seq_len", "width", "rows_per_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CacheError(f"cache spec: {name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise CacheError(f"cache spec: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.identity, str) or not _IDENTITY.fullmatch(self.identity):
            raise CacheError(f"cache spec: identity must be a sha256 or empty, got {str(self.identity)[:80]!r}")


class ChunkRecord(msgspec.Struct, frozen=True):
    """Chunk `chunk` (rows [start, stop)) was written whole; its stored bytes have this crc32c."""

    chunk: int
    start: int
    stop: int
    num_bytes: int  # of the stored chunk: rows_per_chunk rows, the last chunk padded with zeros
    crc32c: int


class Manifest(msgspec.Struct, frozen=True):
    format: int
    spec: dict[str, int | str]
    crc32c: list[int]  # per chunk, as the records had them


def checked_index(name: str, value: object, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CacheError(f"{name} {value!r} out of range: {what}")
    return value


def spec_of(location: Location, array: zarr.Array) -> CacheSpec:
    """The spec in the array's attributes, checked against the array it describes."""
    from zarr.codecs import BytesCodec, Crc32cCodec

    fields = dict(array.attrs).get(ATTRIBUTE)
    if not isinstance(fields, dict) or fields.get("format") != FORMAT_VERSION:
        raise CacheError(
            f"{location.url}: a zarr array, but not a rewind activation cache (format {FORMAT_VERSION})"
        )
    fields = {k: v for k, v in fields.items() if k != "format"}
    try:
        spec = CacheSpec(**fields)
    except TypeError as exc:
        raise CacheError(f"{location.url}: the cache's spec is unreadable: {exc}") from None
    metadata = array.metadata
    found = (array.shape, array.chunks, array.dtype, [c.to_dict() for c in metadata.codecs])
    expected = (
        (spec.num_rows, spec.seq_len, spec.width),
        (spec.rows_per_chunk, spec.seq_len, spec.width),
        DTYPES[spec.dtype],
        [BytesCodec(endian="little").to_dict(), Crc32cCodec().to_dict()],
    )
    if found != expected or metadata.encode_chunk_key((0, 0, 0)) != "c.0.0.0":
        raise CacheError(f"{location.url}: the array does not have the layout its cache spec says")
    return spec


def check_array_meta(location: Location) -> None:
    """CacheError unless zarr.json is a regular file (locally: not a link either), small and shallow
    enough that zarr's own reading of it (json.loads of the whole file) cannot run out of memory or
    recursion."""
    meta = location.join(ARRAY_META)
    try:
        if location.is_local:
            os.close(open_cache_file(meta.path))
        found = fsio.read_json(meta, MAX_META_BYTES)
    except (OSError, msgspec.DecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise CacheError(f"{location.url}: not a readable zarr v3 array: {ARRAY_META}: {reason}") from None
    if not isinstance(found, dict):
        raise CacheError(f"{location.url}: not a readable zarr v3 array: {ARRAY_META} is not a JSON object")
    levels, depth = [found], 0
    while levels:
        depth += 1
        if depth > MAX_META_DEPTH:
            raise CacheError(
                f"{location.url}: not a readable zarr v3 array: {ARRAY_META} nests deeper than {MAX_META_DEPTH} levels"
            )
        levels = [
            v
            for node in levels
            if isinstance(node, dict | list)
            for v in (node.values() if isinstance(node, dict) else node)
        ]


def zarr_store(location: Location) -> zarr.storage.StoreLike:
    import zarr.storage

    if location.is_local:
        return zarr.storage.LocalStore(location.path)
    return zarr.storage.FsspecStore.from_url(location.url)


def read_small(fs, locations: list[Location], max_bytes: int) -> dict[str, bytes]:
    """path -> bytes of those files that exist (records, manifests: small). One batched request on an
    object store; locally at most `max_bytes` + 1 bytes, never through a link or from a FIFO."""
    if not locations:
        return {}
    if not locations[0].is_local:
        return fs.cat([where.path for where in locations], on_error="omit")
    found = {}
    for where in locations:
        with contextlib.suppress(FileNotFoundError):
            found[where.path] = where.read_head(max_bytes)
    return found


def read_chunk_file(where: Location, buffer: np.ndarray) -> tuple[np.ndarray, bytes]:
    """(body, crc32c trailer) of a chunk file. Locally the body goes into `buffer` (a reused one, or
    the caller's tensor: a fresh allocation per chunk costs more in page faults than the read), and
    what follows it is read to one byte more than a trailer, so a longer file shows."""
    if not where.is_local:
        data = np.frombuffer(where.read_bytes(), dtype=np.uint8)
        return data[:-CRC_SIZE], data[-CRC_SIZE:].tobytes()
    view, num_read = memoryview(buffer), 0
    with os.fdopen(open_cache_file(where.path), "rb", buffering=0) as handle:
        while num_read < len(view) and (count := handle.readinto(view[num_read:])):
            num_read += count
        trailer = handle.read(CRC_SIZE + 1)
    view.release()
    return buffer[:num_read], trailer


def open_cache_file(path: str) -> int:
    """A local file of the cache, opened only if it is a regular file and not a link: a cache rewind
    wrote holds neither links nor FIFOs nor devices (one leads out of the run, or never ends).
    CacheError otherwise; FileNotFoundError when nothing is there."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CacheError(f"{path}: a link, not a file of the cache") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CacheError(f"{path}: not a regular file")
    return fd


def put_chunk_file(where: Location, body: np.ndarray, trailer: bytes) -> int | None:
    """The stored chunk, whole: locally written beside it and renamed into place (as zarr's
    LocalStore does: a reader never sees half a chunk), its writeback started, the file left
    open for the group's sync; elsewhere one put, which an object store makes atomic and durable."""
    if not where.is_local:
        where.fs.pipe_file(where.path, body.tobytes() + trailer)
        return None
    # c.<k>.0.<hex>.partial: the name zarr's LocalStore gives a chunk on its way (see _CHUNK_NAME).
    beside = f"{where.path.removesuffix('.0')}.{uuid.uuid4().hex}.partial"
    fd = os.open(beside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fsio.write_all(fd, body)
        fsio.write_all(fd, trailer)
        start_writeback(fd)
        os.replace(beside, where.path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(beside)
        raise
    return fd


@dataclass(frozen=True)
class Queued:
    """A chunk written but not yet vouched for: its record waits for the group's sync."""

    record: ChunkRecord
    fd: int | None  # local: the chunk file, held open until it is synced
    num_bytes: int


def close_queued(queued: dict[int, Queued], chunks: list[int] | None = None) -> None:
    """Forget queued chunks (all, or these), closing their files unsynced: their records are never
    written."""
    for k in list(queued) if chunks is None else [k for k in chunks if k in queued]:
        fd = queued.pop(k).fd
        if fd is not None:
            os.close(fd)


def write_records(location: Location, records: dict[str, bytes]) -> None:
    """Completion records, not synced: one batched put on an object store, plain writes locally."""
    if not location.is_local:
        location.fs.pipe(records)  # whole-object puts
        return
    for path, data in records.items():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            fsio.write_all(fd, data)
        finally:
            os.close(fd)


def sync_all(fds: list[int]) -> None:
    """Sync these files' data, the syncs in flight together: a journaling filesystem commits them in
    one go, where one after another each would wait for its own commit and cache flush."""
    sync = fsio.sync_fd  # looked up now: tests replace it
    if len(fds) == 1:
        sync(fds[0])
        return
    with ThreadPoolExecutor(min(SYNC_THREADS, len(fds)), thread_name_prefix="rewind-sync") as pool:
        for _ in pool.map(sync, fds):  # the first failure raises, once every sync has returned
            pass


def _writeback_starter():
    """Linux's sync_file_range, or None: starting a chunk's writeback as it is written leaves the
    group's sync little to wait for. A hint only: the sync is what makes the bytes durable."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_SYNC_FILE_RANGE = _writeback_starter()


_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range's dirty pages; do not wait for it


def start_writeback(fd: int) -> None:
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # 0, 0: the whole file; a failure is harmless


def sync_file(location: Location) -> None:
    with open(location.path, "rb") as handle:
        fsio.sync_fd(handle.fileno())


def remove_tree(location: Location) -> None:
    """Delete a cache: manifest and array metadata first, so what a crash leaves is no cache at all.
    Refuses a directory holding anything a cache does not, or a file: that is not ours to delete."""
    if location.is_local and location.exists() and not location.fs.isdir(location.path):
        raise CacheError(f"{location.url}: a file, not an activation cache; remove it by hand")
    names = location.list_names()
    ours = {ARRAY_META, MANIFEST, RECORDS_DIR}
    foreign = [n for n in names if n not in ours and not _CHUNK_NAME.fullmatch(n) and ".tmp-" not in n]
    if foreign:
        raise CacheError(
            f"{location.url}: holds files an activation cache does not ({listed(sorted(foreign))}); "
            "not deleting it: remove it by hand"
        )
    for name in (MANIFEST, ARRAY_META):
        location.join(name).remove()
    if location.is_local:
        shutil.rmtree(location.path, ignore_errors=False)
        fsio.fsync_dir(location.parent.path)
    elif location.fs.exists(location.path):
        location.fs.rm(location.path, recursive=True)


def decoded(data: bytes | None, kind: type) -> Any:
    """A record or manifest, or None where there is none or it is not one (cut short, or garbage)."""
    try:
        return None if data is None else msgspec.json.decode(data, type=kind)
    except msgspec.DecodeError:
        return None


def listed(items: list, limit: int = 5) -> str:
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")
