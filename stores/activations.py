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
chunk missing again). Rewriting a chunk removes its record (and the manifest) first, so a write that
dies half way leaves the chunk missing, never vouched for with old bytes.

Reads go to the chunk objects directly, not through zarr's codec pipeline, which on this kind of data
runs several times slower than the storage under it: each chunk read is checked against its stored
crc32c (what zarr's codec checks: flipped bytes, truncation) and that crc32c against the record's, so a
record never vouches for other bytes. Any mismatch is a CacheError naming the chunk, never zeros.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from typing import Any

import google_crc32c
import msgspec
import numpy as np
import torch
import zarr
import zarr.storage
from zarr.codecs import BytesCodec, Crc32cCodec

from rewind.stores import fsio
from rewind.stores.fsio import Location, filesystem

FORMAT_VERSION = 1
ATTRIBUTE = "rewind_activation_cache"
ARRAY_META = "zarr.json"
MANIFEST = "complete.json"
RECORDS_DIR = "done"
CRC_SIZE = 4  # zarr's crc32c codec appends the checksum, little-endian, after the chunk's bytes
MAX_RECORD_BYTES = 1 << 12
# (torch dtype, how zarr stores it): bfloat16 travels as its uint16 bit patterns.
DTYPES = {"float32": (torch.float32, np.dtype("<f4")), "bfloat16": (torch.bfloat16, np.dtype("<u2"))}
# A chunk, or what zarr's LocalStore leaves of a chunk or zarr.json when killed mid-write (it writes
# beside the file, then renames).
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


class ActivationCache:
    """One cache. Not thread-safe; several processes may write disjoint chunks of the same cache."""

    def __init__(self, location: Location, spec: CacheSpec, array: zarr.Array):
        self.location, self.spec = location, spec
        self.num_chunks = -(-spec.num_rows // spec.rows_per_chunk)
        self._array = array.with_config({"write_empty_chunks": True})  # every chunk really written
        self._torch_dtype, self._stored_dtype = DTYPES[spec.dtype]
        self._chunk_shape = (spec.rows_per_chunk, spec.seq_len, spec.width)
        self._chunk_bytes = int(np.prod(self._chunk_shape)) * self._stored_dtype.itemsize
        self._records: dict[int, ChunkRecord] = {}
        # The last chunk read, decoded and verified: batches smaller than a chunk read it once.
        self._held: tuple[int, np.ndarray] | None = None
        self._buffer: np.ndarray | None = None  # what local chunk reads go into
        self._deleted = False

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
        array = zarr.create_array(
            _store(location),
            shape=(spec.num_rows, spec.seq_len, spec.width),
            chunks=(spec.rows_per_chunk, spec.seq_len, spec.width),
            dtype=DTYPES[spec.dtype][1],
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
        try:
            array = zarr.open_array(_store(location), mode="r+", zarr_format=3)
        except (ValueError, TypeError, KeyError, OSError) as exc:
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
        """Write chunk `chunk` (values: (stop-start, seq_len, width) of spec.dtype, on any device), then
        its completion record."""
        start, stop = self.chunk_rows(chunk)
        stored = self._stored_values(chunk, values, (stop - start, self.spec.seq_len, self.spec.width))
        # The record's crc32c is that of the stored chunk: zarr pads the last one to full size with zeros.
        crc = google_crc32c.value(stored)
        if stored.nbytes < self._chunk_bytes:
            crc = google_crc32c.extend(crc, bytes(self._chunk_bytes - stored.nbytes))
        # Unvouch first: a write that dies from here on leaves the chunk missing, not vouched for.
        self.location.join(MANIFEST).remove()
        self._records.pop(chunk, None)
        self._record_location(chunk).remove()
        self._held = None
        self._array[start:stop] = stored
        if self.location.is_local:  # the record may only outlive a power cut if the chunk does
            _sync_file(self._chunk_location(chunk))
            fsio.fsync_dir(self.location.path)
        record = self._record(chunk, crc)
        # Not synced, and not atomic: a record lost or cut short by a crash only makes the chunk
        # missing (a torn one does not decode), and the chunk it names is durable already.
        _write_unsynced(self._record_location(chunk), msgspec.json.encode(record))
        self._records[chunk] = record

    def _stored_values(self, chunk: int, values: object, shape: tuple[int, ...]) -> np.ndarray:
        if not isinstance(values, torch.Tensor):
            raise CacheError(f"chunk {chunk}: values must be a torch.Tensor, got {type(values).__name__}")
        if values.dtype != self._torch_dtype:
            raise CacheError(f"chunk {chunk}: values are {values.dtype}, this cache holds {self._torch_dtype}")
        if tuple(values.shape) != shape:
            raise CacheError(f"chunk {chunk}: values have shape {tuple(values.shape)}, expected {shape}")
        values = values.detach().cpu().contiguous()  # a trunk on a GPU hands its outputs over as they are
        if self.spec.dtype == "bfloat16":
            values = values.view(torch.uint16)
        return values.numpy()

    def missing_chunks(self) -> list[int]:
        """Chunks without a valid completion record, read afresh from the store."""
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
        """Write the manifest; CacheError unless every chunk has its completion record."""
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
        DTYPES[spec.dtype][1],
        [BytesCodec(endian="little").to_dict(), Crc32cCodec().to_dict()],
    )
    if found != expected or metadata.encode_chunk_key((0, 0, 0)) != "c.0.0.0":
        raise CacheError(f"{location.url}: the array does not have the layout its cache spec says")
    return spec


def _store(location: Location) -> zarr.storage.StoreLike:
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
    with open(where.path, "rb", buffering=0) as handle:
        while num_read < len(view) and (count := handle.readinto(view[num_read:])):
            num_read += count
        trailer = handle.read(CRC_SIZE + 1)
    view.release()
    return buffer[:num_read], trailer


def _write_unsynced(location: Location, data: bytes) -> None:
    if not location.is_local:
        location.fs.pipe_file(location.path, data)  # a whole-object put
        return
    with open(location.path, "wb") as handle:
        handle.write(data)


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
