"""The append-only event log of a run: `RUN/events/00000000.log`, `00000001.log`, ...

Segments hold framed records (`rewind.stores.codec`) with contiguous seqs from 0. One writer at a
time (`RUN/events/LOCK`, `rewind.stores.lock`); any number of lock-free readers, which can follow.

Writing: `append(event)` buffers and returns the record's seq; `commit()` makes every buffered record
durable at once (group commit: the engine commits at step boundaries). Locally a commit appends to
the open segment and fdatasyncs; a new segment is created (and the directory fsynced) when the size
limit would be passed, only after the previous one is synced, so only the last segment can end torn.
On object stores (any non-local fsspec filesystem) each commit puts new, never-modified objects.
A commit that raises `LogWriteError` (full disk, I/O error) is rolled back: the committed seq does
not move, the segment is cut back, and the records stay buffered for a retry; if the rollback fails
too, the writer refuses further use (reopen). After a crash, a commit that raised may or may not be
in the log: only a returned commit is a promise. `close()` drops what was never committed.

Opening for writing cuts a torn tail -- damage at the very end of the last segment with no intact
record after it, as a crash mid-write leaves -- with one `TornTailTruncated` warning: the only case
in which bytes are dropped. Damage anywhere else raises `LogCorruptError` (segment, byte offset) and
nothing is rewritten. Opening for reading modifies nothing; a torn tail shows in `torn_tail`.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

from rewind.stores import fsio
from rewind.stores.codec import (
    EventDecoder,
    FrameEncoder,
    LogCorruptError,
    LogError,
    LogReport,
    Problem,
    Record,
    TornTail,
    audit_segments,
    parse_segment,
)

# Re-exported (`X as X`), so that every error of the log can be imported from this module.
from rewind.stores.codec import UnsupportedSchemaError as UnsupportedSchemaError
from rewind.stores.fsio import Location
from rewind.stores.lock import LogLockedError as LogLockedError
from rewind.stores.lock import StaleLockBroken as StaleLockBroken
from rewind.stores.lock import WriterLock

DEFAULT_SEGMENT_BYTES = 64 << 20
EVENTS_DIR = "events"
LOCK_NAME = "LOCK"
_SEGMENT_SUFFIX = ".log"


class LogNotFoundError(LogError):
    """There is no event log at the given run directory."""


class LogWriteError(LogError):
    """A commit could not be made durable (full disk, I/O error), or the writer is unusable."""


class LogModeError(LogError):
    """Writing to a log opened for reading, or using a closed log."""


class TornTailTruncated(UserWarning):
    """Opening for writing cut a torn tail (a record a crash left incomplete) off the last segment."""


def segment_name(index: int) -> str:
    return f"{index:08d}{_SEGMENT_SUFFIX}"


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


class EventLog:
    """An open event log; use `EventLog.open`. A context manager: leaving it closes the log."""

    def __init__(self, run: Location, mode: Literal["r", "w"], segment_bytes: int):
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
        self.run = run
        self.mode = mode
        self.segment_bytes = segment_bytes
        self.torn_tail: TornTail | None = None
        self._events_dir = run.join(EVENTS_DIR)
        self._decoder = EventDecoder()
        self._encoder = FrameEncoder()
        self._lock: WriterLock | None = None
        self._closed = False
        self._broken = ""  # why the writer cannot go on, after a failed rollback
        self._refuse_writes = mode != "w"  # any reason at all: then `_check_writable` says which
        self._scanned_seq: int | None = None  # reader: next seq as of the last full read
        # Writer state. Committed: the last segment on storage and its size; `_fd` is open on it.
        self._num_committed = 0
        self._last_index = -1
        self._last_size = 0
        self._fd: int | None = None
        # Buffered: framed records, and where in the buffer each segment's share starts.
        self._buffer = bytearray()
        self._chunks: list[tuple[int, int]] = []
        self._next_seq = 0
        self._tail_index = -1
        self._tail_size: int | None = None  # None: the next record opens a new segment

    @classmethod
    def open(
        cls,
        run_url: str | os.PathLike[str],
        mode: Literal["r", "w"] = "r",
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
    ) -> EventLog:
        """Open the log of run directory `run_url` (a path or fsspec URL) for reading or writing.

        "w" creates the log if needed, takes the writer lock and recovers a torn tail; "r" touches
        nothing and needs no lock, but the log must exist (LogNotFoundError otherwise).
        """
        if mode not in ("r", "w"):
            raise ValueError(f"mode must be 'r' or 'w', got {mode!r}")
        log = cls(fsio.filesystem(run_url), mode, segment_bytes)
        if mode == "r":
            if not log._events_dir.exists():
                raise LogNotFoundError(f"no event log at {log.run.url} (no {EVENTS_DIR}/ directory)")
            return log
        log._events_dir.makedirs()
        log._lock = WriterLock.acquire(log._events_dir.join(LOCK_NAME))
        try:
            log._recover()
        except BaseException:
            log._lock.release()
            raise
        return log

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- reading ---------------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """The seq the next appended record gets (writer), or the count of complete records (reader)."""
        if self.mode == "w":
            return self._next_seq
        if self._scanned_seq is None:
            self._scan(records=False)
        return self._scanned_seq  # type: ignore[return-value]

    @property
    def num_committed(self) -> int:
        """Records made durable so far (writer); for a reader the same as next_seq."""
        return self._num_committed if self.mode == "w" else self.next_seq

    def records(self) -> Iterator[Record]:
        """Every committed record in seq order, read from storage now. Raises LogCorruptError on
        damage; a torn tail ends the iteration and is reported in `torn_tail`."""
        for items in self._iter_segments(records=True):
            yield from items

    def events(self) -> list[Any]:
        """Every committed event, in order (the fast path: no Record wrappers)."""
        return self._scan(records=False)

    def _scan(self, *, records: bool) -> list:
        return [item for items in self._iter_segments(records=records) for item in items]

    def _iter_segments(self, *, records: bool) -> Iterator[list]:
        self._check_open()
        indices = list_segments(self._events_dir)
        seq = 0
        torn = None
        for index in indices:
            name = segment_name(index)
            data = self._events_dir.join(name).read_bytes()
            parsed = parse_segment(name, data, seq=seq, decoder=self._decoder, records=records)
            seq = parsed.next_seq
            if parsed.bad is not None:
                offset, reason = parsed.bad
                if index != indices[-1]:
                    raise LogCorruptError(name, offset, f"{reason} (in a segment that is not the last)")
                torn = TornTail(name, offset, len(data) - offset, reason)
            yield parsed.items
        self.torn_tail = torn
        if self.mode == "r":
            self._scanned_seq = seq

    def follow(self, poll_s: float = 0.2, stop: Callable[[], bool] | None = None) -> Iterator[Record]:
        """Every record from seq 0 on, then each new one as a writer commits it; no lock needed.

        Polls every `poll_s` seconds once caught up. `stop()` is asked before each pass over the log;
        after it returns True, the pass still runs (so nothing committed before is missed) and the
        generator ends once caught up. Without `stop` it runs until the consumer stops iterating.
        An incomplete record at the end is waited for; damage followed by more data raises.
        """
        self._check_open()
        index, offset, seq = 0, 0, 0
        while True:
            stopping = stop is not None and stop()
            num_before = seq
            indices = list_segments(self._events_dir)
            while index < len(indices):
                has_next = index + 1 < len(indices)  # listed before reading: if so, this one is final
                name = segment_name(index)
                data = self._events_dir.join(name).read_bytes(offset)
                parsed = parse_segment(name, data, seq=seq, decoder=self._decoder, base=offset)
                yield from parsed.items
                seq, offset = parsed.next_seq, offset + parsed.end
                if parsed.bad is not None and has_next:
                    raise LogCorruptError(
                        name, offset, f"{parsed.bad[1]} (in a segment that is not the last)"
                    )
                if parsed.bad is not None or not has_next:
                    break
                index, offset = index + 1, 0
            if seq == num_before:
                if stopping:
                    return
                time.sleep(poll_s)

    # -- writing ---------------------------------------------------------------------------------

    def append(self, event: Any) -> int:
        """Buffer `event` as the next record; returns its seq. Not durable until `commit()`."""
        if self._refuse_writes:
            self._check_writable()
        seq = self._next_seq
        start = len(self._buffer)
        size = self._encoder.append(self._buffer, seq, event)
        tail_size = self._tail_size
        if tail_size is None or (tail_size and tail_size + size > self.segment_bytes):
            self._tail_index += 1
            tail_size = 0
            self._chunks.append((self._tail_index, start))
        elif not self._chunks:
            self._chunks.append((self._tail_index, start))
        self._tail_size = tail_size + size
        self._next_seq = seq + 1
        return seq

    def commit(self) -> int:
        """Make every buffered record durable; returns how many were committed (0: nothing to do)."""
        self._check_writable()
        if not self._chunks:
            return 0
        num_records = self._next_seq - self._num_committed
        ends = [start for _, start in self._chunks[1:]] + [len(self._buffer)]
        # Copies of each segment's share: cheap next to a sync, and the buffer stays resizable.
        pieces = [
            (index, self._buffer[start:end]) for (index, start), end in zip(self._chunks, ends, strict=True)
        ]
        try:
            if self.run.is_local:
                self._commit_local(pieces)
            else:
                for index, data in pieces:
                    self._events_dir.join(segment_name(index)).write_atomic(data)
        except OSError as exc:
            outcome = self._rollback()
            raise LogWriteError(
                f"commit of records {self._num_committed}..{self._next_seq - 1} to {self._events_dir.url} "
                f"failed: {exc}; {outcome}"
            ) from exc
        self._num_committed = self._next_seq
        self._last_index = self._tail_index
        if self.run.is_local:
            self._last_size = self._tail_size or 0
        else:
            self._tail_size = None  # objects are immutable: the next commit starts a new one
        self._buffer.clear()
        self._chunks.clear()
        return num_records

    def _commit_local(self, pieces: list[tuple[int, bytearray]]) -> None:
        """Append each piece to its segment and sync it before the next segment is created, so
        that only the last segment can ever be torn."""
        opened: list[int] = []  # fds opened by this commit; the last one stays open on success
        fd, fd_index = self._fd, self._last_index
        try:
            for index, data in pieces:
                if fd is None or index != fd_index:
                    segment = self._events_dir.join(segment_name(index))
                    fd, fd_index = segment.open_append(create=index != self._last_index), index
                    opened.append(fd)
                fsio.write_all(fd, data)
                fsio.sync_fd(fd)
        except BaseException:
            for opened_fd in opened:
                os.close(opened_fd)
            raise
        if opened:
            for done_fd in [self._fd, *opened[:-1]]:
                if done_fd is not None:
                    os.close(done_fd)
            self._fd = opened[-1]

    def _rollback(self) -> str:
        """Undo a failed commit's partial writes; returns what the caller can do now."""
        try:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)  # after a failed write or sync the fd's error state is unreliable: reopen
            for index in range(self._last_index + 1, self._tail_index + 1):
                self._events_dir.join(segment_name(index)).remove()
            if self.run.is_local and self._last_index >= 0:
                self._events_dir.join(segment_name(self._last_index)).truncate(self._last_size)
        except OSError as exc:
            self._broken = f"rolling back a failed commit failed too ({exc}); close and reopen the log"
            self._refuse_writes = True
            return self._broken
        return "nothing was committed; the records stay buffered and commit() can be retried"

    def _recover(self) -> None:
        """Writer open: read the whole log (it must be intact) and cut off a torn tail."""
        seq = 0
        indices = list_segments(self._events_dir)
        for items in self._iter_segments(records=False):
            seq += len(items)
        torn = self.torn_tail
        if torn is not None:
            segment = self._events_dir.join(torn.segment)
            segment.truncate(torn.offset)  # an object store gets the intact prefix put back whole
            warnings.warn(
                f"{segment.url}: cut a torn tail of {torn.num_bytes} bytes at offset {torn.offset} "
                f"({torn.reason}); the log now ends at record {seq - 1}",
                TornTailTruncated,
                stacklevel=3,
            )
        self._num_committed = self._next_seq = seq
        self._last_index = self._tail_index = indices[-1] if indices else -1
        if self.run.is_local and indices:
            self._last_size = self._events_dir.join(segment_name(self._last_index)).size()
            self._tail_size = self._last_size

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the lock and files. Buffered (uncommitted) records are dropped, by design."""
        if self._closed:
            return
        self._closed = self._refuse_writes = True
        self._buffer.clear()
        self._chunks.clear()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        if self._lock is not None:
            self._lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise LogModeError(f"event log {self.run.url} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self.mode != "w":
            raise LogModeError(f"event log {self.run.url} is open for reading only")
        if self._broken:
            raise LogWriteError(f"event log {self.run.url}: {self._broken}")


def read_events(run_url: str | os.PathLike[str]) -> list[Any]:
    """Every committed event of a run, read-only (a torn tail is left alone)."""
    with EventLog.open(run_url) as log:
        return log.events()


def verify_log(run_url: str | os.PathLike[str]) -> LogReport:
    """Check framing, CRCs, sequence contiguity and decodability of every record, reporting every
    problem (segment, offset) instead of stopping at the first. Read-only."""
    events_dir = fsio.filesystem(run_url).join(EVENTS_DIR)
    if not events_dir.exists():
        raise LogNotFoundError(f"no event log at {run_url} (no {EVENTS_DIR}/ directory)")
    indices = _segment_indices(events_dir)
    present = set(indices)
    missing = [i for i in range(indices[-1] if indices else 0) if i not in present]
    report = LogReport(problems=[Problem(segment_name(i), 0, "segment file is missing") for i in missing])
    segments = (
        (segment_name(i), events_dir.join(segment_name(i)).read_bytes(), i == indices[-1]) for i in indices
    )
    return audit_segments(segments, report)
