"""Telling a tail that was never acknowledged from damage, and `audit_segment` for `rewind verify`.

The rule (see `rewind.stores.codec` for the end-of-group mark): a commit returns only after its
frames, the last one marked END_OF_GROUP, are synced. So, in a segment:

- damage followed by an intact END_OF_GROUP frame (or any intact format-1 frame) sits in data that
  was acknowledged: corruption, `LogCorruptError`, nothing cut;
- an END_OF_GROUP frame whose header is intact, that is complete, and whose payload fails its CRC
  was acknowledged too: corruption -- unless a whole disk sector of it reads as zeros, which is a
  block that never reached the disk (a crash inside the write), not a flipped bit;
- a complete frame whose header is damaged (magic still within 2 bits) but whose payload checks
  against its own CRC was complete on disk: corruption (its mark cannot be read, so it may have
  been acknowledged; refusing to cut is the safe side);
- anything else after the last intact END_OF_GROUP frame is a commit group that never got its mark:
  a torn tail, to be cut from the group's first byte, even where it holds a zero-filled hole followed
  by intact frames of the same group.

Every read here is bounded (`rewind.stores.segsource`): a 16 GiB tail costs windows, not memory.
"""

from __future__ import annotations

import msgspec

from rewind.stores.codec import (
    CHECKED_HEADER,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    MAGIC,
    MAGIC_V1,
    MAX_FRAME,
    MAX_PAYLOAD,
    RESIDUE,
    BadFrame,
    EventDecoder,
    Frame,
    LogCorruptError,
    SchemaUnreadable,
    crc_extend,
    parse_frame,
    parse_header,
)
from rewind.stores.segsource import WINDOW_BYTES, SegmentSource, find_magic, magic_in

_SECTOR = 512  # the smallest unit a disk writes: a hole left by a lost write is whole sectors


class TornTail(msgspec.Struct, frozen=True):
    """Bytes at the end of the last segment that were never acknowledged (a commit a crash cut short):
    from `offset`, the first byte of the unacknowledged commit group, to the end, `num_bytes`.
    Expected after a crash; opening the log for writing cuts them. `certain` is False only under the
    rule for format-1 frames (no end-of-group marks), where a damaged last record looks the same."""

    segment: str
    offset: int
    num_bytes: int
    reason: str = ""
    certain: bool = True


class Problem(msgspec.Struct, frozen=True):
    segment: str
    offset: int
    message: str


class LogReport(msgspec.Struct, kw_only=True):
    """What a verification found: every problem with its location, and a torn tail (not a problem:
    what a crash leaves, and opening the log for writing cuts it). `index_problems` are about the
    segment index files (`rewind.stores.logindex`), a cache that readers check before use: the log
    itself is fine."""

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


class FrameWalker:
    """Frames of a segment one at a time, checked on their own, through a window of about
    WINDOW_BYTES (or one frame): offsets are the segment's."""

    def __init__(self, source: SegmentSource, window: int = WINDOW_BYTES) -> None:
        self.source = source
        self.buffer = b""
        self.start = 0
        self.window = window  # the first read's size; each next one doubles, up to WINDOW_BYTES

    def _bytes(self, offset: int, size: int) -> tuple[bytes, int]:
        end = min(offset + size, self.source.size)
        if not (self.start <= offset and end <= self.start + len(self.buffer)):
            self.buffer, self.start = self.source.read(offset, max(size, self.window)), offset
            self.window = min(2 * self.window, WINDOW_BYTES)
        return self.buffer, offset - self.start

    def frame(self, offset: int) -> Frame:
        data, at = self._bytes(offset, HEADER_SIZE)
        shift = offset - at
        try:
            header = parse_header(data, at)
            data, at = self._bytes(offset, header.end - at)
            shift = offset - at
            seq, version, start, payload_end, end, closing = parse_frame(data, at)
        except BadFrame as exc:
            if exc.header is not None:
                h = exc.header
                exc.header = h._replace(
                    payload_start=h.payload_start + shift,
                    payload_end=h.payload_end + shift,
                    end=h.end + shift,
                )
            raise
        return Frame(seq, version, start + shift, payload_end + shift, end + shift, closing)

    def next_intact(self, start: int, *, closing: bool) -> int | None:
        """Offset of the first intact frame at or after `start` (with `closing`, of the first intact
        frame that closes a group, skipping intact frames that do not), or None."""
        offset = self._find_magic(start)
        while offset is not None:
            try:
                frame = self.frame(offset)
            except BadFrame:
                offset = self._find_magic(offset + 1)
                continue
            if frame.closing or not closing:
                return offset
            offset = self._find_magic(frame.end)
        return None

    def _find_magic(self, start: int) -> int | None:
        """find_magic, searching the window in hand first: a stretch dense with false magics (a
        crafted tail) then costs one read per window, not one per candidate."""
        end = self.start + len(self.buffer)
        if self.start <= start < end:
            found = magic_in(self.buffer, start - self.start)
            if found >= 0:
                return self.start + found
            start = max(start, end - 3)  # a magic may straddle the window's end
        return find_magic(self.source, start)

    def group_end(self, offset: int) -> tuple[int, int | None, BadFrame | None]:
        """Walk intact frames from `offset` to the first that closes its group: (offset after it,
        None, None); or, where that group never closes, (offset, where the walk stopped, why: None
        at the end of the segment)."""
        while offset < self.source.size:
            try:
                frame = self.frame(offset)
            except BadFrame as exc:
                return -1, offset, exc
            if frame.closing:
                return frame.end, None, None
            offset = frame.end
        return -1, offset, None


def judge_tail(
    source: SegmentSource, name: str, bad_at: int, exc: BadFrame | None, group_start: int, walker: FrameWalker
) -> tuple[str, bool]:
    """The bytes from `group_start` (just after the last frame that closed a group) are followed at
    `bad_at` by damage (`exc`; None: the segment ends there, the group unclosed). Raises
    LogCorruptError where that is damage to acknowledged data (module doc); else returns (reason,
    certain) for a torn tail starting at `group_start`."""
    if exc is None:
        return "a commit group with no end-of-group mark (the commit never returned)", True
    if walker.next_intact(bad_at + 1, closing=True) is not None:
        raise LogCorruptError(name, bad_at, f"{exc.reason}, intact records follow")
    header = exc.header
    if header is not None and header.format == 2 and header.closing and header.end <= source.size:
        if not _shows_hole(source, header.payload_start, header.end):
            raise LogCorruptError(
                name,
                bad_at,
                f"{exc.reason} in the last record of a commit that was acknowledged "
                "(its end-of-group mark is intact): damage, not a torn write; nothing cut",
            )
    elif header is None and _complete_despite_header(source, bad_at):
        raise LogCorruptError(
            name, bad_at, f"{exc.reason} in a complete record (its payload checks): damage, not a torn write"
        )
    certain = source.read(group_start, 4) != MAGIC_V1 and (header is None or header.format == 2)
    where = "" if bad_at == group_start else f" at byte {bad_at}"
    return f"{exc.reason}{where}; the commit group from byte {group_start} was never acknowledged", certain


def _bit_distance(a: bytes, b: bytes) -> int:
    return sum(bin(x ^ y).count("1") for x, y in zip(a, b, strict=True))


def _complete_despite_header(source: SegmentSource, offset: int) -> bool:
    """Whether the format-2 frame at `offset`, whose header fails its check, was complete on disk:
    its magic is within 2 bits of the real one and a payload checked by the CRC after it ends where
    the header says, at the next frame, or at the end of the segment."""
    head = source.read(offset, HEADER_SIZE)
    if len(head) < HEADER_SIZE or _bit_distance(head[:4], MAGIC) > 2:
        return False
    length = CHECKED_HEADER.unpack_from(head)[1]
    ends = {source.size}
    if length <= MAX_PAYLOAD:
        ends.add(offset + FRAME_OVERHEAD + length)
    following = find_magic(source, offset + FRAME_OVERHEAD, offset + MAX_FRAME + 1)
    if following is not None:
        ends.add(following)
    return any(
        crc_extend(RESIDUE, source.read(offset + HEADER_SIZE, end - offset - HEADER_SIZE)) == RESIDUE
        for end in sorted(ends)
        if offset + FRAME_OVERHEAD <= end <= min(source.size, offset + MAX_FRAME)
    )


def _shows_hole(source: SegmentSource, start: int, end: int) -> bool:
    """Whether a whole disk sector overlapping [start, end) reads as zeros (clipped to the end of the
    segment: at least 64 bytes of it, or, for the segment's last partial sector, at least the 4-byte
    trailer): a block of a write that never reached the disk. (A trailer of zeros cannot be the CRC
    of a damaged payload that fails it: that would be a 1 in 2**32 coincidence.)"""
    low = start // _SECTOR * _SECTOR
    high = min(-(-end // _SECTOR) * _SECTOR, source.size)
    while low < high:
        blob = source.read(low, min(high - low, WINDOW_BYTES))
        for at in range(0, len(blob), _SECTOR):
            sector = blob[at : at + _SECTOR]
            last = low + at + len(sector) == source.size
            if (len(sector) >= 64 or (last and len(sector) >= 4)) and sector == bytes(len(sector)):
                return True
        low += len(blob) or high
    return False


def audit_segment(
    name: str, source: SegmentSource, is_last: bool, report: LogReport, decoder: EventDecoder
) -> LogReport:
    """Check segment `name` like a read does, but record every problem in `report` instead of
    raising, skipping each damaged stretch to the next intact frame; a torn tail of the last segment
    goes to `report.torn_tail`. Reads a frame at a time."""
    walker = FrameWalker(source)
    seq = seq_closed = report.next_seq
    offset = closed = num_open = 0
    while True:
        exc: BadFrame | None = None
        if offset < source.size:
            try:
                frame = walker.frame(offset)
            except BadFrame as bad:
                exc = bad
        if exc is not None or (offset >= source.size and num_open):
            try:
                reason, certain = judge_tail(source, name, offset, exc, closed, walker)
            except LogCorruptError as err:
                resume = walker.next_intact(offset + 1, closing=False)
                skipped = f"{(source.size if resume is None else resume) - offset} bytes skipped"
                report.problems.append(Problem(name, offset, f"{err.reason}; {skipped}"))
                if resume is None:
                    break
                offset = resume
                continue
            report.num_records -= num_open
            seq = seq_closed
            if is_last:
                report.torn_tail = TornTail(name, closed, source.size - closed, reason, certain)
            else:
                report.problems.append(Problem(name, closed, f"{reason} (in a segment that is not the last)"))
            break
        if offset >= source.size:
            break
        if frame.seq != seq:
            kind = "gap" if frame.seq > seq else "duplicate or out of order"
            report.problems.append(
                Problem(name, offset, f"sequence {kind}: record {frame.seq}, expected {seq}")
            )
        try:
            decoder.decode(
                frame.version,
                walker.buffer[frame.payload_start - walker.start : frame.payload_end - walker.start],
            )
        except (msgspec.DecodeError, ValueError) as err:
            report.problems.append(Problem(name, offset, f"undecodable payload of record {frame.seq}: {err}"))
        except SchemaUnreadable as err:
            report.problems.append(Problem(name, offset, f"unsupported schema: {err}"))
        report.num_records += 1
        num_open += 1
        seq = max(seq, frame.seq + 1)
        offset = frame.end
        if frame.closing:
            closed, num_open, seq_closed = offset, 0, seq
    report.num_segments += 1
    report.num_bytes += source.size
    report.next_seq = seq
    return report
