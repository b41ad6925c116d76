"""Seeking in the event log without an index: which segment holds a record, and where in it it starts.

`locate` finds the segment holding a seq by a binary search over the first record's header of each
(O(log n) small reads); `skip_records` walks frame headers from a commit-group boundary to a record
(a fraction of a microsecond per record skipped, payloads unread); `part_chunks` decodes a segment from
the record wanted on, and falls back to decoding it whole where the headers do not lead there, which
then names the damage or the torn tail.
"""

from __future__ import annotations

from collections.abc import Sequence

from rewind.stores.codec import (
    HEADER_SIZE,
    BadFrame,
    EventDecoder,
    parse_header,
)
from rewind.stores.fsio import Location
from rewind.stores.logindex import first_record_seq
from rewind.stores.segparse import SegmentChunks
from rewind.stores.segsource import WINDOW_BYTES, SegmentSource, open_segment


def locate(events_dir: Location, segments: Sequence[str], start_seq: int) -> tuple[int, int]:
    """(position in `segments`, its first seq) of the segment that holds record `start_seq` (or the
    last one), by a binary search over the first record's header of each: O(log n) small reads, no
    index file needed. Starting too early is always right (the caller reads on to the end, skipping
    what it does not want), so a segment whose header says nothing usable counts as starting too late.
    Headers are not CRC-checked here; the records read from the segment found are."""
    low, high, low_seq = 0, len(segments), 0  # invariant: segments[low] starts at low_seq <= start_seq
    while high - low > 1:
        middle = (low + high) // 2
        with open_segment(events_dir.join(segments[middle])) as source:
            seq = first_record_seq(source)
        if seq is not None and low_seq < seq <= start_seq:
            low, low_seq = middle, seq
        else:
            high = middle
    return low, low_seq


def part_chunks(
    name: str,
    source: SegmentSource,
    *,
    first_seq: int,
    start_seq: int,
    stop_seq: int | None,
    decoder: EventDecoder,
    records: bool,
) -> SegmentChunks:
    """The records with start_seq <= seq < stop_seq of segment `name` (first record `first_seq`), a
    chunk at a time, decoding and CRC-checking only those when the frame headers lead to them, else
    decoding from the first record and dropping those before `start_seq`. Offsets are the segment's;
    `next_seq` ends as the seq after the last record parsed (at most `stop_seq`).

    Damage inside a part cut short by `stop_seq` is judged against the whole segment, as a read to
    its end would (an intact frame anywhere after it makes it corruption, raised at once), so that
    the caller can tell a torn tail from corruption by `bad` alone."""
    bounds = _part_bounds(source, first_seq, start_seq, stop_seq)
    if bounds is not None:
        begin, end, seq, group_start = bounds
        return SegmentChunks(
            name,
            source,
            seq=seq,
            decoder=decoder,
            records=records,
            begin=begin,
            stop=end,
            group_start=group_start,
        )
    return SegmentChunks(
        name, source, seq=first_seq, decoder=decoder, records=records, start_seq=start_seq, stop_seq=stop_seq
    )


def _part_bounds(
    source: SegmentSource, first_seq: int, start_seq: int, stop_seq: int | None
) -> tuple[int, int, int, int] | None:
    """(begin, end, seq at begin, where the commit group holding it starts) of the bytes that hold
    records [start_seq, stop_seq), found by walking frame headers; None where they do not lead there."""
    begin, seq, group_start = 0, first_seq, 0
    if start_seq > first_seq:
        found = skip_records(source, 0, first_seq, start_seq)
        if found is None:
            return None
        begin, seq, group_start = found
    if stop_seq is None:
        return begin, source.size, seq, group_start
    stop = skip_records(source, begin, seq, stop_seq)
    return None if stop is None else (begin, stop[0], seq, group_start)


def skip_records(source: SegmentSource, offset: int, seq: int, target: int) -> tuple[int, int, int] | None:
    """(offset, seq, group start) of record `target`, walking frame headers from record `seq` at
    `offset` (a commit group boundary) a window at a time; where the segment ends first, (its size,
    the seq that would come next, ...). The group start is where the commit group holding that
    record starts (after the last frame that closed one).

    Checks headers only, not payloads (seeking costs a fraction of a microsecond per record skipped):
    the caller parses from the offset found, which checks everything it returns. None when a header
    is not intact where it should be or lacks the expected seq, or a frame runs past the end: the
    caller then parses the whole segment, which names the damage or the torn tail."""
    window, window_start, group_start = b"", offset, offset
    while seq < target and offset < source.size:
        at = offset - window_start
        if at + HEADER_SIZE > len(window):
            window, window_start, at = source.read(offset, WINDOW_BYTES), offset, 0
        try:
            header = parse_header(window, at)
        except BadFrame:
            return None
        if header.seq != seq:
            return None
        offset = window_start + header.end
        seq += 1
        if header.closing:
            group_start = offset
    return (offset, seq, group_start) if offset <= source.size else None
