"""The writer's lease on an object store, and the writer epochs that fence a writer that lost it.

Object stores have no flock and cannot tell whether a process on another host is alive, so there the
lock file (`RUN/events/LOCK`) holds a `Lease`: the holder (as `LockInfo`), its `epoch` and the time
it `expires_at`. The protocol:

- Taking the lease. No lock file: created exclusively. A lease whose `expires_at` has passed (by the
  taker's clock), or one held by a dead process on this host: taken over with a `StaleLockBroken`
  warning. A live lease refuses with `LogLockedError`, naming the holder and the expiry. A lock file
  of rewind 0.2 (no expiry) is only broken when its holder is certainly dead on this host, as 0.2 did.
- Epochs. Each holder has an epoch, one more than the last: taking epoch e means exclusively
  creating the object `events/EPOCH-<e>` (holding the new lease) before writing the lock file, so two
  writers starting at once cannot both get it: the second finds the epoch taken and looks again. The
  highest epoch object names the holder (until it expires or says `released`), lock file or not;
  older ones are removed by the next holder. A writer looking lists the epochs before it reads the
  lock file, so a takeover that completes between its two looks is seen in the lock file.
- Fencing. Whoever takes over an *expired* lease (its holder may be alive, paused or cut off) claims
  its epoch in the log before reading it: it exclusively creates the next segment object, empty. The
  writer puts every segment object exclusively too (`rewind.stores.objectcommit`) and its next object
  is at most the claimed one, so a predecessor's next commit finds the name taken and fails with
  `LogWriteError` ("lost the lease to ..."), and the successor reads everything the predecessor
  committed before the claim. An empty segment is an ordinary (if empty) part of the log.
- Renewing. Before every commit the writer checks its lease: once a third of it has passed (or it is
  about to expire) it checks that no higher epoch exists and writes the lock file again with a new
  expiry; if a higher epoch exists it has lost the lease, and that commit and every later one fail.
  A writer that went longer than the lease without committing renews all the same if nobody took
  over meanwhile; if somebody did, the fence decides.
- Releasing (clean close) marks our epoch object `released`, then removes the lock file if it still
  holds our token: the next writer takes the log at once, without waiting for expiry or fencing. The
  epoch objects stay, so epochs only grow.

Assumptions: the object store gives read-after-write and list-after-write consistency (S3, GCS, Azure
do) and an exclusive create that is atomic (fsspec's mode "xb": If-None-Match or a generation
precondition). Clocks of the hosts differ by less than `CLOCK_SKEW_SECONDS`: the holder stops
trusting its lease that long before it expires. Limits: where a filesystem has no exclusive create,
`Location.create_exclusive` falls back to check-then-put and two writers racing in that window could
both write; the log still refuses what they leave rather than reading it (every record carries its
seq, and a segment whose seqs do not continue the previous one is corruption). A renewal racing a
takeover can leave the lock file naming the loser; the epoch objects decide, and at worst both
writers stop. A takeover against a predecessor that keeps committing gives up after
`_MAX_CLAIM_ATTEMPTS` and leaves its lease to expire, so that the next writer fences again.
"""

from __future__ import annotations

import contextlib
import datetime
import time
import warnings
from collections.abc import Callable
from typing import Annotated

import msgspec

from rewind.stores.codec import LogWriteError
from rewind.stores.fsio import Location
from rewind.stores.lock import (
    MAX_LOCK_BYTES,
    LockInfo,
    LogLockedError,
    StaleLockBroken,
    WriterLock,
    decode_holder,
    is_stale,
    new_holder,
)
from rewind.stores.logread import segment_name

LEASE_SECONDS = 60.0  # how long a lease lasts unless renewed (renewed at commits past a third of it)
CLOCK_SKEW_SECONDS = 10.0  # the most two hosts' clocks may differ by; the holder stops trusting that early
EPOCH_PREFIX = "EPOCH-"
_MAX_ATTEMPTS = 5  # find the holder / take rounds before giving up on a lease that keeps changing
_MAX_CLAIM_ATTEMPTS = 100  # segment names a takeover tries to claim while its predecessor still commits
_SEGMENT_SUFFIX = segment_name(0)[8:]

Clock = Callable[[], float]


class Lease(LockInfo, frozen=True, kw_only=True):
    epoch: Annotated[int, msgspec.Meta(ge=0, le=1 << 53)] = 0
    # Unix seconds, by the holder's clock. None: a rewind 0.2 lock file, which had no lease.
    expires_at: Annotated[float, msgspec.Meta(ge=0, le=1e11)] | None = None
    # Set in its epoch object by a clean release: that epoch holds nothing any more. (Without it, a lock
    # file gone while the newest epoch's lease lives is a taker that has not written the file yet.)
    released: bool = False

    def describe(self) -> str:
        if self.expires_at is None:
            return super().describe()
        return f"{super().describe()} (lease epoch {self.epoch}, expires {iso(self.expires_at)})"


def iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat(timespec="seconds")


def epoch_name(epoch: int) -> str:
    return f"{EPOCH_PREFIX}{epoch:08d}"


def epochs(events_dir: Location) -> list[int]:
    """The epochs taken so far, ascending."""
    stems = (name[len(EPOCH_PREFIX) :] for name in events_dir.list_names() if name.startswith(EPOCH_PREFIX))
    return sorted(int(stem) for stem in stems if stem.isdigit() and len(stem) <= 16)


def read_lease(location: Location) -> Lease | None:
    """The lease (or rewind 0.2 lock) in `location`; None if there is none. Unreadable content
    refuses: on an object store nothing tells a garbled live lease from a dead one."""
    try:
        data = location.read_head(MAX_LOCK_BYTES)
    except FileNotFoundError:
        return None
    lease = decode_holder(data, Lease)
    if not isinstance(lease, Lease):
        raise LogLockedError(location.url, None)
    return lease


def epoch_lease(events_dir: Location, epoch: int) -> Lease | None:
    """The lease its taker wrote into the object of `epoch`; None if gone or unreadable."""
    try:
        data = events_dir.join(epoch_name(epoch)).read_head(MAX_LOCK_BYTES)
    except FileNotFoundError:
        return None
    lease = decode_holder(data, Lease)
    return lease if isinstance(lease, Lease) and lease.expires_at is not None else None


def _current_lease(location: Location) -> tuple[Lease | None, list[int]]:
    """Who holds the log, and the epochs taken. The epochs are listed before the lock file is read: a
    taker makes its epoch object first and writes the lock file after, so a takeover completed between
    the two looks is seen in the lock file, and one half done in the epochs. The newest epoch's taker
    holds the log, whatever the lock file says (it may not have written it yet, or died before it could),
    until its lease expires or it released it; no live epoch and no lock file: nobody."""
    taken = epochs(location.parent)
    current = read_lease(location)
    if taken and (current is None or current.expires_at is not None):
        newest = epoch_lease(location.parent, taken[-1])
        if newest is not None and newest.released and (current is None or current.epoch <= newest.epoch):
            current = None  # released cleanly (its lock file perhaps not removed yet): free
        elif newest is not None and not newest.released and (current is None or taken[-1] > current.epoch):
            current = newest
    return current, taken


class ObjectLease(WriterLock):
    """A held lease. `check_before_commit` renews it (or raises LogWriteError once lost)."""

    def __init__(self, location: Location, lease: Lease, *, clock: Clock, duration: float, renewed_at: float):
        super().__init__(location, lease)
        self.lease = lease
        self.clock = clock  # injectable: tests age a lease without touching any global clock
        self.duration = duration
        self.renewed_at = renewed_at
        self.lost = ""  # why this writer may no longer commit

    @property
    def events_dir(self) -> Location:
        return self.location.parent

    @classmethod
    def acquire(cls, location: Location, *, clock: Clock = time.time) -> ObjectLease:
        duration = LEASE_SECONDS  # read at each call, so that tests can shorten it
        current = None
        for _ in range(_MAX_ATTEMPTS):
            current, taken = _current_lease(location)
            now = clock()
            note, fence = "", False
            if current is not None:
                if is_stale(current):
                    note = f"broke the stale lock of dead {current.describe()} ({location.url})"
                elif current.expires_at is None or now < current.expires_at:
                    raise LogLockedError(location.url, current)
                else:
                    note = f"took over the expired lease of {current.describe()} ({location.url})"
                    fence = True
            if current is not None and current.expires_at is None:
                # A rewind 0.2 lock of a dead process: removed, then taken like a free lock (as 0.2 did).
                if read_lease(location) == current:
                    warnings.warn(note, StaleLockBroken, stacklevel=4)
                    location.remove()
                continue
            held = cls._take(location, current, taken, now, clock, duration)
            if held is None:
                continue  # another writer took this epoch or the file first: look again
            if fence:
                held._claim_next_segment(current)
            if note:
                warnings.warn(note, StaleLockBroken, stacklevel=4)
            return held
        raise LogLockedError(location.url, current)

    @classmethod
    def _take(
        cls,
        location: Location,
        current: Lease | None,
        taken: list[int],
        now: float,
        clock: Clock,
        duration: float,
    ) -> ObjectLease | None:
        """Take the next epoch and write the lease; None if another writer got there first."""
        events_dir = location.parent
        last = max(taken[-1] if taken else 0, current.epoch if current is not None else 0)
        holder = new_holder(kernel_lock=False)
        lease = Lease(**msgspec.structs.asdict(holder), epoch=last + 1, expires_at=now + duration)
        data = msgspec.json.encode(lease)
        try:
            events_dir.join(epoch_name(lease.epoch)).create_exclusive(data)
        except FileExistsError:
            return None
        try:
            if location.exists():
                location.write_atomic(data)  # the epoch object made this takeover ours alone
            else:
                location.create_exclusive(data)  # against a rewind 0.2 writer starting just now
        except FileExistsError:
            # Lost to a writer that made the lock file: our epoch object, left behind, would outrank its
            # lease and stop it at its next renewal.
            with contextlib.suppress(OSError):
                events_dir.join(epoch_name(lease.epoch)).remove()
            return None
        for epoch in taken:
            if epoch < lease.epoch:
                with contextlib.suppress(OSError):
                    events_dir.join(epoch_name(epoch)).remove()
        return cls(location, lease, clock=clock, duration=duration, renewed_at=now)

    def _claim_next_segment(self, predecessor: Lease) -> None:
        """Fence: create the segment object after the last one, so the predecessor's next commit
        (which would be at most that name) finds it taken."""
        for _ in range(_MAX_CLAIM_ATTEMPTS):
            stems = (
                n[: -len(_SEGMENT_SUFFIX)]
                for n in self.events_dir.list_names()
                if n.endswith(_SEGMENT_SUFFIX)
            )
            indices = [int(stem) for stem in stems if stem.isdigit()]
            try:
                self.events_dir.join(segment_name(max(indices, default=-1) + 1)).create_exclusive(b"")
                return
            except FileExistsError:
                continue  # the predecessor committed just now: claim the name after it
        # Keep our lease (not released): the next writer must wait for it to expire and fence again.
        self.held = False
        raise LogLockedError(
            self.location.url,
            None,
            f"was taken over from {predecessor.describe()}, which is still committing; try again later",
        )

    def check_before_commit(self) -> None:
        """Raise LogWriteError if the lease is lost; renew it once a third of it has passed or it is
        about to expire."""
        if self.lost:
            raise LogWriteError(self.lost)
        now = self.clock()
        margin = min(CLOCK_SKEW_SECONDS, self.duration / 3)
        if now - self.renewed_at < self.duration / 3 and now < self.lease.expires_at - margin:
            return
        try:
            newest = epochs(self.events_dir)
            if newest and newest[-1] != self.lease.epoch:
                self.lose(f"lost the lease to {self._successor(newest[-1])}")
            lease = msgspec.structs.replace(self.lease, expires_at=now + self.duration)
            self.location.write_atomic(msgspec.json.encode(lease))
        except OSError as exc:
            raise LogWriteError(
                f"event log {self.events_dir.url}: could not renew the writer's lease: {exc}"
            ) from exc
        self.lease, self.info, self.renewed_at = lease, lease, now

    def lose(self, why: str) -> None:
        """From now on every commit fails with `why` (a successor holds the log)."""
        self.lost = f"event log {self.events_dir.url}: {why}; this writer can no longer commit"
        raise LogWriteError(self.lost)

    def successor(self) -> str:
        """Who holds the log now, for the messages."""
        newest = epochs(self.events_dir)
        return self._successor(newest[-1]) if newest else "another writer"

    def _successor(self, epoch: int) -> str:
        try:
            lease = epoch_lease(self.events_dir, epoch)
        except OSError:
            lease = None
        return lease.describe() if lease is not None else f"the writer of epoch {epoch}"

    def release(self) -> None:
        if self.lost:
            self.held = False  # the lock file is the successor's
            return
        # The epoch object first: once it says released, the next writer takes the log at once (no
        # wait for expiry, no fence), whether the lock file is gone yet or not.
        with contextlib.suppress(OSError):
            done = msgspec.structs.replace(self.lease, released=True)
            self.events_dir.join(epoch_name(self.lease.epoch)).write_atomic(msgspec.json.encode(done))
        super().release()
