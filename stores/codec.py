"""Record framing and event (de)coding for the event log: pure bytes in, events out.

Frame of one record (little endian):

    offset    size  field
    0         4     magic    b"\\x89RWL" (a non-ASCII first byte, so text never looks like a frame)
    4         4     length   payload bytes (n)
    8         2     version  schema version the payload was written with (`SCHEMA_VERSION` today)
    10        8     seq      record number, contiguous over the whole log, first = 0
    18        n     payload  msgspec msgpack encoding of one event (tagged: "type" = class name)
    18 + n    4     crc      CRC32C of bytes [0, 18 + n) of the frame, started from RESIDUE

A bit flip anywhere in a frame is caught by its CRC, which covers the whole frame, the length too (a
flipped length moves the frame's end, and the CRC no longer matches).

Why the CRC starts from RESIDUE (0x48674BC7) rather than 0: any CRC32C run over some bytes and then
over its own value ends at that constant. So a frame leaves the CRC at RESIDUE, and a whole run of
intact frames checks with one call, `extend(RESIDUE, bytes) == RESIDUE` -- the reader's fast path
verifies each chunk of a segment it decodes (`SegmentChunks`, about a MiB of whole frames) at memory
speed instead of paying a call per record (the cumulative-checksum idea of SQLite's WAL). Each frame
still checks on its own, which is how damage is located.

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

MAGIC = b"\x89RWL"
HEADER = struct.Struct("<4sIHQ")  # magic, length, version, seq
HEADER_SIZE = HEADER.size
_LENGTH_VERSION_SEQ = struct.Struct("<4xIHQ")  # the header without its magic
TRAILER = struct.Struct("<I")  # crc
FRAME_OVERHEAD = HEADER_SIZE + TRAILER.size
RESIDUE = 0x48674BC7  # CRC32C of any bytes followed by their own CRC32C (little endian)
_MAX_PAYLOAD = (1 << 32) - 1

# Upgrades the raw decoded dict of an event written with schema version v to version v + 1.
# Register one whenever SCHEMA_VERSION is bumped; a log is only readable if the whole chain exists.
UPCASTERS: dict[int, Callable[[dict], dict]] = {}

_extend = google_crc32c.extend


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


class BadFrame(Exception):
    """Internal: the bytes at an offset are not a complete, intact frame (`reason` says why)."""

    def __init__(self, reason: str):
        self.reason = reason
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


class Frame(NamedTuple):
    seq: int
    version: int
    payload_start: int
    payload_end: int
    end: int  # frame end


def encode_frame(seq: int, payload: bytes, version: int = SCHEMA_VERSION) -> bytes:
    """One frame around already-encoded payload bytes (tests and tools write odd versions with it)."""
    if len(payload) > _MAX_PAYLOAD:
        raise ValueError(f"event payload of {len(payload)} bytes exceeds the 4 GiB frame limit")
    body = HEADER.pack(MAGIC, len(payload), version, seq) + payload
    return body + TRAILER.pack(_extend(RESIDUE, body))


class FrameEncoder:
    """Appends framed events to a bytearray with one reused msgspec encoder."""

    def __init__(self) -> None:
        self._encode = msgspec.msgpack.Encoder().encode
        self._version = _events.SCHEMA_VERSION
        self.last_crc = 0  # CRC of the last frame appended (the writer's segment index records it)

    def append(self, buffer: bytearray, seq: int, event: Any) -> int:
        """Frame `event` as record `seq` at the end of `buffer`; returns the frame size in bytes.
        (encode_frame inlined: this runs once per event.)"""
        payload = self._encode(event)
        body = HEADER.pack(MAGIC, len(payload), self._version, seq) + payload
        buffer += body
        self.last_crc = crc = _extend(RESIDUE, body)
        buffer += TRAILER.pack(crc)
        return len(body) + 4


def parse_frame(data: bytes, offset: int) -> Frame:
    """Check the frame at `offset` on its own; raise BadFrame with the reason if it is not intact."""
    left = len(data) - offset
    if left < HEADER_SIZE:
        raise BadFrame(f"incomplete record header ({left} of {HEADER_SIZE} bytes)")
    magic, length, version, seq = HEADER.unpack_from(data, offset)
    if magic != MAGIC:
        raise BadFrame(f"no record starts here (magic {magic.hex()}, expected {MAGIC.hex()})")
    payload_end = offset + HEADER_SIZE + length
    end = payload_end + TRAILER.size
    if end > len(data):
        raise BadFrame(f"incomplete record ({left} of {end - offset} bytes)")
    if _extend(RESIDUE, data[offset:payload_end]) != TRAILER.unpack_from(data, payload_end)[0]:
        raise BadFrame("CRC mismatch")
    return Frame(seq, version, offset + HEADER_SIZE, payload_end, end)


def skip_records(data: bytes, offset: int, seq: int, target: int) -> tuple[int, int] | None:
    """(offset, seq) of record `target` in `data`, walking frame headers from record `seq` at `offset`;
    where the data ends first, (len(data), the seq that would come next).

    Neither decodes nor checks CRCs (seeking into a segment costs a fraction of a microsecond per
    record skipped): the caller parses from the offset found, which checks everything it returns.
    None when a header is not where it should be or lacks the expected seq, or a frame runs past the
    end: the caller then parses the whole segment, which names the damage or the torn tail."""
    unpack = HEADER.unpack_from
    while seq < target and offset < len(data):
        if offset + HEADER_SIZE > len(data):
            return None
        magic, length, _, record_seq = unpack(data, offset)
        if magic != MAGIC or record_seq != seq:
            return None
        offset += FRAME_OVERHEAD + length
        seq += 1
    return (offset, seq) if offset <= len(data) else None


def find_next_frame(data: bytes, start: int) -> int | None:
    """Offset of the first intact frame at or after `start`, or None: tells a torn tail (nothing
    valid follows the damage) from corruption in the middle (valid records after it)."""
    offset = data.find(MAGIC, start)
    while offset >= 0:
        try:
            parse_frame(data, offset)
            return offset
        except BadFrame:
            offset = data.find(MAGIC, offset + 1)
    return None


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
