"""A commit of the event log on an object store: new segment objects, each created exclusively.

`EventLog.commit` hands its pieces (segment index, framed records) here when the run is not on a
local filesystem. Every piece becomes a new object that must not exist yet, and nothing that exists
is ever overwritten: that is what fences a writer that lost its lease (`rewind.stores.lease`) -- a
successor has claimed the next segment name, so the old writer's next object finds it taken.

Every failure leaves as `LogWriteError`, never as an OSError: the event log's generic rollback
removes the segment names a commit was going to use, and on an object store some of those may be a
successor's. Here only objects this commit created are removed, and only while the lease is still
ours; once it is lost nothing is removed (the successor may have read them already).
"""

from __future__ import annotations

from rewind.stores.codec import LogWriteError
from rewind.stores.fsio import Location
from rewind.stores.lease import ObjectLease
from rewind.stores.logread import segment_name


def put_segments(events_dir: Location, lease: ObjectLease, pieces: list[tuple[int, bytearray]]) -> None:
    """Create the segment object of each piece, in order; LogWriteError if any cannot be made.

    Checks (and renews) the lease first. A name already taken by other bytes means a successor
    claimed it: the lease is lost, for this commit and every later one. The same bytes there mean an
    earlier attempt of this very commit got through after all (a put that timed out, then retried)."""
    lease.check_before_commit()
    created: list[Location] = []
    try:
        for index, data in pieces:
            segment = events_dir.join(segment_name(index))
            try:
                segment.create_exclusive(data)
            except FileExistsError:
                if segment.size() != len(data) or segment.read_bytes() != data:  # size first: bounded
                    lease.lose(f"lost the lease to {lease.successor()}: {segment.url} was created by it")
            created.append(segment)
    except OSError as exc:
        raise LogWriteError(f"commit to {events_dir.url} failed: {exc}; {_undo(lease, created)}") from exc


def _undo(lease: ObjectLease, created: list[Location]) -> str:
    """Remove what a failed commit created; says what the caller can do now."""
    try:
        for segment in reversed(created):
            segment.remove()
    except OSError as exc:
        lease.lost = (
            f"event log {segment.parent.url}: removing the objects of a failed commit failed too ({exc}); "
            "close and reopen the log"
        )
        return lease.lost
    return "nothing was committed; the records stay buffered and commit() can be retried"
