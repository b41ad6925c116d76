"""Segment summaries of the event log, and the index files that cache them for sealed segments.

A summary says what a segment holds without decoding it: its seq range, the range of `step` over its
records (superseded ones too), its size, and the superseded ranges its `RunResumed` records declare.
Readers use them to skip every segment a query cannot touch (`rewind log --steps A:B`), and to know
which records still count without decoding the log.

Only the last segment is ever appended to; the writer seals a segment when it moves on to the next,
and then writes `NNNNNNNN.idx` next to `NNNNNNNN.log`: the msgpack-encoded summary and a CRC32C. It is a
cache, never a source of truth: a reader uses one only if it is intact and agrees with its segment on
everything that is cheap to check (name, first seq, byte size, the first record's header, and the
last record, read whole and CRC-checked: its seq, where it ends and its CRC), and otherwise scans the
segment, as it always does the last one. Records read are still checked in full. Deleting every .idx
loses nothing but speed: the writer rewrites missing or stale ones when it opens the log, and `rewind
verify` compares each with the segment it describes.

Index files are not synced: one torn by a power cut fails its CRC and is scanned around and rewritten,
so a sync would only add two disk flushes to the commit that seals a segment.

Seeking needs no index at all (rewind.stores.logseek).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import struct
import sys
from collections.abc import Iterable

import google_crc32c
import msgspec

from rewind.states.events import RunResumed
from rewind.stores.codec import (
    HEADER_SIZE,
    HEADER_SIZE_V1,
    LENGTH_VERSION_SEQ,
    MAGIC,
    MAGIC_V1,
    MAX_FRAME,
    BadFrame,
    Record,
    UnreadableSegmentError,
    parse_frame,
)
from rewind.stores.fsio import Location
from rewind.stores.segparse import Problem, SegmentParse
from rewind.stores.segsource import SegmentSource, open_segment

INDEX_SUFFIX = ".idx"
INDEX_FORMAT = 1  # bumped when the file's layout changes; other formats are ignored, then rewritten
# An index holds a summary of a few hundred bytes (a few more per RunResumed): anything larger is not
# one, and is not read.
MAX_INDEX_BYTES = 1 << 20
_CRC = struct.Struct("<I")


class ResumeMark(msgspec.Struct, frozen=True, array_like=True):
    """A RunResumed record: its seq, and the seq range [first, last] it supersedes (empty if last < first)."""

    seq: int
    first: int
    last: int


class SegmentSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What one segment holds. An empty segment has min_step 0 and max_step -1."""

    segment: str  # "00000003.log"
    first_seq: int
    next_seq: int
    min_step: int
    max_step: int
    num_bytes: int  # of intact records (a torn tail of the last segment not included)
    resumes: tuple[ResumeMark, ...] = ()
    last_offset: int = -1  # where the last record starts, and its CRC: what a reader checks cheaply
    last_crc: int = 0

    @property
    def num_records(self) -> int:
        return self.next_seq - self.first_seq

    def may_hold_steps(self, low: float, high: float) -> bool:
        return self.num_records > 0 and self.min_step <= high and self.max_step >= low


def index_name(segment: str) -> str:
    return segment.removesuffix(".log") + INDEX_SUFFIX


def superseded_ranges(summaries: Iterable[SegmentSummary]) -> list[tuple[int, int]]:
    """The non-empty superseded ranges, in the order of the RunResumed records that declare them
    (what `rewind.states.history.superseded_ranges` finds in a full read)."""
    return [(m.first, m.last) for s in summaries for m in s.resumes if m.last >= m.first]


def summarize(name: str, first_seq: int, parsed: SegmentParse) -> SegmentSummary:
    """The summary of a segment parsed whole from its first record (`first_seq`) on."""
    stats = SegmentStats(first_seq)
    stats.add_chunk(parsed.items)
    return stats.scanned(name, parsed.end, parsed.last_offset, parsed.last_crc)


class SegmentStats:
    """The writer's running summary of a segment it has not sealed yet, updated by every append, so
    that sealing a segment needs no read-back."""

    __slots__ = (
        "first_seq",
        "last_crc",
        "last_offset",
        "max_step",
        "min_step",
        "next_seq",
        "num_bytes",
        "resumes",
    )

    def __init__(self, first_seq: int) -> None:
        self.first_seq = self.next_seq = first_seq
        self.min_step, self.max_step = sys.maxsize, -1
        self.num_bytes, self.last_offset, self.last_crc = 0, -1, 0
        self.resumes: list[ResumeMark] = []

    @classmethod
    def continuing(cls, summary: SegmentSummary) -> SegmentStats:
        """Stats that go on from a summary of the segment as it is on storage (the writer's last)."""
        stats = cls(summary.first_seq)
        if summary.num_records:
            for field in SegmentStats.__slots__:
                setattr(stats, field, getattr(summary, field))
            stats.resumes = list(summary.resumes)
        return stats

    def add(self, seq: int, event, offset: int, size: int, crc: int) -> None:
        """Record `seq` (`size` bytes at `offset`, frame CRC `crc`) was appended to the segment."""
        step = event.step
        if step < self.min_step:
            self.min_step = step
        if step > self.max_step:
            self.max_step = step
        if type(event) is RunResumed:
            self.resumes.append(ResumeMark(seq, event.superseded_first_seq, event.superseded_last_seq))
        self.next_seq, self.num_bytes, self.last_offset, self.last_crc = seq + 1, offset + size, offset, crc

    def add_chunk(self, items: list) -> None:
        """The next records (or bare events) of a segment being scanned, decoded together."""
        if not items:
            return
        events = [r.event for r in items] if type(items[0]) is Record else items
        steps = [e.step for e in events]
        self.min_step = min(self.min_step, min(steps))
        self.max_step = max(self.max_step, max(steps))
        first = self.next_seq
        self.resumes += [
            ResumeMark(first + i, e.superseded_first_seq, e.superseded_last_seq)
            for i, e in enumerate(events)
            if type(e) is RunResumed
        ]
        self.next_seq = first + len(events)

    def scanned(self, name: str, end: int, last_offset: int, last_crc: int) -> SegmentSummary:
        """The summary of segment `name` once a scan from its first record has added every chunk:
        the intact records end at `end`, the last one starts at `last_offset` and has CRC `last_crc`."""
        if self.next_seq > self.first_seq:
            self.num_bytes, self.last_offset, self.last_crc = end, last_offset, last_crc
        return self.summary(name)

    def summary(self, name: str) -> SegmentSummary:
        empty = self.next_seq == self.first_seq
        return SegmentSummary(
            segment=name,
            first_seq=self.first_seq,
            next_seq=self.next_seq,
            min_step=0 if empty else self.min_step,
            max_step=-1 if empty else self.max_step,
            num_bytes=self.num_bytes,
            resumes=tuple(self.resumes),
            last_offset=self.last_offset,
            last_crc=self.last_crc,
        )


# -- index files ---------------------------------------------------------------------------------


class _IndexFile(msgspec.Struct, frozen=True):
    format: int
    summary: SegmentSummary


class _IndexFormat(msgspec.Struct):
    format: int  # read first, so that a file of another format is named as such, not as damaged


class IndexUnusable(Exception):
    """An index file that cannot be used at all (the message says why)."""


_encode = msgspec.msgpack.Encoder().encode
_decode_format = msgspec.msgpack.Decoder(_IndexFormat).decode
_decode_file = msgspec.msgpack.Decoder(_IndexFile).decode


def encode_index(summary: SegmentSummary) -> bytes:
    body = _encode(_IndexFile(INDEX_FORMAT, summary))
    return body + _CRC.pack(google_crc32c.value(body))


def decode_index(blob: bytes) -> SegmentSummary:
    """The summary an index file holds; IndexUnusable if it is damaged or of another format."""
    body, crc = blob[: -_CRC.size], blob[-_CRC.size :]
    if len(blob) < _CRC.size or _CRC.unpack(crc)[0] != google_crc32c.value(body):
        raise IndexUnusable(f"damaged ({len(blob)} bytes, CRC mismatch)")
    try:
        found = _decode_format(body).format
        if found != INDEX_FORMAT:
            raise IndexUnusable(f"index format {found}, this code reads {INDEX_FORMAT}")
        return _decode_file(body).summary
    except msgspec.MsgspecError as exc:  # a CRC-valid file of garbage: written by something else
        raise IndexUnusable(f"undecodable: {exc}") from None


def read_index_bytes(location: Location) -> bytes:
    """The bytes of an index file; IndexUnusable if it is no regular file or too large to be one."""
    with _open_index(location) as source:
        if source.size > MAX_INDEX_BYTES:
            raise IndexUnusable(f"{source.size} bytes, more than an index file ever holds")
        return source.read(0, source.size)


def _open_index(location: Location) -> SegmentSource:
    try:
        return open_segment(location)
    except UnreadableSegmentError:
        raise IndexUnusable("not a regular file of the run") from None


def read_index(events_dir: Location, segment: str) -> SegmentSummary | None:
    """The decoded index file of `segment`, or None when there is none or it cannot be used."""
    try:
        return decode_index(read_index_bytes(events_dir.join(index_name(segment))))
    except (OSError, IndexUnusable):
        return None


def write_index(events_dir: Location, summary: SegmentSummary) -> bool:
    """Write (or replace) the index file of a sealed segment; False when that failed. A failure is
    left alone: the records are durable already, and readers scan a segment that has no index."""
    target = events_dir.join(index_name(summary.segment))
    data = encode_index(summary)
    try:
        if not target.is_local:
            target.fs.pipe_file(target.path, data)
            return True
        # Renamed into place, so that no reader sees half a file; not synced (see the module doc).
        tmp = events_dir.join(f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}").path
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, target.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    except OSError:
        return False
    return True


def ensure_index(events_dir: Location, summary: SegmentSummary) -> None:
    """Writer open: give a sealed segment the index it should have, unless it has it already."""
    if read_index(events_dir, summary.segment) != summary:
        write_index(events_dir, summary)


def load_index(events_dir: Location, segment: str, first_seq: int) -> SegmentSummary | None:
    """The summary of sealed `segment` (expected to start at record `first_seq`) from its index file,
    if the file is intact and agrees with the segment; None otherwise (the caller scans it). Raises
    UnreadableSegmentError where the segment is no regular file."""
    summary = read_index(events_dir, segment)
    if summary is None or summary.segment != segment or summary.first_seq != first_seq:
        return None
    try:
        with open_segment(events_dir.join(segment)) as source:
            return _agrees(summary, source, first_seq)
    except OSError:
        return None


def _agrees(summary: SegmentSummary, source: SegmentSource, first_seq: int) -> SegmentSummary | None:
    if source.size != summary.num_bytes:
        return None
    if not summary.num_records:
        return summary if summary.num_bytes == 0 else None
    if (
        not 0 <= summary.last_offset < summary.num_bytes
        or summary.num_bytes - summary.last_offset > MAX_FRAME
    ):
        return None
    if summary.num_records > 1 and first_record_seq(source) != first_seq:
        return None
    last = source.read(summary.last_offset, summary.num_bytes - summary.last_offset)
    try:
        seq, _, _, _, end, closing = parse_frame(last, 0)
    except BadFrame:
        return None
    # A sealed segment ends with the frame that closes its last commit group.
    crc = int.from_bytes(last[end - 4 : end], "little")
    if (seq, end, crc, closing) != (summary.next_seq - 1, len(last), summary.last_crc, True):
        return None
    return summary


def first_record_seq(source: SegmentSource) -> int | None:
    """The seq in the header of a segment's first record, or None when it holds no readable header."""
    head = source.read(0, HEADER_SIZE)
    if len(head) < HEADER_SIZE_V1 or head[:4] not in (MAGIC, MAGIC_V1):
        return None
    return LENGTH_VERSION_SEQ.unpack_from(head)[2]


# -- verification --------------------------------------------------------------------------------


def check_indexes(events_dir: Location, summaries: dict[str, SegmentSummary]) -> list[Problem]:
    """Every index file against the summary computed from its segment's bytes (`summaries`, of the
    intact segments), plus index files whose segment does not exist. A missing index is fine."""
    problems = []
    names = set(events_dir.list_names())
    for name in sorted(n for n in names if n.endswith(INDEX_SUFFIX) and not n.startswith(".")):
        segment = name.removesuffix(INDEX_SUFFIX) + ".log"
        if segment not in names:
            problems.append(Problem(name, 0, f"index file of a segment that does not exist ({segment})"))
            continue
        expected = summaries.get(segment)
        if expected is None:
            continue  # the segment is damaged: that is the problem reported
        try:
            found = decode_index(read_index_bytes(events_dir.join(name)))
        except (OSError, IndexUnusable) as exc:
            problems.append(Problem(name, 0, f"damaged index file ({exc}); readers scan {segment} instead"))
            continue
        if found == expected:
            continue
        fields = [f for f in expected.__struct_fields__ if getattr(found, f) != getattr(expected, f)]
        diff = ", ".join(f"{f} {getattr(found, f)!r} (segment: {getattr(expected, f)!r})" for f in fields)
        if load_index(events_dir, segment, expected.first_seq) is None:
            verdict = "readers see that and scan the segment instead"
        else:  # it passes the checks a reader can afford: only a writer bug or tampering does that
            verdict = "yet it passes the checks readers make, so they trust it and may skip records"
        problems.append(Problem(name, 0, f"stale index file, disagrees with {segment} on {diff}: {verdict}"))
    return problems
