"""The writer of the event log of a run, and `EventLog`, the class that opens a log to read or write.

The log is `RUN/events/00000000.log`, `00000001.log`, ...: segments of framed records
(`rewind.stores.codec`) with contiguous seqs from 0. One writer at a time (`RUN/events/LOCK`,
`rewind.stores.lock`); any number of lock-free readers, which can follow. Everything a reader does
lives in `rewind.stores.logread` (`LogReader`, which `EventLog` extends); this module holds what only
a writer does, so that the lock, the buffers and the durability rules below stay in one place.

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
When the writer seals a segment (moves on to the next) it writes the segment's index file
(`rewind.stores.logindex`), which lets readers skip segments without decoding them.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Literal

from rewind.stores import fsio, objectcommit
from rewind.stores.codec import FrameEncoder, mark_end_of_group

# Re-exported (`X as X`), so that every error of the log, the record type and the read side's public
# names can still be imported from this module, as they always could.
from rewind.stores.codec import LogCorruptError as LogCorruptError
from rewind.stores.codec import LogError as LogError
from rewind.stores.codec import LogWriteError as LogWriteError
from rewind.stores.codec import Record as Record
from rewind.stores.codec import UnsupportedSchemaError as UnsupportedSchemaError
from rewind.stores.fsio import Location
from rewind.stores.lease import ObjectLease
from rewind.stores.lock import LogLockedError as LogLockedError
from rewind.stores.lock import StaleLockBroken as StaleLockBroken
from rewind.stores.lock import WriterLock
from rewind.stores.logindex import SegmentStats, ensure_index, index_name, write_index
from rewind.stores.logread import (
    EVENTS_DIR,
    LogModeError,
    LogNotFoundError,
    LogReader,
    check_events_dir,
    segment_name,
)
from rewind.stores.logread import list_segments as list_segments
from rewind.stores.logread import verify_log as verify_log

# Small enough that decoding one segment takes a fraction of a second (~25 ms/MiB measured), since a
# reader always scans the last segment and decodes whole segments it cannot skip; large enough that a
# 1M-step run has a few dozen segments, not hundreds. Logs written with other sizes read the same.
DEFAULT_SEGMENT_BYTES = 8 << 20
LOCK_NAME = "LOCK"


class TornTailTruncated(UserWarning):
    """Opening for writing cut a torn tail (a record a crash left incomplete) off the last segment."""


class EventLog(LogReader):
    """An open event log; use `EventLog.open`. A context manager: leaving it closes the log.

    Reading (`records`, `events`, `segment_summaries`, `superseded_ranges`, `records_in_steps`,
    `follow`, `torn_tail`) is inherited from `LogReader` and works the same in both modes.
    """

    def __init__(self, run: Location, mode: Literal["r", "w"], segment_bytes: int):
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be positive, got {segment_bytes}")
        super().__init__(run)
        self.mode = mode
        self.segment_bytes = segment_bytes
        self._encoder = FrameEncoder()
        self._lock: WriterLock | None = None
        self._broken = ""  # why the writer cannot go on, after a failed rollback
        self._refuse_writes = mode != "w"  # any reason at all: then `_check_writable` says which
        # Writer state. Committed: the last segment on storage and its size; `_fd` is open on it.
        self._num_committed = 0
        self._last_index = -1
        self._last_size = 0
        self._fd: int | None = None
        # Buffered: framed records, and where in the buffer each segment's share starts.
        self._buffer = bytearray()
        self._chunks: list[tuple[int, int]] = []
        self._chunk_last_frames: list[int] = []  # where the last frame of each share but the last starts
        self._last_frame = 0  # where the frame appended last starts in the buffer
        self._next_seq = 0
        self._tail_index = -1
        self._tail_size: int | None = None  # None: the next record opens a new segment
        # Running summaries of the segments not sealed yet (the last on storage, and those holding
        # buffered records), by segment index; `_tail_stats` is the one appends go to.
        self._unsealed: dict[int, SegmentStats] = {}
        self._tail_stats: SegmentStats | None = None

    @classmethod
    def open(
        cls,
        run_url: str | os.PathLike[str],
        mode: Literal["r", "w"] = "r",
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        check: Literal["all", "tail"] = "all",
    ) -> EventLog:
        """Open the log of run directory `run_url` (a path or fsspec URL) for reading or writing.

        "w" creates the log if needed, takes the writer lock and recovers a torn tail; "r" touches
        nothing and needs no lock, but the log must exist (LogNotFoundError otherwise).
        `check` (writing only): "all" decodes and checks every record before the first append;
        "tail" trusts each sealed segment whose index file checks out and decodes only the others
        and the last, so that opening a long log costs a few small reads per segment. Damage inside
        a trusted segment is then found by the readers that read it and by `verify_log`, not here.
        """
        if mode not in ("r", "w"):
            raise ValueError(f"mode must be 'r' or 'w', got {mode!r}")
        if check not in ("all", "tail"):
            raise ValueError(f"check must be 'all' or 'tail', got {check!r}")
        log = cls(fsio.filesystem(run_url), mode, segment_bytes)
        check_events_dir(log._events_dir)
        if mode == "r":
            if not log._events_dir.exists():
                raise LogNotFoundError(f"no event log at {log.run.url} (no {EVENTS_DIR}/ directory)")
            return log
        log._events_dir.makedirs()
        log._lock = _take_lock(log._events_dir.join(LOCK_NAME))
        try:
            log._recover(check)
        except BaseException:
            log._lock.release()
            raise
        return log

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- counts ----------------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """The seq the next appended record gets (writer), or the count of complete records (reader)."""
        return self._next_seq if self.mode == "w" else super().next_seq

    @property
    def num_committed(self) -> int:
        """Records made durable so far (writer); for a reader the same as next_seq."""
        return self._num_committed if self.mode == "w" else self.next_seq

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
            if self._chunks:  # the segment before ends with the frame appended last
                self._chunk_last_frames.append(self._last_frame)
            self._chunks.append((self._tail_index, start))
            self._tail_stats = self._unsealed[self._tail_index] = SegmentStats(seq)
        elif not self._chunks:
            self._chunks.append((self._tail_index, start))
        self._tail_stats.add(seq, event, tail_size, size, self._encoder.last_crc)
        self._tail_size = tail_size + size
        self._next_seq = seq + 1
        self._last_frame = start
        return seq

    def commit(self) -> int:
        """Make every buffered record durable; returns how many were committed (0: nothing to do)."""
        self._check_writable()
        if not self._chunks:
            return 0
        num_records = self._next_seq - self._num_committed
        ends = [start for _, start in self._chunks[1:]] + [len(self._buffer)]
        # Copies of each segment's share: cheap next to a sync, and the buffer stays resizable. Each
        # ends with END_OF_GROUP (marked in the copy: a retry after a failure marks afresh): what
        # recovery takes for acknowledged, each write being synced before the next segment starts.
        pieces = [
            (index, self._buffer[start:end]) for (index, start), end in zip(self._chunks, ends, strict=True)
        ]
        for (_, piece), (_, start), last in zip(
            pieces, self._chunks, [*self._chunk_last_frames, self._last_frame], strict=True
        ):
            mark_end_of_group(piece, last - start)
        try:
            if self.run.is_local:
                self._commit_local(pieces)
            else:
                objectcommit.put_segments(self._events_dir, self._lock, pieces)
        except OSError as exc:
            outcome = self._rollback()
            raise LogWriteError(
                f"commit of records {self._num_committed}..{self._next_seq - 1} to {self._events_dir.url} "
                f"failed: {exc}; {outcome}"
            ) from exc
        self._num_committed = self._next_seq
        first_sealed, self._last_index = max(self._last_index, 0), self._tail_index
        if self.run.is_local:
            self._last_size = self._tail_size or 0
        else:
            self._tail_size = None  # objects are immutable: the next commit starts a new one
        self._buffer.clear()
        self._chunks.clear()
        self._chunk_last_frames.clear()
        # Segments this commit moved past are sealed: only now, with all their records durable, do
        # they get their index file (a failed or rolled-back commit leaves none to go stale).
        for index in range(first_sealed, self._last_index):
            write_index(self._events_dir, self._unsealed.pop(index).summary(segment_name(index)))
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

    def _recover(self, check: Literal["all", "tail"]) -> None:
        """Writer open: read the log (what `check` says must be intact), cut off a torn tail, and give
        every sealed segment its index file where it has none (or a wrong one)."""
        if check == "tail":
            summaries = [summary for summary, _ in self._summaries()]
        else:
            summaries = []
            for index, chunks in self._walk(0, None, records=False):
                stats = SegmentStats(chunks.next_seq)
                for chunk in chunks:
                    stats.add_chunk(chunk)
                    chunk = None  # let go of it before the next one decodes
                summaries.append(stats.scanned(segment_name(index), chunks.end, chunks.last_offset, chunks.last_crc))
        seq = summaries[-1].next_seq if summaries else 0
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
        for summary in summaries[:-1]:
            ensure_index(self._events_dir, summary)
        self._num_committed = self._next_seq = seq
        self._last_index = self._tail_index = len(summaries) - 1
        if summaries:
            last = summaries[-1]
            # Only a sealed segment has an index; one left next to the last would go stale on append.
            self._events_dir.join(index_name(last.segment)).remove()
            self._tail_stats = self._unsealed[self._last_index] = SegmentStats.continuing(last)
            if self.run.is_local:
                self._last_size = self._tail_size = last.num_bytes

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the lock and files. Buffered (uncommitted) records are dropped, by design."""
        if self._closed:
            return
        self._closed = self._refuse_writes = True
        self._buffer.clear()
        self._chunks.clear()
        self._chunk_last_frames.clear()
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        if self._lock is not None:
            self._lock.release()

    def _check_writable(self) -> None:
        self._check_open()
        if self.mode != "w":
            raise LogModeError(f"event log {self.run.url} is open for reading only")
        if self._broken:
            raise LogWriteError(f"event log {self.run.url}: {self._broken}")


def _take_lock(location: Location) -> WriterLock:
    """The writer's lock: the kernel's flock on a local filesystem, a lease on an object store."""
    return WriterLock.acquire(location) if location.is_local else ObjectLease.acquire(location)


def read_events(run_url: str | os.PathLike[str]) -> list[Any]:
    """Every committed event of a run, read-only (a torn tail is left alone)."""
    with EventLog.open(run_url) as log:
        return log.events()
