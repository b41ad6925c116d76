"""Parsing the segments of the event log: frames checked, decoded and handed on a chunk at a time.

`rewind.stores.codec` defines one frame (layout, CRCs, end-of-group marks, event decoding); this
module walks whole segments of them, through bounded windows of a `SegmentSource`
(`rewind.stores.segsource`): never a whole segment in memory. The fast path decodes a window of about
a MiB of whole frames and checks its CRC with one call; anything else (damage, an older schema) falls
back to a frame-by-frame parse that names what is wrong and where (both: `rewind.stores.frameparse`).
Only records of commit groups that closed are handed on; what follows the last closed group, if it
never closes, is a torn tail, and damage is told from it by the rules of `rewind.stores.segdamage` (the caller decides whether a torn
tail is allowed: only at the end of the last segment).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import NamedTuple

from rewind.stores.codec import (
    TRAILER,
    EventDecoder,
    frame_size,
)
from rewind.stores.frameparse import parse_checked, parse_fast
from rewind.stores.segdamage import (  # re-exported: the read side imports them from here
    FrameWalker,
    LogReport,
    Problem,
    TornTail,
    audit_segment,
    judge_tail,
)
from rewind.stores.segsource import SegmentSource, as_source

__all__ = [
    "LogReport",
    "Problem",
    "SegmentChunks",
    "SegmentParse",
    "TornTail",
    "audit_segment",
    "parse_segment",
]

# Readers decode a segment this many bytes (whole frames) at a time, handing each chunk's records on
# before decoding the next (`SegmentChunks`): what a streaming reader holds is about one chunk of
# decoded records (~4.5 times its bytes in objects) and its bytes, whatever the segment size. 1 MiB:
# a CRC call and a few Python calls per chunk cost nothing next to decoding its ~5,000 records.
DECODE_CHUNK_BYTES = 1 << 20
_SLACK_BYTES = 16 << 10  # read past a chunk's end, where its last frame ends (events are ~200 bytes)


class SegmentParse(NamedTuple):
    items: list  # Records, or bare events
    next_seq: int
    end: int  # offset just after the last record of a closed commit group
    bad: tuple[int, str, bool] | None  # (offset, reason, certain) of a torn tail: see SegmentChunks
    last_offset: int = -1  # offset in the segment where the last record starts
    last_crc: int = 0  # the CRC of the last record


def parse_segment(
    name: str, data: bytes | SegmentSource, *, seq: int, decoder: EventDecoder, records: bool = True
) -> SegmentParse:
    """Decode the records of segment `name` (bytes, or a source), the first expected to carry `seq`:
    all of `SegmentChunks` in one list. Stops at a torn tail (`bad`; the caller decides whether that
    is allowed); raises LogCorruptError for anything else that is wrong."""
    collecting = gc.isenabled()
    gc.disable()  # for the whole parse, not only for each chunk (see SegmentChunks)
    try:
        chunks = SegmentChunks(name, as_source(data, name), seq=seq, decoder=decoder, records=records)
        items: list = []
        for chunk in chunks:
            items += chunk
        return SegmentParse(
            items, chunks.next_seq, chunks.end, chunks.bad, chunks.last_offset, chunks.last_crc
        )
    finally:
        if collecting:
            gc.enable()


class SegmentChunks:
    """The records of segment `name` decoded a chunk at a time: iterating yields a list per chunk of
    whole frames of about DECODE_CHUNK_BYTES (never an empty one), each decoded only when asked for.

    `source` holds the segment's bytes (read a window at a time: never whole); what is decoded is
    [begin, stop) (all of it by default; `begin` a frame boundary), the first record there expected to
    carry `seq`; `group_start` is where the commit group holding that record starts (`begin` by
    default). With `start_seq`/`stop_seq`, only the records with start_seq <= seq < stop_seq are
    yielded, and decoding ends once `stop_seq` is reached.

    Every record yielded has been checked like a whole-segment read checks it, and belongs to a
    commit group that closed (its END_OF_GROUP frame is intact: in the chunk, or found further on
    before the records are handed on). A window whose frames are all intact and of today's schema is
    decoded at msgspec's speed and CRC-checked with one call over the whole window (see the codec's
    module doc); any other is parsed frame by frame. Damage where it is corruption (the rules of
    `rewind.stores.segdamage`, which look at the whole segment, not only [begin, stop)) raises
    LogCorruptError with the segment and byte offset; a commit group that never closed (a torn tail)
    ends the iteration and is left in `bad` for the caller to judge (allowed only at the end).

    Progress, readable at any time and final once the iteration ends: `next_seq` (the seq after the
    last record decoded), `end` (offset just after it), `bad` ((offset where the unclosed group
    starts, reason, certain) or None), `last_offset` (where the last record decoded starts; -1 if
    none) and `last_crc` (its CRC). As in `SegmentParse`, which `parse_segment` builds from them.

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
        "decoder",
        "end",
        "group_start",
        "last_crc",
        "last_offset",
        "name",
        "next_seq",
        "promote",
        "proven",
        "records",
        "source",
        "start_seq",
        "stop",
        "stop_seq",
    )

    def __init__(
        self,
        name: str,
        source: SegmentSource | bytes,
        *,
        seq: int,
        decoder: EventDecoder,
        records: bool = True,
        begin: int = 0,
        stop: int | None = None,
        start_seq: int | None = None,
        stop_seq: int | None = None,
        group_start: int | None = None,
    ) -> None:
        self.name = name
        self.source = as_source(source, name)
        self.decoder = decoder
        self.records = records
        self.stop = self.source.size if stop is None else min(stop, self.source.size)
        self.start_seq = start_seq
        self.stop_seq = stop_seq
        self.next_seq = seq
        self.end = begin
        self.group_start = begin if group_start is None else group_start
        self.bad: tuple[int, str, bool] | None = None
        self.last_offset = -1
        self.last_crc = 0
        self.proven = -1  # frames ending at or before this offset are known to be in a closed group
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

    def _window(self, begin: int) -> tuple[bytes, int]:
        """The bytes of the next chunk, and where in them the last frame of the chunk must start:
        about DECODE_CHUNK_BYTES and a slack for that frame to end in, or the first frame if it is
        larger (its intact header says how large, at most MAX_FRAME)."""
        left = self.stop - begin
        want = max(DECODE_CHUNK_BYTES, 1)
        data = self.source.read(begin, min(want + _SLACK_BYTES, left))
        need = frame_size(data, 0)
        if need is not None and len(data) < need:
            data = self.source.read(begin, min(need, left))
        return data, min(want, len(data))

    def _decode_chunk(self) -> list:
        """Decode the next chunk, from `end` on; update the progress; return its items."""
        begin = self.end
        collecting = gc.isenabled()
        gc.disable()
        try:
            data, limit = self._window(begin)
            at_end = begin + len(data) >= self.stop
            args = (self.name, data, begin, limit, self.next_seq, self.decoder, self.records, at_end)
            parsed = parse_fast(*args) or parse_checked(*args)
        finally:
            if self.promote:
                self.promote = _promote_young_objects()
            if collecting:
                gc.enable()
        items, end, last = parsed.items, parsed.frames_end, parsed.last
        if parsed.bad is None and parsed.num_closed and parsed.closed < end < self.stop:
            # The window ends inside a commit group, after others closed: end the chunk where the
            # last one did (the next decodes the rest again; cheaper than looking ahead for its end).
            del items[parsed.num_closed :]
            end, last = parsed.closed, parsed.last_closed
        elif parsed.bad is None and parsed.closed < end and end > self.proven:
            # The window ends inside a commit group: its records count only if the group closes.
            walker = FrameWalker(self.source, window=16 << 10)  # a commit's rest: usually a few KiB
            group_end, bad_at, exc = walker.group_end(end)
            if bad_at is None:
                self.proven = group_end
            elif exc is not None and walker.next_intact(bad_at + 1, closing=True) is not None:
                self.proven = bad_at  # acknowledged up to damage that a later chunk raises
            else:
                parsed = parsed._replace(bad=(bad_at, exc))
        if parsed.bad is not None:
            # Damage, or the end of the segment, inside a group: corruption (raised) or a torn tail.
            group_start = parsed.closed if parsed.num_closed else self.group_start
            bad_at, exc = parsed.bad
            walker = FrameWalker(self.source)
            reason, certain = judge_tail(self.source, self.name, bad_at, exc, group_start, walker)
            self.bad = (group_start, reason, certain)
            del items[parsed.num_closed :]
            end, last = (parsed.closed, parsed.last_closed) if parsed.num_closed else (begin, -1)
        if items:
            self.next_seq += len(items)
            self.last_offset = last
            self.last_crc = TRAILER.unpack_from(data, end - begin - TRAILER.size)[0]
        if parsed.num_closed:
            self.group_start = parsed.closed
        self.end = end
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
