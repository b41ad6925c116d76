"""The read side of the event log: everything a lock-free reader does, and `verify_log`.

A run's log is `RUN/events/00000000.log`, `00000001.log`, ...: segments of framed records
(`rewind.stores.codec`) with contiguous seqs from 0. `LogReader` reads it while a writer may be
appending, with no lock and without modifying anything. That is safe because the writer only ever
appends to the last segment and syncs each segment before it creates the next: damage at the end of
the last segment is a torn tail (a record being written, or one a crash cut short), reported in
`torn_tail`; damage anywhere else is corruption and raises `LogCorruptError` (segment, byte offset).

Reading seeks: `records(start_seq)` reads only the segments from the one holding `start_seq` on,
`records_in_steps(low, high)` only those whose step range meets [low, high], and
`superseded_ranges()` decodes nothing but the last segment. They find their way with the segment
summaries of `rewind.stores.logindex`, which the writer caches in an index file per sealed segment.

`rewind.stores.eventlog.EventLog` is the class to use: a `LogReader` that can also be opened for
writing, and whose recovery on open reuses these reads. They live apart from the writer because
none of them depends on its lock or buffers, so they can be read (and changed) on their own.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from rewind.stores import fsio
from rewind.stores.codec import (
    EventDecoder,
    LogCorruptError,
    LogError,
    Record,
    UnreadableSegmentError,
)
from rewind.stores.fsio import Location
from rewind.stores.logindex import (
    SegmentStats,
    SegmentSummary,
    check_indexes,
    load_index,
    superseded_ranges,
)
from rewind.stores.logseek import locate, part_chunks
from rewind.stores.segparse import (
    LogReport,
    Problem,
    SegmentChunks,
    TornTail,
    audit_segment,
)
from rewind.stores.segsource import open_segment
from rewind.stores.trust import RecordChecker, check_carriers

EVENTS_DIR = "events"
_SEGMENT_SUFFIX = ".log"


class LogNotFoundError(LogError):
    """There is no event log at the given run directory."""


class LogModeError(LogError):
    """Writing to a log opened for reading, or using a closed log."""


def segment_name(index: int) -> str:
    return f"{index:08d}{_SEGMENT_SUFFIX}"


def check_events_dir(events: Location) -> None:
    """UnreadableSegmentError where `events` exists but is no directory (a regular file: listing it
    would find an empty log), or, locally, is a symlink: segments are confined to `events/`, so a link
    there would lead every reader, the lock and the writer's truncation of a torn tail out of the run."""
    if events.is_local and os.path.islink(events.path):
        raise UnreadableSegmentError(
            f"{events.url}: a symlink ({os.readlink(events.path)}); the event log must be a directory of the run"
        )
    if events.exists() and not (
        os.path.isdir(events.path) if events.is_local else events.fs.isdir(events.path)
    ):
        raise UnreadableSegmentError(f"{events.url}: not a directory; no event log can be read there")


def _segment_indices(events: Location) -> list[int]:
    stems = (name[: -len(_SEGMENT_SUFFIX)] for name in events.list_names() if name.endswith(_SEGMENT_SUFFIX))
    return sorted(int(stem) for stem in stems if stem.isdigit())


def list_segments(events: Location) -> list[int]:
    """Segment indices in order; a hole in the numbering is corruption (a lost segment)."""
    indices = _segment_indices(events)
    for position, index in enumerate(indices):
        if index != position:
            raise LogCorruptError(segment_name(position), 0, "segment file is missing")
    return indices


class LogReader:
    """Lock-free reads of the log of run directory `run`, each from storage as it is now.

    The read side of `rewind.stores.eventlog.EventLog`, which owns the lifecycle (opening, closing);
    every read raises LogModeError once the log is closed.
    """

    def __init__(self, run: Location):
        self.run = run
        self.torn_tail: TornTail | None = None
        self._events_dir = run.join(EVENTS_DIR)
        self._decoder = EventDecoder()
        self._closed = False
        # Next seq as of the last full read; a writer keeps its own count and never looks at this.
        self._scanned_seq: int | None = None

    @property
    def next_seq(self) -> int:
        """The count of complete records, as of the last full read (one is made if there was none)."""
        if self._scanned_seq is None:
            self._summaries()
        return self._scanned_seq  # type: ignore[return-value]

    def records(
        self, start_seq: int = 0, stop_seq: int | None = None, *, check: bool = True
    ) -> Iterator[Record]:
        """The committed records with start_seq <= seq < stop_seq (to the end by default) in seq
        order, read from storage now. Reads only the segments that can hold them and decodes from the
        first one wanted. Raises LogCorruptError on damage in what it reads; a torn tail ends the
        iteration and is reported in `torn_tail` (when the iteration reaches it).

        Streams: each segment decodes a chunk at a time (`rewind.stores.segparse.SegmentChunks`), every
        record checked before it is handed on, so a consumer that does not keep the records holds
        about one chunk of them (and the bytes of the segment being read), not a whole segment.
        Records of a segment come before damage found later in it is raised.

        A record that carries what no rewind run writes (a config rewind refuses, a checkpoint name
        that is not one, an absurd fork seed: rewind.stores.trust) raises UntrustedRecord, unless
        `check` is off (`rewind verify`, which reports it among the other problems)."""
        checker = RecordChecker()
        for chunk in self._read_chunks(start_seq, stop_seq, records=True):
            if check:
                check_carriers(checker, chunk)
            yield from chunk
            chunk = None  # let go of it before the next one decodes

    def events(self) -> list[Any]:
        """Every committed event, in order (the fast path: no Record wrappers), checked as `records`."""
        found: list[Any] = []
        checker = RecordChecker()
        for chunk in self._read_chunks(records=False):
            check_carriers(checker, chunk, first_seq=len(found))
            found += chunk
        return found

    def segment_summaries(self) -> list[SegmentSummary]:
        """What each segment holds (seqs, steps, bytes, resumes): from the index file of a sealed
        segment where it is intact and matches, else by scanning the segment; the last is scanned."""
        return [summary for summary, _ in self._summaries()]

    def superseded_ranges(self) -> list[tuple[int, int]]:
        """The non-empty seq ranges [first, last] that resumes superseded, without decoding the log."""
        return superseded_ranges(self.segment_summaries())

    def records_in_steps(self, low: float, high: float, *, effective: bool = False) -> Iterator[Record]:
        """The records with low <= step <= high in seq order (only those that still count after
        resumes, with `effective`), reading only the segments whose step range meets [low, high]."""
        wanted = functools.partial(SegmentSummary.may_hold_steps, low=low, high=high)
        summaries = self._summaries(keep=lambda record: low <= record.event.step <= high)
        ranges = superseded_ranges(s for s, _ in summaries) if effective else []
        checker = RecordChecker()
        for position, (summary, kept) in enumerate(summaries):
            if not wanted(summary):
                continue
            summaries[position] = (summary, None)  # what was kept goes once it has been handed on
            chunks = iter([kept]) if kept is not None else self._segment_chunks(summary)
            kept = None  # the iterator holds it until it is handed on
            here = [(a, b) for a, b in ranges if a < summary.next_seq and b >= summary.first_seq]
            for chunk in chunks:
                check_carriers(checker, chunk)
                for record in chunk:
                    if low <= record.event.step <= high and not any(a <= record.seq <= b for a, b in here):
                        yield record
                chunk = None  # let go of it before the next one decodes

    def follow(
        self, poll_s: float = 0.2, stop: Callable[[], bool] | None = None, *, start_seq: int = 0
    ) -> Iterator[Record]:
        """Every record from `start_seq` on, then each new one as a writer commits it; no lock needed.

        Polls every `poll_s` seconds once caught up. `stop()` is asked before each pass over the log;
        after it returns True, the pass still runs (so nothing committed before is missed) and the
        generator ends once caught up. Without `stop` it runs until the consumer stops iterating.
        An incomplete record at the end is waited for; damage followed by more data raises.
        """
        self._check_open()
        names = [segment_name(i) for i in list_segments(self._events_dir)]
        index, seq = locate(self._events_dir, names, start_seq) if start_seq > 0 else (0, 0)
        offset = 0
        checker = RecordChecker()
        while True:
            stopping = stop is not None and stop()
            num_before = seq
            indices = list_segments(self._events_dir)
            while index < len(indices):
                has_next = index + 1 < len(indices)  # listed before reading: if so, this one is final
                name = segment_name(index)
                with open_segment(self._events_dir.join(name)) as source:
                    chunks = SegmentChunks(name, source, seq=seq, decoder=self._decoder, begin=offset)
                    for chunk in chunks:
                        check_carriers(checker, chunk)
                        yield from (record for record in chunk if record.seq >= start_seq)
                        chunk = None  # let go of it before the next one decodes
                seq, offset, bad = chunks.next_seq, chunks.end, chunks.bad
                chunks = None
                if bad is not None and has_next:
                    raise LogCorruptError(name, offset, f"{bad[1]} (in a segment that is not the last)")
                if bad is not None or not has_next:
                    break
                index, offset = index + 1, 0
            if seq == num_before:
                if stopping:
                    return
                time.sleep(poll_s)

    def _summaries(self, keep: Callable[[Record], bool] | None = None) -> list:
        """(summary, kept) of every segment. `kept`, only with `keep` and only for a segment that had
        to be scanned: its records that `keep` accepts, decoded by the scan, as long as what is kept
        over all segments is no more than the largest chunk decoded held (else it could take a
        segment's memory, or the log's: the caller reads the segment again); otherwise None.
        Sets `torn_tail`."""
        self._check_open()
        indices = list_segments(self._events_dir)
        found: list[tuple[SegmentSummary, list[Record] | None]] = []
        seq, torn = 0, None
        num_kept = most = 0  # records kept over all segments; the most records a chunk held
        for index in indices:
            name = segment_name(index)
            summary = None if index == indices[-1] else load_index(self._events_dir, name, seq)
            kept: list[Record] | None = None
            if summary is None:
                with open_segment(self._events_dir.join(name)) as source:
                    chunks = SegmentChunks(
                        name, source, seq=seq, decoder=self._decoder, records=keep is not None
                    )
                    stats = SegmentStats(seq)
                    kept = [] if keep is not None else None
                    for chunk in chunks:
                        stats.add_chunk(chunk)
                        if kept is not None:
                            most = max(most, len(chunk))
                            kept += filter(keep, chunk)
                            if num_kept + len(kept) > most:
                                kept = None  # more than a chunk's worth: read again when wanted
                        chunk = None  # let go of it before the next one decodes
                num_kept += len(kept) if kept is not None else 0
                torn = self._check_tail(index, indices, source.size, chunks.bad)
                summary = stats.scanned(name, chunks.end, chunks.last_offset, chunks.last_crc)
                chunks = None
            found.append((summary, kept))
            seq = summary.next_seq
        self.torn_tail = torn
        self._scanned_seq = seq
        return found

    def _read_chunks(
        self, start_seq: int = 0, stop_seq: int | None = None, *, records: bool
    ) -> Iterator[list]:
        """The records in [start_seq, stop_seq) (Records, or bare events), a chunk at a time, from
        the segment that holds `start_seq` on. Sets `torn_tail` once it reaches the end."""
        for _, chunks in self._walk(start_seq, stop_seq, records=records):
            for chunk in chunks:
                yield chunk
                chunk = None  # let go of it before the next one decodes

    def _walk(
        self, start_seq: int, stop_seq: int | None, *, records: bool
    ) -> Iterator[tuple[int, SegmentChunks]]:
        """(index, chunks) of each segment from the one that holds `start_seq` on; the caller
        decodes each segment's chunks before asking for the next. The one walk of the reading paths:
        which segments, from where, and what the end of the last one means (`torn_tail`, set once
        the walk reaches it). A segment is open (a window of it in memory) while its chunks decode."""
        self._check_open()
        indices = list_segments(self._events_dir)
        names = [segment_name(index) for index in indices]
        position, seq = locate(self._events_dir, names, start_seq) if start_seq > 0 else (0, 0)
        torn = None
        for index in indices[position:]:
            if stop_seq is not None and seq >= stop_seq:  # an empty range
                return
            with open_segment(self._events_dir.join(names[index])) as source:
                chunks = part_chunks(
                    names[index],
                    source,
                    first_seq=seq,
                    start_seq=start_seq,
                    stop_seq=stop_seq,
                    decoder=self._decoder,
                    records=records,
                )
                yield index, chunks
            seq, bad = chunks.next_seq, chunks.bad
            chunks = None
            if stop_seq is not None and seq >= stop_seq:  # done before the end: nothing to say about it
                return
            torn = self._check_tail(index, indices, source.size, bad)
        if start_seq == 0:  # only a read from the start knows where the log ends (and how it is torn)
            self.torn_tail = torn
            self._scanned_seq = seq

    def _segment_chunks(self, summary: SegmentSummary) -> Iterator[list[Record]]:
        """The records of a segment `summary` describes (its intact records: up to `num_bytes`), a
        chunk at a time; damage there is corruption."""
        with open_segment(self._events_dir.join(summary.segment)) as source:
            chunks = SegmentChunks(
                summary.segment, source, seq=summary.first_seq, decoder=self._decoder, stop=summary.num_bytes
            )
            for chunk in chunks:
                yield chunk
                chunk = None  # let go of it before the next one decodes
        if chunks.bad is not None:
            offset, reason, _ = chunks.bad
            raise LogCorruptError(summary.segment, offset, f"{reason} (in a segment that is not the last)")

    @staticmethod
    def _check_tail(
        index: int, indices: list[int], size: int, bad: tuple[int, str, bool] | None
    ) -> TornTail | None:
        """An unacknowledged end (`bad`) of the last segment (`size` bytes) is a torn tail; of any
        other segment, corruption (the writer syncs a segment whole before it starts the next)."""
        if bad is None:
            return None
        offset, reason, certain = bad
        name = segment_name(index)
        if index != indices[-1]:
            raise LogCorruptError(name, offset, f"{reason} (in a segment that is not the last)")
        return TornTail(name, offset, size - offset, reason, certain)

    def _check_open(self) -> None:
        if self._closed:
            raise LogModeError(f"event log {self.run.url} is closed")


def verify_log(run_url: str | os.PathLike[str]) -> LogReport:
    """Check framing, CRCs, commit groups, sequence contiguity and decodability of every record,
    reporting every problem (segment, offset) instead of stopping at the first, and every index file
    against its segment (`index_problems`). A torn tail (a commit that never returned, as a crash
    leaves) is `torn_tail`, not a problem. Read-only; every read bounded. Raises LogError only where
    no log can be read at all (no events directory, or it is no directory)."""
    events_dir = fsio.filesystem(run_url).join(EVENTS_DIR)
    if not events_dir.exists():
        raise LogNotFoundError(f"no event log at {run_url} (no {EVENTS_DIR}/ directory)")
    check_events_dir(events_dir)
    indices = _segment_indices(events_dir)
    present = set(indices)
    missing = [i for i in range(indices[-1] if indices else 0) if i not in present]
    report = LogReport(problems=[Problem(segment_name(i), 0, "segment file is missing") for i in missing])
    decoder = EventDecoder()
    summaries: dict[str, SegmentSummary] = {}
    for index in indices:
        name = segment_name(index)
        try:
            source = open_segment(events_dir.join(name))
        except (UnreadableSegmentError, OSError) as exc:
            report.problems.append(Problem(name, 0, str(exc)))
            continue
        with source:
            first = report.next_seq
            # The fast path proves an intact segment a chunk at a time, keeping only the summary;
            # only a damaged segment (or a torn tail) needs the audit.
            chunks = SegmentChunks(name, source, seq=first, decoder=decoder, records=False)
            stats = SegmentStats(first)
            try:
                for chunk in chunks:
                    stats.add_chunk(chunk)
                    chunk = None  # let go of it before the next one decodes
                intact = chunks.bad is None
            except LogError:
                intact = False
            if not intact:
                audit_segment(name, source, index == indices[-1], report, decoder)
            else:
                report.num_segments += 1
                report.num_records += chunks.next_seq - first
                report.num_bytes += source.size
                report.next_seq = chunks.next_seq
                summaries[name] = stats.scanned(name, chunks.end, chunks.last_offset, chunks.last_crc)
        chunks = None  # before the next segment is read
    report.index_problems = check_indexes(events_dir, summaries)
    return report
