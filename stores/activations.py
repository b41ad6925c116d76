"""Activation caches: a frozen trunk's output for every training row, computed once and read back bitwise.

When a run grows a model by appending a stack on a frozen trunk, the trunk's output for a row is a pure
function of the row, so the engine writes it here once and training reads it instead of recomputing the
trunk. A cache is a zarr v3 array `(num_rows, seq_len, width)` at a path or fsspec URL:

    trunk-3.zarr/zarr.json       the array (spec in its attributes), chunked by `rows_per_chunk` rows
    trunk-3.zarr/c.<k>.0.0       chunk k: raw little-endian bytes + a crc32c (zarr's `crc32c` codec)
    trunk-3.zarr/done/<k>.json   chunk k's completion record: rows, size, and the crc32c it vouches for
    trunk-3.zarr/complete.json   the manifest, written once every chunk has its record

Chunks are stored uncompressed (zstd makes reads tens of times slower for no gain on activations) and
whole: empty-chunk elision is off, so an all-zero chunk is written like any other. bfloat16 is not a
zarr dtype: its bit patterns are stored as uint16.

Completion is never inferred from a chunk being there (a killed writer leaves whole chunks, and zarr
reads a missing one as zeros): a chunk counts once its record exists, and the record is written only
after the chunk's bytes are durable (the record itself need not be: one lost to a crash only makes the
chunk missing again). Rewriting a chunk removes its record (and the manifest) first, durably, so a
write that dies half way leaves the chunk missing, never vouched for with old bytes.

Writes go to the chunk objects directly, not through zarr's codec pipeline: the bytes zarr would write
(raw little-endian values, the last chunk padded with zeros, then the crc32c, little-endian), put
beside the chunk and renamed over it as zarr's LocalStore does, so zarr reads the cache as its own.
Durability is grouped: a local chunk's writeback starts as it is written, its completion record is
queued, and every `GROUP_CHUNKS` chunks or `GROUP_BYTES` bytes (and in `flush`, `mark_complete`,
`missing_chunks`, and a read that needs a queued chunk) the queued chunks are synced together (their
syncs issued at once, so the filesystem commits them in one go), the directory naming them is synced
once, and only then are their records written. A kill loses at most the queued records: those chunks
are missing to the next process, which writes them again. (Measured on ext4 over virtio, 1 MiB chunks:
a sync and a directory sync per chunk, through zarr, wrote at about a third of np.memmap's speed; zarr's
write path alone cost about three times the raw write.)

Reads go to the chunk objects directly too (zarr's codec pipeline runs several times slower than the
storage under it on this kind of data): each chunk read is checked against its stored crc32c (what
zarr's codec checks: flipped bytes, truncation) and that crc32c against the record's, so a record never
vouches for other bytes. Any mismatch is a CacheError naming the chunk, never zeros.
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
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import google_crc32c
import msgspec
import numpy as np

from rewind.stores import fsio
from rewind.stores.fsio import Location, filesystem

if TYPE_CHECKING:
    # Imported where a cache is made, opened or filled: a run without one, and `rewind state` telling
    # what is on disk, never import zarr (nor torch).
    import torch
    import zarr

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
# Queued completion records are made real (chunks synced, then the records written) every this many
# chunks or bytes: what a kill can cost is recomputing that much.
GROUP_CHUNKS = 64
GROUP_BYTES = 256 << 20
SYNC_THREADS = 8  # a group's chunk syncs issued at once, for the filesystem to commit together
# A spec's dtype (a torch dtype's name) -> how zarr stores it: bfloat16 travels as its uint16 bit patterns.
DTYPES = {"float32": np.dtype("<f4"), "bfloat16": np.dtype("<u2")}
# A chunk, or what a write killed half way leaves of a chunk (written beside it, then renamed, as
# zarr's LocalStore names it) or of zarr.json.
_CHUNK_NAME = re.compile(r"c\.\d+\.0\.0|(c\.\d+\.0|zarr)\.[0-9a-f]{32}\.partial")


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

    def __post_init__(self) -> None:
        for name in ("num_rows", "seq_len", "width", "rows_per_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CacheError(f"cache spec: {name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPES:
            raise CacheError(f"cache spec: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


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


def _checked_index(name: str, value: object, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise CacheError(f"{name} {value!r} out of range: {what}")
    return value


@dataclass(frozen=True)
class _Queued:
    """A chunk written but not yet vouched for: its record waits for the group's sync."""

    record: ChunkRecord
    fd: int | None  # local: the chunk file, held open until it is synced
    num_bytes: int


class ActivationCache:
    """One cache. Not thread-safe; several processes may write disjoint chunks of the same cache.
    A writer's last chunks are vouched for by `flush` (or `mark_complete`): dropping the cache without
    either leaves them missing, as a kill does."""

    def __init__(self, location: Location, spec: CacheSpec, array: zarr.Array):
        self.location, self.spec = location, spec
        self.num_chunks = -(-spec.num_rows // spec.rows_per_chunk)
        self._array = array  # for its metadata: chunks are written and read directly
        self._stored_dtype = DTYPES[spec.dtype]
        self._chunk_shape = (spec.rows_per_chunk, spec.seq_len, spec.width)
        self._chunk_bytes = int(np.prod(self._chunk_shape)) * self._stored_dtype.itemsize
        self._records: dict[int, ChunkRecord] = {}
        # The last chunk read, decoded and verified: batches smaller than a chunk read it once.
        self._held: tuple[int, np.ndarray] | None = None
        self._buffer: np.ndarray | None = None  # what local chunk reads go into
        self._deleted = False
        self._queued: dict[int, _Queued] = {}  # chunk -> written, record not yet written
        # Dropped with chunks queued: their files are closed, their records never written.
        weakref.finalize(self, _close_queued, self._queued)

    @classmethod
    def create(cls, url: str, spec: CacheSpec) -> ActivationCache:
        """A new cache at `url`; one already there with the same spec is opened instead (a killed
        writer's chunks are kept), one with another spec is deleted first."""
        location = filesystem(url)
        with contextlib.suppress(CacheError):
            existing = cls.open(url)
            if existing.spec == spec:
                return existing
        if location.exists():
            _remove_tree(location)
        location.makedirs()
        location.join(RECORDS_DIR).makedirs()
        if location.is_local:
            fsio.fsync_dir(location.parent.path)
        import zarr
        from zarr.codecs import BytesCodec, Crc32cCodec

        array = zarr.create_array(
            _store(location),
            shape=(spec.num_rows, spec.seq_len, spec.width),
            chunks=(spec.rows_per_chunk, spec.seq_len, spec.width),
            dtype=DTYPES[spec.dtype],
            filters=None,
            serializer=BytesCodec(endian="little"),
            compressors=[Crc32cCodec()],
            fill_value=0,
            chunk_key_encoding={"name": "default", "separator": "."},
            dimension_names=("row", "position", "channel"),
            attributes={ATTRIBUTE: {"format": FORMAT_VERSION, **asdict(spec)}},
            zarr_format=3,
        )
        if location.is_local:
            _sync_file(location.join(ARRAY_META))
        return cls(location, spec, array)

    @classmethod
    def open(cls, url: str) -> ActivationCache:
        """The cache at `url`; CacheError if there is none or what is there is not one."""
        location = filesystem(url)
        if not location.join(ARRAY_META).exists():
            raise CacheError(f"{location.url}: no activation cache there")
        _check_array_meta(location)  # zarr reads whatever is there: checked first
        import zarr

        try:
            array = zarr.open_array(_store(location), mode="r+", zarr_format=3)
        except (ValueError, TypeError, KeyError, AttributeError, OSError) as exc:  # (zarr's, for what it cannot parse)
            raise CacheError(f"{location.url}: not a readable zarr v3 array: {exc}") from None
        cache = cls(location, _spec_of(location, array), array)
        cache.missing_chunks()  # loads the records
        return cache

    def chunk_rows(self, chunk: int) -> tuple[int, int]:
        """[start, stop) rows of a chunk: rows_per_chunk rows, fewer in the last one."""
        self._check_chunk(chunk)
        start = chunk * self.spec.rows_per_chunk
        return start, min(start + self.spec.rows_per_chunk, self.spec.num_rows)

    def write_chunk(self, chunk: int, values: torch.Tensor) -> None:
        """Write chunk `chunk` (values: (stop-start, seq_len, width) of spec.dtype, on any device) and
        queue its completion record, written with its group's (see `flush`)."""
        start, stop = self.chunk_rows(chunk)
        stored = self._stored_values(chunk, values, (stop - start, self.spec.seq_len, self.spec.width))
        body = stored.reshape(-1).view(np.uint8)
        # The stored chunk is whole: zarr pads the last one to full size with zeros.
        padding = bytes(self._chunk_bytes - body.nbytes)
        crc = google_crc32c.value(body)
        if padding:
            crc = google_crc32c.extend(crc, padding)
        trailer = padding + crc.to_bytes(CRC_SIZE, "little")
        # Unvouch first: a write that dies from here on leaves the chunk missing, not vouched for.
        self.location.join(MANIFEST).remove()
        self._records.pop(chunk, None)
        self._record_location(chunk).remove()
        _close_queued(self._queued, [chunk])  # written before in this group: superseded
        self._held = None
        fd = self._put_chunk(chunk, body, trailer)
        self._queued[chunk] = _Queued(self._record(chunk, crc), fd, self._chunk_bytes)
        num_queued_bytes = sum(q.num_bytes for q in self._queued.values())
        if len(self._queued) >= GROUP_CHUNKS or num_queued_bytes >= GROUP_BYTES:
            self.flush()

    def flush(self) -> None:
        """Vouch for the chunks written since the last flush: sync their bytes (the syncs issued
        together), sync the directory naming them once, then write their completion records (not
        synced, and not atomic: a record lost or cut short by a crash only makes its chunk missing,
        and the chunk it names is durable already). A sync that fails leaves those chunks missing."""
        if not self._queued:
            return
        queued = list(self._queued.values())
        try:
            if self.location.is_local:
                _sync_all([q.fd for q in queued])
                fsio.fsync_dir(self.location.path)  # the chunks' names, renamed into place
        finally:
            _close_queued(self._queued)
        records = {self._record_location(q.record.chunk).path: msgspec.json.encode(q.record) for q in queued}
        _write_records(self.location, records)
        self._records.update((q.record.chunk, q.record) for q in queued)

    def _put_chunk(self, chunk: int, body: np.ndarray, trailer: bytes) -> int | None:
        """The stored chunk, whole: locally written beside it and renamed into place (as zarr's
        LocalStore does: a reader never sees half a chunk), its writeback started, the file left
        open for the group's sync; elsewhere one put, which an object store makes atomic and durable."""
        where = self._chunk_location(chunk)
        if not where.is_local:
            where.fs.pipe_file(where.path, body.tobytes() + trailer)
            return None
        # c.<k>.0.<hex>.partial: the name zarr's LocalStore gives a chunk on its way (see _CHUNK_NAME).
        beside = f"{where.path.removesuffix('.0')}.{uuid.uuid4().hex}.partial"
        fd = os.open(beside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fsio.write_all(fd, body)
            fsio.write_all(fd, trailer)
            _start_writeback(fd)
            os.replace(beside, where.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(beside)
            raise
        return fd

    def _stored_values(self, chunk: int, values: object, shape: tuple[int, ...]) -> np.ndarray:
        import torch

        if not isinstance(values, torch.Tensor):
            raise CacheError(f"chunk {chunk}: values must be a torch.Tensor, got {type(values).__name__}")
        if values.dtype != (dtype := getattr(torch, self.spec.dtype)):
            raise CacheError(f"chunk {chunk}: values are {values.dtype}, this cache holds {dtype}")
        if tuple(values.shape) != shape:
            raise CacheError(f"chunk {chunk}: values have shape {tuple(values.shape)}, expected {shape}")
        values = values.detach().cpu().contiguous()  # a trunk on a GPU hands its outputs over as they are
        if self.spec.dtype == "bfloat16":
            values = values.view(torch.uint16)
        return np.ascontiguousarray(values.numpy(), dtype=self._stored_dtype)  # little-endian: no copy here

    def missing_chunks(self) -> list[int]:
        """Chunks without a valid completion record, read afresh from the store (after this writer's
        queued records are written: `flush`)."""
        self.flush()
        manifest = self._manifest()
        if manifest is not None:
            self._records = {k: self._record(k, crc) for k, crc in enumerate(manifest.crc32c)}
            return []
        names = set(self.location.join(RECORDS_DIR).list_names())
        self._records = {}
        self._load_records([k for k in range(self.num_chunks) if f"{k}.json" in names])
        return [k for k in range(self.num_chunks) if k not in self._records]

    def is_complete(self) -> bool:
        return self._manifest() is not None

    def mark_complete(self) -> None:
        """Flush, then write the manifest; CacheError unless every chunk has its completion record."""
        missing = self.missing_chunks()
        if missing:
            raise CacheError(
                f"{self.location.url}: cannot mark complete: {len(missing)} of {self.num_chunks} chunks "
                f"have no completion record ({_listed(missing)})"
            )
        crcs = [self._records[k].crc32c for k in range(self.num_chunks)]
        manifest = Manifest(format=FORMAT_VERSION, spec=asdict(self.spec), crc32c=crcs)
        self.location.join(MANIFEST).write_atomic(msgspec.json.encode(manifest))

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) as a (stop-start, seq_len, width) tensor of spec.dtype, bitwise as written."""
        import torch

        num_rows = self.spec.num_rows
        _checked_index("start row", start, 0, num_rows, f"this cache holds rows [0, {num_rows})")
        _checked_index("stop row", stop, start, num_rows, f"must be in [start={start}, {num_rows}]")
        # Allocated by numpy, not torch: a run of same-sized torch allocations can end up page-faulting
        # its megabytes afresh on every read (measured: a quarter of the read speed, in some processes).
        shape = (stop - start, self.spec.seq_len, self.spec.width)
        out_values = np.empty(shape, dtype=self._stored_dtype.newbyteorder("="))
        out = torch.from_numpy(out_values)
        out = out.view(torch.bfloat16) if self.spec.dtype == "bfloat16" else out
        if stop == start:
            return out
        per_chunk = self.spec.rows_per_chunk
        chunks = range(start // per_chunk, (stop - 1) // per_chunk + 1)
        if any(k in self._queued for k in chunks):
            self.flush()  # written by this writer: vouched for before they are read
        self._load_records([k for k in chunks if k not in self._records])  # written since we looked?
        missing = [k for k in chunks if k not in self._records]
        if missing:
            raise CacheIncomplete(
                f"{self.location.url}: rows [{start}, {stop}) need chunks with no completion record "
                f"({_listed(missing)})"
            )
        for k in chunks:
            chunk_start = k * per_chunk
            low, high = max(start, chunk_start), min(stop, chunk_start + per_chunk)
            into = out_values[low - start : high - start]
            if high - low == per_chunk and self.location.is_local and sys.byteorder == "little":
                # A whole chunk wanted: read straight into the output, no copy (the engine's case).
                self._verified_chunk(k, into=into.reshape(-1).view(np.uint8))
            else:
                into[...] = self._verified_chunk(k)[low - chunk_start : high - chunk_start]
        return out

    def _verified_chunk(self, chunk: int, into: np.ndarray | None = None) -> np.ndarray:
        """Chunk `chunk`'s values, read whole, checked against its own crc32c and its record's. Read
        into `into` (bytes of the caller's tensor) when given, else kept as the held chunk."""
        if into is None and self._held is not None and self._held[0] == chunk:
            return self._held[1]
        if into is None:
            self._held = None  # its buffer is about to be overwritten
            if self._buffer is None:
                self._buffer = np.empty(self._chunk_bytes, dtype=np.uint8)
        try:
            body, trailer = _read_chunk_file(self._chunk_location(chunk), self._buffer if into is None else into)
        except FileNotFoundError:
            raise self._chunk_error(chunk, "is missing") from None
        if len(body) != self._chunk_bytes or len(trailer) != CRC_SIZE:
            size = f"{len(body) + len(trailer):,} bytes where {self._chunk_bytes + CRC_SIZE:,} belong"
            raise self._chunk_error(chunk, f"is damaged: {size} (truncated?)")
        stored_crc = int.from_bytes(trailer, "little")
        if google_crc32c.value(body) != stored_crc:
            raise self._chunk_error(chunk, "is damaged: its bytes fail their crc32c check")
        if stored_crc != self._records[chunk].crc32c:
            raise self._chunk_error(
                chunk, "holds other bytes than its completion record vouches for (rewritten after the record?)"
            )
        values = body.view(self._stored_dtype).reshape(self._chunk_shape)
        if into is None:
            self._held = (chunk, values)
        return values

    def _chunk_error(self, chunk: int, problem: str) -> CacheError:
        start, stop = self.chunk_rows(chunk)
        return CacheError(f"{self.location.url}: chunk {chunk} (rows {start}-{stop - 1}) {problem}")

    def num_bytes(self) -> int:
        """Bytes stored: chunks, records, metadata."""
        try:
            return int(self.location.fs.du(self.location.path, total=True))
        except FileNotFoundError:
            return 0

    def delete(self) -> None:
        """Remove the cache; what a killed delete leaves is no cache (`create` clears it away)."""
        _close_queued(self._queued)
        _remove_tree(self.location)
        self._records, self._held, self._buffer, self._deleted = {}, None, None, True

    def _check_chunk(self, chunk: int) -> None:
        if self._deleted:
            raise CacheError(f"{self.location.url}: this cache was deleted")
        last = self.num_chunks - 1
        _checked_index("chunk", chunk, 0, last, f"this cache has {self.num_chunks} chunks (0..{last})")

    def _chunk_location(self, chunk: int) -> Location:
        return self.location.join(self._array.metadata.encode_chunk_key((chunk, 0, 0)))

    def _record_location(self, chunk: int) -> Location:
        return self.location.join(RECORDS_DIR, f"{chunk}.json")

    def _record(self, chunk: int, crc: int) -> ChunkRecord:
        start, stop = self.chunk_rows(chunk)
        return ChunkRecord(chunk=chunk, start=start, stop=stop, num_bytes=self._chunk_bytes, crc32c=crc)

    def _load_records(self, chunks: list[int]) -> None:
        """Read these chunks' records; a valid one (for this chunk of this spec) joins `_records`, any
        other (unreadable, or another chunk's) counts as missing."""
        found = _read_small(self.location.fs, [self._record_location(k) for k in chunks], MAX_RECORD_BYTES)
        for k in chunks:
            record = _decoded(found.get(self._record_location(k).path), ChunkRecord)
            if record is not None and record == self._record(k, record.crc32c):
                self._records[k] = record

    def _manifest(self) -> Manifest | None:
        max_bytes = MAX_RECORD_BYTES + 16 * self.num_chunks  # a crc32c is at most 11 characters
        found = _read_small(self.location.fs, [self.location.join(MANIFEST)], max_bytes)
        manifest = _decoded(found.get(self.location.join(MANIFEST).path), Manifest)
        if manifest is None or manifest.spec != asdict(self.spec) or len(manifest.crc32c) != self.num_chunks:
            return None
        return manifest


def cache_status(url: str) -> str:
    """"absent", "partial (k of n chunks)" or "complete", for tools to print; never raises for what is
    there: something that is not a readable cache is "unreadable (why)"."""
    if not filesystem(url).join(ARRAY_META).exists():
        return "absent"
    try:
        cache = ActivationCache.open(url)
    except CacheError as exc:
        return f"unreadable ({str(exc).removeprefix(filesystem(url).url + ': ')})"
    num_written = cache.num_chunks - len(cache.missing_chunks())
    return "complete" if cache.is_complete() else f"partial ({num_written} of {cache.num_chunks} chunks)"


def _spec_of(location: Location, array: zarr.Array) -> CacheSpec:
    """The spec in the array's attributes, checked against the array it describes."""
    from zarr.codecs import BytesCodec, Crc32cCodec

    fields = dict(array.attrs).get(ATTRIBUTE)
    if not isinstance(fields, dict) or fields.get("format") != FORMAT_VERSION:
        raise CacheError(f"{location.url}: a zarr array, but not a rewind activation cache (format {FORMAT_VERSION})")
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


def _check_array_meta(location: Location) -> None:
    """CacheError unless zarr.json is a regular file (locally: not a link either), small and shallow
    enough that zarr's own reading of it (json.loads of the whole file) cannot run out of memory or
    recursion."""
    meta = location.join(ARRAY_META)
    try:
        if location.is_local:
            os.close(_open_regular(meta.path))
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
            raise CacheError(f"{location.url}: not a readable zarr v3 array: {ARRAY_META} nests deeper than {MAX_META_DEPTH} levels")
        levels = [v for node in levels if isinstance(node, dict | list)
                  for v in (node.values() if isinstance(node, dict) else node)]


def _store(location: Location) -> zarr.storage.StoreLike:
    import zarr.storage

    if location.is_local:
        return zarr.storage.LocalStore(location.path)
    return zarr.storage.FsspecStore.from_url(location.url)


def _read_small(fs, locations: list[Location], max_bytes: int) -> dict[str, bytes]:
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


def _read_chunk_file(where: Location, buffer: np.ndarray) -> tuple[np.ndarray, bytes]:
    """(body, crc32c trailer) of a chunk file. Locally the body goes into `buffer` (a reused one, or
    the caller's tensor: a fresh allocation per chunk costs more in page faults than the read), and
    what follows it is read to one byte more than a trailer, so a longer file shows."""
    if not where.is_local:
        data = np.frombuffer(where.read_bytes(), dtype=np.uint8)
        return data[:-CRC_SIZE], data[-CRC_SIZE:].tobytes()
    view, num_read = memoryview(buffer), 0
    with os.fdopen(_open_regular(where.path), "rb", buffering=0) as handle:
        while num_read < len(view) and (count := handle.readinto(view[num_read:])):
            num_read += count
        trailer = handle.read(CRC_SIZE + 1)
    view.release()
    return buffer[:num_read], trailer


def _open_regular(path: str) -> int:
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


def _write_records(location: Location, records: dict[str, bytes]) -> None:
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


def _sync_all(fds: list[int]) -> None:
    """Sync these files' data, the syncs in flight together: a journaling filesystem commits them in
    one go, where one after another each would wait for its own commit and cache flush."""
    sync = fsio.sync_fd  # looked up now: tests replace it
    if len(fds) == 1:
        sync(fds[0])
        return
    with ThreadPoolExecutor(min(SYNC_THREADS, len(fds)), thread_name_prefix="rewind-sync") as pool:
        for _ in pool.map(sync, fds):  # the first failure raises, once every sync has returned
            pass


def _close_queued(queued: dict[int, _Queued], chunks: list[int] | None = None) -> None:
    """Forget queued chunks (all, or these), closing their files unsynced: their records are never
    written."""
    for k in list(queued) if chunks is None else [k for k in chunks if k in queued]:
        fd = queued.pop(k).fd
        if fd is not None:
            os.close(fd)


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


def _start_writeback(fd: int) -> None:
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # 0, 0: the whole file; a failure is harmless


def _sync_file(location: Location) -> None:
    with open(location.path, "rb") as handle:
        fsio.sync_fd(handle.fileno())


def _remove_tree(location: Location) -> None:
    """Delete a cache: manifest and array metadata first, so what a crash leaves is no cache at all.
    Refuses a directory holding anything a cache does not, or a file: that is not ours to delete."""
    if location.is_local and location.exists() and not location.fs.isdir(location.path):
        raise CacheError(f"{location.url}: a file, not an activation cache; remove it by hand")
    names = location.list_names()
    ours = {ARRAY_META, MANIFEST, RECORDS_DIR}
    foreign = [n for n in names if n not in ours and not _CHUNK_NAME.fullmatch(n) and ".tmp-" not in n]
    if foreign:
        raise CacheError(
            f"{location.url}: holds files an activation cache does not ({_listed(sorted(foreign))}); "
            "not deleting it: remove it by hand"
        )
    for name in (MANIFEST, ARRAY_META):
        location.join(name).remove()
    if location.is_local:
        shutil.rmtree(location.path, ignore_errors=False)
        fsio.fsync_dir(location.parent.path)
    elif location.fs.exists(location.path):
        location.fs.rm(location.path, recursive=True)


def _decoded(data: bytes | None, kind: type) -> Any:
    """A record or manifest, or None where there is none or it is not one (cut short, or garbage)."""
    try:
        return None if data is None else msgspec.json.decode(data, type=kind)
    except msgspec.DecodeError:
        return None


def _listed(items: list, limit: int = 5) -> str:
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")
