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

Writes and reads go to the chunk objects directly, not through zarr's codec pipeline
(rewind.stores.cachefiles). Durability is grouped: a local chunk's writeback starts as it is written,
its completion record is queued, and every `GROUP_CHUNKS` chunks or `GROUP_BYTES` bytes (and in `flush`, `mark_complete`,
`missing_chunks`, and a read that needs a queued chunk) the queued chunks are synced together (their
syncs issued at once, so the filesystem commits them in one go), the directory naming them is synced
once, and only then are their records written. A kill loses at most the queued records: those chunks
are missing to the next process, which writes them again. (Measured on ext4 over virtio, 1 MiB chunks:
a sync and a directory sync per chunk, through zarr, wrote at about a third of np.memmap's speed.)

Each chunk read is checked against its stored crc32c (what zarr's codec checks: flipped bytes,
truncation) and that crc32c against the record's, so a record never vouches for other bytes. Any
mismatch is a CacheError naming the chunk, never zeros.

A run's cache is bound to what its log records about it: its spec carries an identity
(rewind.stores.cachebinding), and a reader uses a cache only if it is the one the log gives it.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import asdict
from typing import TYPE_CHECKING

import google_crc32c
import msgspec
import numpy as np

from rewind.stores import fsio
from rewind.stores.cachefiles import (
    ARRAY_META,
    ATTRIBUTE,
    CRC_SIZE,
    DTYPES,
    FORMAT_VERSION,
    MANIFEST,
    MAX_RECORD_BYTES,
    RECORDS_DIR,
    CacheError,
    CacheIncomplete,
    CacheSpec,
    ChunkRecord,
    Manifest,
    Queued,
    check_array_meta,
    checked_index,
    close_queued,
    decoded,
    listed,
    put_chunk_file,
    read_chunk_file,
    read_small,
    remove_tree,
    spec_of,
    sync_all,
    sync_file,
    write_records,
    zarr_store,
)
from rewind.stores.fsio import Location, filesystem

if TYPE_CHECKING:
    # Imported where a cache is made, opened or filled: a run without one, and `rewind state` telling
    # what is on disk, never import zarr (nor torch).
    import torch
    import zarr


# Queued completion records are made real (chunks synced, then the records written) every this many
# chunks or bytes: what a kill can cost is recomputing that much.
GROUP_CHUNKS = 64


GROUP_BYTES = 256 << 20


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
        self._queued: dict[int, Queued] = {}  # chunk -> written, record not yet written
        # Dropped with chunks queued: their files are closed, their records never written.
        weakref.finalize(self, close_queued, self._queued)

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
            remove_tree(location)
        location.makedirs()
        location.join(RECORDS_DIR).makedirs()
        if location.is_local:
            fsio.fsync_dir(location.parent.path)
        import zarr
        from zarr.codecs import BytesCodec, Crc32cCodec

        array = zarr.create_array(
            zarr_store(location),
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
            sync_file(location.join(ARRAY_META))
        return cls(location, spec, array)

    @classmethod
    def open(cls, url: str) -> ActivationCache:
        """The cache at `url`; CacheError if there is none or what is there is not one."""
        location = filesystem(url)
        if not location.join(ARRAY_META).exists():
            raise CacheError(f"{location.url}: no activation cache there")
        check_array_meta(location)  # zarr reads whatever is there: checked first
        import zarr

        try:
            array = zarr.open_array(zarr_store(location), mode="r+", zarr_format=3)
        except (ValueError, TypeError, KeyError, AttributeError, OSError) as exc:  # (zarr's, for what it cannot parse)
            raise CacheError(f"{location.url}: not a readable zarr v3 array: {exc}") from None
        cache = cls(location, spec_of(location, array), array)
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
        close_queued(self._queued, [chunk])  # written before in this group: superseded
        self._held = None
        fd = put_chunk_file(self._chunk_location(chunk), body, trailer)
        self._queued[chunk] = Queued(self._record(chunk, crc), fd, self._chunk_bytes)
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
                sync_all([q.fd for q in queued])
                fsio.fsync_dir(self.location.path)  # the chunks' names, renamed into place
        finally:
            close_queued(self._queued)
        records = {self._record_location(q.record.chunk).path: msgspec.json.encode(q.record) for q in queued}
        write_records(self.location, records)
        self._records.update((q.record.chunk, q.record) for q in queued)

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
                f"have no completion record ({listed(missing)})"
            )
        crcs = [self._records[k].crc32c for k in range(self.num_chunks)]
        manifest = Manifest(format=FORMAT_VERSION, spec=asdict(self.spec), crc32c=crcs)
        self.location.join(MANIFEST).write_atomic(msgspec.json.encode(manifest))

    def read_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) as a (stop-start, seq_len, width) tensor of spec.dtype, bitwise as written."""
        import torch

        num_rows = self.spec.num_rows
        checked_index("start row", start, 0, num_rows, f"this cache holds rows [0, {num_rows})")
        checked_index("stop row", stop, start, num_rows, f"must be in [start={start}, {num_rows}]")
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
                f"({listed(missing)})"
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
            body, trailer = read_chunk_file(self._chunk_location(chunk), self._buffer if into is None else into)
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
        close_queued(self._queued)
        remove_tree(self.location)
        self._records, self._held, self._buffer, self._deleted = {}, None, None, True

    def _check_chunk(self, chunk: int) -> None:
        if self._deleted:
            raise CacheError(f"{self.location.url}: this cache was deleted")
        last = self.num_chunks - 1
        checked_index("chunk", chunk, 0, last, f"this cache has {self.num_chunks} chunks (0..{last})")

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
        found = read_small(self.location.fs, [self._record_location(k) for k in chunks], MAX_RECORD_BYTES)
        for k in chunks:
            record = decoded(found.get(self._record_location(k).path), ChunkRecord)
            if record is not None and record == self._record(k, record.crc32c):
                self._records[k] = record

    def _manifest(self) -> Manifest | None:
        max_bytes = MAX_RECORD_BYTES + 16 * self.num_chunks  # a crc32c is at most 11 characters
        found = read_small(self.location.fs, [self.location.join(MANIFEST)], max_bytes)
        manifest = decoded(found.get(self.location.join(MANIFEST).path), Manifest)
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
