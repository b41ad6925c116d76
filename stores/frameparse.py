"""Parsing one window of a segment's frames (rewind.stores.segparse hands the windows over, a chunk at a
time): `parse_fast` for the common case (today's schema, every frame intact: decoded in one loop, the
whole window's CRC checked with one call), `parse_checked` frame by frame, which names what is wrong
and where when the fast path gives up. Both stop where the window's whole frames end, and say which
of them close a commit group (only closed groups are handed on).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import msgspec

from rewind.states import events as _events
from rewind.stores.codec import (
    HEADER_SIZE,
    MAGIC,
    MAGIC_V1,
    RESIDUE,
    BadFrame,
    EventDecoder,
    LogCorruptError,
    Record,
    SchemaUnreadable,
    UnsupportedSchemaError,
    crc_extend,
    parse_frame,
)

# Format 2's header up to its flags, the magic read as its third byte only (format 1's header and 2
# bytes more): that byte tells the formats apart, and the chunk's CRC covers the rest of the magic.
_FAST_HEADER = struct.Struct("<2xBxIHQH")
_KIND_V2, _KIND_V1 = MAGIC[2], MAGIC_V1[2]


class Parsed(NamedTuple):
    """What one window parsed into (offsets the segment's): `items` up to `frames_end`, of which the
    first `num_closed` end with a frame that closes a commit group, at `closed`; `bad`: the offset
    and the reason where a frame is not intact (None: the window ended on whole frames)."""

    items: list
    frames_end: int
    closed: int
    num_closed: int
    last: int  # where the last item's frame starts
    last_closed: int  # where the last closing frame starts
    bad: tuple[int, BadFrame] | None = None


def parse_fast(
    name: str,
    data: bytes,
    begin: int,
    limit: int,
    seq: int,
    decoder: EventDecoder,
    records: bool,
    at_end: bool,
) -> Parsed | None:
    """The common case -- today's schema, every frame intact -- at close to msgspec's own speed.

    Decodes the frames of `data` (the bytes of the segment from `begin` on) that start before
    `limit`, the last one running on into the slack after it, then checks the CRC of all of them
    with one call, which also covers what this loop skips (the magic but its third byte, the header
    CRCs). None at the first sign of anything else (or a frame that runs past `data`): the careful
    path then starts over and says what is wrong."""
    items: list = []
    add = items.append
    view = memoryview(data)
    unpack = _FAST_HEADER.unpack_from
    decode = decoder.decode_current
    current = _events.SCHEMA_VERSION  # read at call time, so tests can pretend to be newer code
    offset = closed = num_closed = 0
    last = last_closed = -1
    try:
        # One format per loop (a segment changes format at most once, where a new writer appended to
        # an old log: the careful path takes that chunk), so the common loop tests one byte per frame.
        kind = data[2] if limit > 0 else _KIND_V2
        size, closes = (HEADER_SIZE, 0) if kind == _KIND_V2 else (18, 1)  # format 1: every frame closes
        if kind not in (_KIND_V2, _KIND_V1):
            return None
        while offset < limit:
            this_kind, length, version, record_seq, flags = unpack(data, offset)
            if this_kind != kind or record_seq != seq or version != current:
                return None
            last = offset
            start = offset + size
            offset = start + length + 4
            event = decode(view[start : offset - 4])  # cut short by the end of `data`: see below
            add(Record(seq, version, name, begin + last, event) if records else event)
            seq += 1
            if (flags | closes) & 1:  # END_OF_GROUP
                closed, num_closed, last_closed = offset, len(items), last
    except Exception:  # a partial header (struct.error), bytes that are no event (msgspec raises more
        return None  # than DecodeError on garbage)
    if offset > len(data):  # the last frame runs past the window's slack (or the segment's end)
        return None
    chunk = data if offset == len(data) else data[:offset]  # extend() takes no memoryview
    if crc_extend(RESIDUE, chunk) != RESIDUE:
        return None
    return Parsed(items, begin + offset, begin + closed, num_closed, begin + last, begin + last_closed)


def parse_checked(
    name: str,
    data: bytes,
    begin: int,
    limit: int,
    seq: int,
    decoder: EventDecoder,
    records: bool,
    at_end: bool,
) -> Parsed:
    """Frame by frame through `data` (as in `parse_fast`), each checked on its own: finds and names
    whatever made the fast path give up. Stops at the first frame that is not intact (`bad`), or at
    one that runs past the window when more of the segment follows (a chunk boundary, not damage)."""
    items: list = []
    view = memoryview(data)
    offset = closed = num_closed = 0
    last = last_closed = -1
    bad = None
    while offset < limit:
        try:
            record_seq, version, start, payload_end, end, closing = parse_frame(data, offset)
        except BadFrame as exc:
            cut = exc.header.end > len(data) if exc.header is not None else len(data) - offset < HEADER_SIZE
            if not (cut and not at_end and offset > 0):
                bad = (begin + offset, exc)
                if exc.header is not None:
                    shift = begin
                    exc.header = exc.header._replace(
                        payload_start=exc.header.payload_start + shift,
                        payload_end=exc.header.payload_end + shift,
                        end=exc.header.end + shift,
                    )
            break
        _check_seq(name, begin + offset, record_seq, seq)
        try:
            event = decoder.decode(version, view[start:payload_end])
        except (msgspec.DecodeError, ValueError) as exc:  # msgspec raises UnicodeDecodeError on bad UTF-8
            raise LogCorruptError(
                name, begin + offset, f"undecodable payload of record {seq}: {exc}"
            ) from None
        except SchemaUnreadable as exc:
            raise UnsupportedSchemaError(name, begin + offset, str(exc)) from None
        items.append(Record(seq, version, name, begin + offset, event) if records else event)
        last = offset
        seq += 1
        offset = end
        if closing:
            closed, num_closed, last_closed = end, len(items), last
    return Parsed(items, begin + offset, begin + closed, num_closed, begin + last, begin + last_closed, bad)


def _check_seq(name: str, offset: int, found: int, expected: int) -> None:
    if found != expected:
        kind = "gap" if found > expected else "duplicate or out of order"
        raise LogCorruptError(name, offset, f"sequence {kind}: record {found}, expected {expected}")
