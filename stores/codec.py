"""Record framing and event (de)coding for the event log: pure bytes in, events out.

Frame of one record, format 2 (what every writer writes; little endian):

    offset    size  field
    0         4     magic    b"\\x89RLG" (a non-ASCII first byte, so text never looks like a frame)
    4         4     length   payload bytes (n), at most MAX_PAYLOAD
    8         2     version  schema version the payload was written with (`SCHEMA_VERSION` today)
    10        8     seq      record number, contiguous over the whole log, first = 0
    18        2     flags    bit 0: END_OF_GROUP, set on the last frame of each write a commit syncs
    20        4     hcrc     CRC32C of bytes [0, 20) of the frame, started from RESIDUE
    24        n     payload  msgspec msgpack encoding of one event (tagged: "type" = class name)
    24 + n    4     crc      CRC32C of bytes [0, 24 + n) of the frame, started from RESIDUE

Format 1 (logs written before commit groups were marked; still read, never written):

    0 magic b"\\x89RWL", 4 length, 8 version, 10 seq, 18 payload, 18 + n crc of [0, 18 + n)

The magics differ in 7 bits, so a flipped bit never turns one format into the other. Length, version
and seq sit at the same offsets in both.

The end-of-group mark is what lets recovery tell "never acknowledged" from "damaged". A commit writes
its frames and syncs them; only then does it return. So the frames after the last intact END_OF_GROUP
frame of the log, if no intact END_OF_GROUP frame follows them, were never acknowledged: a torn tail,
whatever they contain (a write cut short, a zero-filled hole where a block never reached the disk,
then intact frames). An END_OF_GROUP frame whose header is intact but whose payload fails its CRC was
acknowledged: that is damage, and nothing is cut. Hence the header's own CRC: it vouches for the flag
(and the length) of a frame whose payload is bad. A format-1 frame is a group of its own (the rule
before marks existed: damage with nothing intact after it is a torn tail).

Why CRCs start from RESIDUE (0x48674BC7) rather than 0: any CRC32C run over some bytes and then over
its own value ends at that constant. The header ends with its CRC, so the CRC of a whole frame is
back at RESIDUE after the header; the trailer is therefore also the CRC of the payload alone
(`extend(RESIDUE, payload)`), which checks a payload whose header is damaged. And a frame of either
format leaves the CRC at RESIDUE, so a whole run of intact frames checks with one call,
`extend(RESIDUE, bytes) == RESIDUE` -- the reader's fast path verifies each chunk of a segment it
decodes (`SegmentChunks`, about a MiB of whole frames) at memory speed instead of paying a call per
record (the cumulative-checksum idea of SQLite's WAL). Each frame still checks on its own, which is
how damage is located.

Schema evolution: a payload whose version equals `SCHEMA_VERSION` decodes straight into `AnyEvent`.
An older one decodes into a dict, goes through `UPCASTERS[v]` (v -> v + 1) up to today's version and
is converted. A newer one raises `UnsupportedSchemaError`: this code cannot know what it means.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import google_crc32c
import msgspec

from rewind.states import events as _events
from rewind.states.events import SCHEMA_VERSION, AnyEvent

FRAME_FORMAT = 2  # what writers write (the module doc)
MAGIC = b"\x89RLG"  # format 2
MAGIC_V1 = b"\x89RWL"  # format 1
HEADER = struct.Struct("<4sIHQHI")  # magic, length, version, seq, flags, header CRC
HEADER_SIZE = HEADER.size
HEADER_V1 = struct.Struct("<4sIHQ")  # magic, length, version, seq
HEADER_SIZE_V1 = HEADER_V1.size
CHECKED_HEADER = struct.Struct("<4sIHQH")  # the part of a format-2 header its CRC covers
LENGTH_VERSION_SEQ = struct.Struct("<4xIHQ")  # the header without its magic (both formats)
TRAILER = struct.Struct("<I")  # crc
FRAME_OVERHEAD = HEADER_SIZE + TRAILER.size
END_OF_GROUP = 1  # flags bit
RESIDUE = 0x48674BC7  # CRC32C of any bytes followed by their own CRC32C (little endian)
# The largest payload a frame may carry: readers never believe a length above it, so that a damaged
# or hostile length cannot make them allocate gigabytes. Events are a few hundred bytes.
MAX_PAYLOAD = 64 << 20
MAX_FRAME = MAX_PAYLOAD + FRAME_OVERHEAD

# Upgrades the raw decoded dict of an event written with schema version v to version v + 1.
# Register one whenever SCHEMA_VERSION is bumped; a log is only readable if the whole chain exists.
UPCASTERS: dict[int, Callable[[dict], dict]] = {}

crc_extend = google_crc32c.extend


class LogError(Exception):
    """Base of every error of the event log that a user can cause (or has to deal with)."""


class LogCorruptError(LogError):
    """The log's bytes are damaged at `segment`, byte `offset`. Nothing is skipped or rewritten."""

    def __init__(self, segment: str, offset: int, reason: str):
        self.segment = segment
        self.offset = offset
        self.reason = reason
        super().__init__(f"corrupt event log: {segment} at byte {offset}: {reason}")


class UnsupportedSchemaError(LogError):
    """A record written with a schema version this code cannot read (newer, or no upcaster)."""

    def __init__(self, segment: str, offset: int, reason: str):
        self.segment = segment
        self.offset = offset
        self.reason = reason
        super().__init__(f"unsupported event schema: {segment} at byte {offset}: {reason}")


class LogWriteError(LogError):
    """A commit could not be made durable (full disk, I/O error, a lost lease), or the writer is unusable."""


class UnreadableSegmentError(LogError):
    """A segment (or the events directory) that is no regular file this run owns: nothing is read."""


class BadFrame(Exception):
    """Internal: the bytes at an offset are not a complete, intact frame (`reason` says why).
    `header`: the frame's header where it is intact (its payload is what is wrong), else None."""

    def __init__(self, reason: str, header: Header | None = None):
        self.reason = reason
        self.header = header
        super().__init__(reason)


class SchemaUnreadable(Exception):
    """Internal: a payload's schema version cannot be brought to today's (the message says why)."""


class Record(msgspec.Struct, frozen=True, gc=False):
    """One committed record: its sequence number, schema version, where it lives, and the event."""

    seq: int
    version: int
    segment: str
    offset: int
    event: Any


class Header(NamedTuple):
    """A frame's header, checked as far as it can be on its own (format 2: by its CRC)."""

    format: int  # 1 or 2
    seq: int
    version: int
    payload_start: int  # offsets in the bytes parsed
    payload_end: int
    end: int  # frame end
    closing: bool  # ends a commit group: END_OF_GROUP set, or any format-1 frame


class Frame(NamedTuple):
    seq: int
    version: int
    payload_start: int
    payload_end: int
    end: int  # frame end
    closing: bool = True  # see Header


def encode_frame(
    seq: int,
    payload: bytes,
    version: int = SCHEMA_VERSION,
    *,
    end_of_group: bool = True,
    frame_format: int = 2,
) -> bytes:
    """One frame around already-encoded payload bytes (tests and tools write odd versions, unmarked
    frames and format-1 frames with it)."""
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(
            f"event payload of {len(payload)} bytes exceeds the {MAX_PAYLOAD >> 20} MiB frame limit"
        )
    if frame_format == 1:
        body = HEADER_V1.pack(MAGIC_V1, len(payload), version, seq) + payload
        return body + TRAILER.pack(crc_extend(RESIDUE, body))
    head = CHECKED_HEADER.pack(MAGIC, len(payload), version, seq, END_OF_GROUP if end_of_group else 0)
    return head + TRAILER.pack(crc_extend(RESIDUE, head)) + payload + TRAILER.pack(crc_extend(RESIDUE, payload))


class FrameEncoder:
    """Appends framed events to a bytearray with one reused msgspec encoder. Frames are written
    without END_OF_GROUP; the writer marks the last one of each write with `mark_end_of_group`."""

    def __init__(self) -> None:
        self._encode = msgspec.msgpack.Encoder().encode
        self._version = _events.SCHEMA_VERSION
        self.last_crc = 0  # CRC of the last frame appended (the writer's segment index records it)

    def append(self, buffer: bytearray, seq: int, event: Any) -> int:
        """Frame `event` as record `seq` at the end of `buffer`; returns the frame size in bytes.
        (encode_frame inlined: this runs once per event.)"""
        payload = self._encode(event)
        if len(payload) > MAX_PAYLOAD:
            raise ValueError(
                f"event payload of {len(payload)} bytes exceeds the {MAX_PAYLOAD >> 20} MiB frame limit"
            )
        head = CHECKED_HEADER.pack(MAGIC, len(payload), self._version, seq, 0)
        buffer += head
        buffer += TRAILER.pack(crc_extend(RESIDUE, head))
        buffer += payload
        self.last_crc = crc = crc_extend(RESIDUE, payload)  # = the CRC of the whole frame (module doc)
        buffer += TRAILER.pack(crc)
        return len(payload) + FRAME_OVERHEAD


def mark_end_of_group(buffer: bytearray, offset: int) -> None:
    """Set END_OF_GROUP on the format-2 frame at `offset` of `buffer`, in place. Only the header CRC
    changes: the trailer is the payload's CRC (module doc)."""
    fields = list(CHECKED_HEADER.unpack_from(buffer, offset))
    fields[4] |= END_OF_GROUP
    head = CHECKED_HEADER.pack(*fields)
    buffer[offset : offset + HEADER_SIZE] = head + TRAILER.pack(crc_extend(RESIDUE, head))


def parse_header(data: bytes, offset: int) -> Header:
    """The header of the frame at `offset`, checked on its own; BadFrame with the reason if it is not
    intact as far as can be told (format 1 has no header CRC: only its magic and length)."""
    left = len(data) - offset
    magic = data[offset : offset + 4]
    if magic == MAGIC:
        if left < HEADER_SIZE:
            raise BadFrame(f"incomplete record header ({left} of {HEADER_SIZE} bytes)")
        _, length, version, seq, flags, crc = HEADER.unpack_from(data, offset)
        if crc_extend(RESIDUE, data[offset : offset + HEADER_SIZE - 4]) != crc:
            raise BadFrame("header CRC mismatch")
        start, closing = offset + HEADER_SIZE, bool(flags & END_OF_GROUP)
        frame_format = 2
    elif magic == MAGIC_V1:
        if left < HEADER_SIZE_V1:
            raise BadFrame(f"incomplete record header ({left} of {HEADER_SIZE_V1} bytes)")
        _, length, version, seq = HEADER_V1.unpack_from(data, offset)
        start, closing, frame_format = offset + HEADER_SIZE_V1, True, 1
    elif left < 4:
        raise BadFrame(f"incomplete record header ({left} of {HEADER_SIZE} bytes)")
    else:
        raise BadFrame(f"no record starts here (magic {magic.hex()}, expected {MAGIC.hex()})")
    if length > MAX_PAYLOAD:
        raise BadFrame(f"implausible record length {length} (at most {MAX_PAYLOAD})")
    return Header(frame_format, seq, version, start, start + length, start + length + TRAILER.size, closing)


def parse_frame(data: bytes, offset: int) -> Frame:
    """Check the frame at `offset` on its own; raise BadFrame with the reason if it is not intact."""
    header = parse_header(data, offset)
    if header.end > len(data):
        raise BadFrame(f"incomplete record ({len(data) - offset} of {header.end - offset} bytes)", header)
    # Format 2: the header checked to RESIDUE, so the payload's CRC is the frame's (module doc).
    start = offset if header.format == 1 else header.payload_start
    if crc_extend(RESIDUE, data[start : header.payload_end]) != TRAILER.unpack_from(data, header.payload_end)[0]:
        raise BadFrame("CRC mismatch" if header.format == 1 else "payload CRC mismatch", header)
    return Frame(
        header.seq, header.version, header.payload_start, header.payload_end, header.end, header.closing
    )


def frame_size(data: bytes, offset: int) -> int | None:
    """The size the header at `offset` declares, if the header is intact; else None."""
    try:
        header = parse_header(data, offset)
    except BadFrame:
        return None
    return header.end - offset


class EventDecoder:
    """Payload bytes -> event, for any schema version that has an upcaster chain to today's."""

    def __init__(self) -> None:
        self.decode_current = msgspec.msgpack.Decoder(AnyEvent).decode
        self._decode_raw = msgspec.msgpack.Decoder().decode

    def decode(self, version: int, payload: bytes | memoryview) -> Any:
        """Raises msgspec.DecodeError for bytes that are no event, SchemaUnreadable for a version
        newer than this code or without an upcaster chain."""
        current = _events.SCHEMA_VERSION  # read at call time, so tests can pretend to be newer code
        if version == current:
            return self.decode_current(payload)
        if version > current:
            raise SchemaUnreadable(f"written with schema version {version}, this code reads up to {current}")
        raw = self._decode_raw(payload)
        if not isinstance(raw, dict):
            raise msgspec.DecodeError(f"expected an event map, got {type(raw).__name__}")
        for old in range(version, current):
            upcaster = UPCASTERS.get(old)
            if upcaster is None:
                raise SchemaUnreadable(
                    f"written with schema version {version}; no upcaster from {old} to {old + 1}"
                )
            raw = upcaster(raw)
        return msgspec.convert(raw, AnyEvent)
