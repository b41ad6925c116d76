"""The single-writer lock of an event log: a lock file naming its holder.

The file (`RUN/events/LOCK`) holds a msgspec-JSON `LockInfo`: host, pid, start time and a random
token. Taking the lock creates the file exclusively: atomically on local filesystems
(O_CREAT | O_EXCL), best effort on object stores (see `Location.create_exclusive`).

A lock left by a process that died on this host (`os.kill(pid, 0)` fails with ESRCH) is stale: it is
broken with a `StaleLockBroken` warning and taken. A live holder, a holder on another host (whose
liveness cannot be checked from here) or an unreadable lock file refuse the writer with
`LogLockedError`, which names the holder. Readers never look at the lock.

Release removes the file only if it still carries our token, so a writer whose stale-looking lock was
broken by someone else never deletes the new holder's lock.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import socket
import warnings

import msgspec

from rewind.stores.codec import LogError
from rewind.stores.fsio import Location

_MAX_ATTEMPTS = 5  # create / find stale / break rounds before giving up on a lock that keeps changing


class LockInfo(msgspec.Struct, frozen=True, kw_only=True):
    host: str
    pid: int
    since: str  # ISO 8601, UTC: when the holder took the lock
    token: str  # random: tells our lock from a successor's

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host} since {self.since}"


class StaleLockBroken(UserWarning):
    """A lock left by a dead process on this host was removed so a new writer could start."""


class LogLockedError(LogError):
    """Another writer holds the log (or its lock file cannot be read)."""

    def __init__(self, lock_url: str, holder: LockInfo | None):
        self.lock_url = lock_url
        self.holder = holder
        if holder is None:
            message = (
                f"event log is locked by an unreadable lock file {lock_url}; "
                "if no writer is running, delete it"
            )
        else:
            message = f"event log is locked by {holder.describe()} ({lock_url})"
            if holder.host != socket.gethostname():
                message += "; if that process is gone, delete the lock file"
        super().__init__(message)


def read_lock(location: Location) -> LockInfo | None:
    """The holder named by the lock file; None if there is no lock or it cannot be decoded."""
    try:
        return msgspec.json.decode(location.read_bytes(), type=LockInfo)
    except FileNotFoundError:
        return None
    except msgspec.DecodeError:
        return None


def is_stale(holder: LockInfo) -> bool:
    """True only when the holder is certainly dead: same host, and no process has its pid."""
    if holder.host != socket.gethostname() or holder.pid <= 0:  # pid <= 0 would signal a group
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, owned by someone else
        return False
    return False


class WriterLock:
    """A held lock. `acquire` takes it (or raises LogLockedError); `release` gives it back."""

    def __init__(self, location: Location, info: LockInfo):
        self.location = location
        self.info = info
        self.held = True

    @classmethod
    def acquire(cls, location: Location) -> WriterLock:
        info = LockInfo(
            host=socket.gethostname(),
            pid=os.getpid(),
            since=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            token=secrets.token_hex(8),
        )
        data = msgspec.json.encode(info)
        holder = None
        for _ in range(_MAX_ATTEMPTS):
            try:
                location.create_exclusive(data)
                return cls(location, info)
            except FileExistsError:
                pass
            holder = read_lock(location)
            if holder is None:
                if not location.exists():
                    continue  # released between our create and our read: try again
                raise LogLockedError(location.url, None)
            if not is_stale(holder):
                raise LogLockedError(location.url, holder)
            # Re-read just before removing: another starter may have broken it and taken it already.
            if read_lock(location) == holder:
                warnings.warn(
                    f"broke the stale lock of dead {holder.describe()} ({location.url})",
                    StaleLockBroken,
                    stacklevel=3,
                )
                location.remove()
        raise LogLockedError(location.url, holder)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        current = read_lock(self.location)
        if current is not None and current.token == self.info.token:
            with contextlib.suppress(FileNotFoundError):
                self.location.remove()
