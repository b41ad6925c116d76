"""Parsing the segments of the event log: frames checked, decoded and handed on a chunk at a time.

`rewind.stores.codec` defines one frame (layout, CRC, event decoding); this module walks whole segments
of them. The fast path decodes a chunk of about a MiB of whole frames and checks its CRC with one call;
anything else (damage, an older schema) falls back to a frame-by-frame parse that names what is wrong
and where. A damaged frame with nothing intact after it is a torn tail (the caller decides whether that
is allowed: only at the end of the last segment); with intact frames after it, it is corruption.
`audit_segments` is the same walk for `rewind verify`, recording every problem instead of raising.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import msgspec

from rewind.states import events as _events
from rewind.stores.codec import (
    _LENGTH_VERSION_SEQ,
    HEADER_SIZE,
    RESIDUE,
    BadFrame,
    EventDecoder,
    LogCorruptError,
    Record,
    SchemaUnreadable,
    UnsupportedSchemaError,
    _extend,
    find_next_frame,
    parse_frame,
)

# Readers decode a segment this many bytes (whole frames) at a time, handing each chunk's records on
# before decoding the next (`SegmentChunks`): what a streaming reader holds is about one chunk of
# decoded records (~4.5 times its bytes in objects), whatever the segment size. 1 MiB: a CRC call
# and a few Python calls per chunk cost nothing next to decoding its ~5,000 records.
DECODE_CHUNK_BYTES = 1 << 20


class SegmentParse(NamedTuple):
    items: list  # Records, or bare events
    next_seq: int
    end: int  # offset (relative to the parsed bytes) just after the last intact record
    bad: tuple[int, str] | None  # (offset, reason) of a damaged tail with nothing intact after it
    last_offset: int = -1  # offset in the segment (base included) where the last record starts


def parse_segment(
    name: str, data: bytes, *, seq: int, decoder: EventDecoder, records: bool = True, base: int = 0
) -> SegmentParse:
    """Decode the records in `data` (the bytes of segment `name` from byte `base` on, which must be
    a frame boundary), the first expected to carry `seq`: all of `SegmentChunks` in one list.

    Stops at a damaged frame when no intact frame follows it (`bad`; the caller decides whether that
    is a torn tail or corruption); raises LogCorruptError for anything else that is wrong.
    """
    collecting = gc.isenabled()
    gc.disable()  # for the whole parse, not only for each chunk (see SegmentChunks)
    try:
        chunks = SegmentChunks(name, data, seq=seq, decoder=decoder, records=records, base=base)
        items: list = []
        for chunk in chunks:
            items += chunk
        return SegmentParse(items, chunks.next_seq, chunks.end, chunks.bad, chunks.last_offset)
    finally:
        if collecting:
            gc.enable()


class SegmentChunks:
    """The records of segment `name` decoded a chunk at a time: iterating yields a list per chunk of
    whole frames of about DECODE_CHUNK_BYTES (never an empty one), each decoded only when asked for.

    `data` holds the segment's bytes from byte `base` on (a frame boundary); what is decoded is
    `data[begin:stop]` (all of it by default; `begin` a frame boundary), the first record there
    expected to carry `seq`. With `start_seq`/`stop_seq`, only the records with start_seq <= seq <
    stop_seq are yielded, and decoding ends once `stop_seq` is reached.

    Every record yielded has been checked like a whole-segment read checks it: a chunk whose frames
    are all intact and of today's schema is decoded at msgspec's speed and CRC-checked with one call
    over the whole chunk (see the module doc); any other chunk is parsed frame by frame. Damage
    followed by an intact frame anywhere in `data` (not only in the chunk or in [begin, stop)) raises
    LogCorruptError with the segment and byte offset; damage with nothing intact after it ends the
    iteration and is left in `bad` for the caller to judge (torn tail or corruption).

    Progress, readable at any time and final once the iteration ends: `next_seq` (the seq after the
    last record decoded), `end` (offset in `data` just after it), `bad` ((offset in `data`, reason)
    or None) and `last_offset` (segment offset, `base` included, where the last record decoded
    starts; -1 if none). As in `SegmentParse`, which `parse_segment` builds from them.

    Python's cyclic garbage collector is paused while a chunk decodes, and only then (never while
    the consumer holds the chunk): decoding makes tens of thousands of containers per MiB, each
    burst of them sets it scanning everything alive, and decoded events hold no cycles to find.
    Measured on an 8 MiB segment: 85-145 ms with it running, 44 ms paused. What the chunk decoded
    then goes straight to the collector's oldest generation (`_promote_young_objects`).

    The generator drops its reference to a chunk before it decodes the next, so a consumer that lets
    go of each chunk (`for chunk in chunks: ...; chunk = None`) holds about one chunk of decoded
    records, whatever the segment's size.
    """

    __slots__ = (
        "bad",
        "base",
        "data",
        "decoder",
        "end",
        "last_offset",
        "name",
        "next_seq",
        "promote",
        "records",
        "start_seq",
        "stop",
        "stop_seq",
    )

    def __init__(
        self,
        name: str,
        data: bytes,
        *,
        seq: int,
        decoder: EventDecoder,
        records: bool = True,
        base: int = 0,
        begin: int = 0,
        stop: int | None = None,
        start_seq: int | None = None,
        stop_seq: int | None = None,
    ) -> None:
        self.name = name
        self.data = data
        self.decoder = decoder
        self.records = records
        self.base = base
        self.stop = len(data) if stop is None else stop
        self.start_seq = start_seq
        self.stop_seq = stop_seq
        self.next_seq = seq
        self.end = begin
        self.bad: tuple[int, str] | None = None
        self.last_offset = -1
        self.promote = True  # until something is found frozen (see _promote_young_objects)

    def __iter__(self) -> Iterator[list]:
        stop_seq = self.stop_seq
        while self.end < self.stop and self.bad is None:
            if stop_seq is not None and self.next_seq >= stop_seq:
                return
            first = self.next_seq
            items = self._decode_chunk()
            if stop_seq is not None and self.next_seq > stop_seq:
                del items[stop_seq - first :]
                self.next_seq = stop_seq  # as far as the caller is concerned
            if self.start_seq is not None and first < self.start_seq:
                del items[: self.start_seq - first]
            if items:
                yield items
            items = None  # before the next chunk decodes: the consumer may have let go of this one

    def _decode_chunk(self) -> list:
        """Decode the next chunk, from `end` on; update the progress; return its items."""
        begin = self.end
        limit = min(begin + max(DECODE_CHUNK_BYTES, 1), self.stop)
        collecting = gc.isenabled()
        gc.disable()
        try:
            args = (self.name, self.data, self.next_seq, self.decoder, self.records, self.base, begin, limit)
            fast = _parse_fast(*args, self.stop)
            if fast is not None:
                items, self.end, last = fast
            else:
                items, self.end, last, self.bad = _parse_checked(*args)
        finally:
            if self.promote:
                self.promote = _promote_young_objects()
            if collecting:
                gc.enable()
        if items:
            self.next_seq += len(items)
            self.last_offset = last
        return items


def _promote_young_objects() -> bool:
    """Move every object the cyclic garbage collector tracks into its oldest generation, and reset
    the allocation count that starts the next collection (unless something is frozen: then nothing).

    Called after each chunk decodes with the collector paused. Otherwise the chunk's containers
    (two per step record) would start a collection of the young generation as soon as the
    collector runs again, and a consumer that keeps the records (`list(log.records())`) would have
    each of them scanned again in the middle generation and once more in the oldest: measured on a
    million-record log read in 1 MiB chunks, 1.3-1.5 s of collections on top of 1.1 s of decoding
    (reading whole 64 MiB segments, which let a collection run only three times, took 0.6 s of
    them; whole 8 MiB segments 1.4 s). Decoded events hold no reference cycles, so a collection
    could only ever scan them.

    `gc.freeze()` then `gc.unfreeze()` does exactly this: two list splices, no scan. What it also
    moves is the consumer's own young objects: a reference cycle among those is then found by the
    next full collection rather than the next young one (later, not never). Skipped when something
    is frozen, because unfreezing would thaw that too; returns False then, and the caller stops
    asking for the rest of the segment (counting frozen objects walks them all: 9 ms for a million)."""
    if gc.get_freeze_count():
        return False
    gc.freeze()
    gc.unfreeze()
    return True


def _parse_fast(
    name: str,
    data: bytes,
    seq: int,
    decoder: EventDecoder,
    records: bool,
    base: int,
    begin: int,
    limit: int,
    stop: int,
) -> tuple[list, int, int] | None:
    """The common case -- today's schema, every frame intact -- at close to msgspec's own speed.

    Decodes the frames from `begin` on until one ends at or past `limit` (at most at `stop`), then
    checks the CRC of all of them with one call, which also covers what this loop skips (the magic).
    Returns (items, offset after the last frame, segment offset of the last frame), or None at the
    first sign of anything else: the careful path then starts over at `begin` and says what is wrong."""
    items: list = []
    add = items.append
    view = memoryview(data)
    unpack = _LENGTH_VERSION_SEQ.unpack_from
    decode = decoder.decode_current
    current = _events.SCHEMA_VERSION  # read at call time, so tests can pretend to be newer code
    offset = begin
    last = -1
    try:
        while offset < limit:
            length, version, record_seq = unpack(data, offset)
            last = offset
            start = offset + HEADER_SIZE
            offset = start + length + 4
            if record_seq != seq or version != current:
                return None
            event = decode(view[start : offset - 4])
            add(Record(seq, version, name, base + start - HEADER_SIZE, event) if records else event)
            seq += 1
    except Exception:  # a partial header (struct.error), bytes that are no event (msgspec raises more
        return None  # than DecodeError on garbage)
    if offset > stop:
        return None
    chunk = data if (begin, offset) == (0, len(data)) else data[begin:offset]  # extend() takes no memoryview
    if _extend(RESIDUE, chunk) != RESIDUE:
        return None
    return items, offset, base + last


def _parse_checked(
    name: str, data: bytes, seq: int, decoder: EventDecoder, records: bool, base: int, begin: int, limit: int
) -> tuple[list, int, int, tuple[int, str] | None]:
    """Frame by frame from `begin` until a frame ends at or past `limit`, each checked on its own:
    finds and names whatever made the fast path give up. Returns (items, offset after the last
    intact frame, segment offset of the last one (-1 if none), bad)."""
    items: list = []
    view = memoryview(data)
    offset = begin
    last = -1
    while offset < limit:
        try:
            record_seq, version, start, payload_end, end = parse_frame(data, offset)
        except BadFrame as exc:
            if find_next_frame(data, offset + 1) is not None:
                raise LogCorruptError(name, base + offset, f"{exc.reason}, intact records follow") from None
            return items, offset, last, (offset, exc.reason)
        _check_seq(name, base + offset, record_seq, seq)
        try:
            event = decoder.decode(version, view[start:payload_end])
        except (msgspec.DecodeError, ValueError) as exc:  # msgspec raises UnicodeDecodeError on bad UTF-8
            raise LogCorruptError(
                name, base + offset, f"undecodable payload of record {seq}: {exc}"
            ) from None
        except SchemaUnreadable as exc:
            raise UnsupportedSchemaError(name, base + offset, str(exc)) from None
        items.append(Record(seq, version, name, base + offset, event) if records else event)
        last = base + offset
        seq += 1
        offset = end
    return items, offset, last, None


def _check_seq(name: str, offset: int, found: int, expected: int) -> None:
    if found != expected:
        kind = "gap" if found > expected else "duplicate or out of order"
        raise LogCorruptError(name, offset, f"sequence {kind}: record {found}, expected {expected}")


class TornTail(msgspec.Struct, frozen=True):
    """Bytes at the end of the last segment that are not a complete record (a write cut short)."""

    segment: str
    offset: int
    num_bytes: int
    reason: str = ""


class Problem(msgspec.Struct, frozen=True):
    segment: str
    offset: int
    message: str


class LogReport(msgspec.Struct, kw_only=True):
    """What a verification found: every problem with its location, and a torn tail (not a problem:
    opening the log for writing repairs it). `index_problems` are about the segment index files
    (`rewind.stores.logindex`), a cache that readers check before use: the log itself is fine."""

    num_segments: int = 0
    num_records: int = 0
    num_bytes: int = 0
    next_seq: int = 0
    problems: list[Problem] = []
    torn_tail: TornTail | None = None
    index_problems: list[Problem] = []

    @property
    def ok(self) -> bool:
        return not self.problems and not self.index_problems


def audit_segments(segments: Iterable[tuple[str, bytes, bool]], report: LogReport) -> LogReport:
    """Check (name, bytes, is_last) segments in order like parse_segment, but record every problem
    in `report` instead of raising, skipping each damaged stretch to the next intact frame."""
    decoder = EventDecoder()
    seq = report.next_seq
    for name, data, is_last in segments:
        offset = 0
        while offset < len(data):
            try:
                record_seq, version, start, payload_end, end = parse_frame(data, offset)
            except BadFrame as exc:
                resume = find_next_frame(data, offset + 1)
                if resume is None and is_last:
                    report.torn_tail = TornTail(name, offset, len(data) - offset, exc.reason)
                    break
                skipped = f"{len(data) - offset if resume is None else resume - offset} bytes skipped"
                report.problems.append(Problem(name, offset, f"{exc.reason}; {skipped}"))
                if resume is None:
                    break
                offset = resume
                continue
            if record_seq != seq:
                kind = "gap" if record_seq > seq else "duplicate or out of order"
                report.problems.append(
                    Problem(name, offset, f"sequence {kind}: record {record_seq}, expected {seq}")
                )
            try:
                decoder.decode(version, data[start:payload_end])
            except (msgspec.DecodeError, ValueError) as exc:
                report.problems.append(
                    Problem(name, offset, f"undecodable payload of record {record_seq}: {exc}")
                )
            except SchemaUnreadable as exc:
                report.problems.append(Problem(name, offset, f"unsupported schema: {exc}"))
            report.num_records += 1
            seq = max(seq, record_seq + 1)
            offset = end
        report.num_segments += 1
        report.num_bytes += len(data)
    report.next_seq = seq
    return report
