"""The single-writer lock of an event log: a lock file naming its holder.

The file (`RUN/events/LOCK`) holds a msgspec-JSON `LockInfo`: host, pid, start time and a random
token, for the messages. Readers never look at the lock.

Local filesystems: the kernel holds the lock. The writer opens the file and takes `flock(LOCK_EX)` on
it; the kernel drops it the moment the process dies, however it dies, and before it is reaped: a
killed writer that is still a zombie, or whose container's init reaps slowly, does not hold it, so
`kill -9` followed at once by the same command is never refused. The file is never deleted (deleting
a file others may be waiting to lock lets two of them lock two different files); a clean release
empties it. When the lock is free but the file still names a holder, that holder died: it is taken
over with a `StaleLockBroken` warning. One exception: a holder written by rewind 0.1, which held no
kernel lock (`kernel_lock` false), is only taken over if it is certainly dead (same host, no such
process or a zombie), so a 0.1 writer still running is never joined by a second writer.

Object stores (no flock): the file is created exclusively (best effort, `Location.create_exclusive`);
a lock of a dead process on this host is broken with `StaleLockBroken`; a live holder, one on another
host or an unreadable file refuse with `LogLockedError`, which names the holder. Release removes the
file only if it still carries our token.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
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
    kernel_lock: bool = False  # held with flock (rewind >= 0.2 on a local filesystem)

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
    """True only when the holder is certainly dead: same host, and no process has its pid, or the
    process is a zombie (killed, not yet reaped: `kill(pid, 0)` still succeeds on it)."""
    if holder.host != socket.gethostname() or not 0 < holder.pid < 1 << 31:  # pid <= 0 signals a group
        return False
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: alive, owned by someone else
        return False
    return _is_zombie(holder.pid)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read(4096)
    except OSError:
        return False  # no /proc here: cannot tell, so alive
    # "pid (comm) state ...": comm may hold spaces and parentheses, so the state follows the last ")".
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] == b"Z"


def _read_fd(fd: int) -> LockInfo | bool | None:
    """What the lock file says: a LockInfo; False when it is empty (released cleanly, or new); None
    when it holds something else. Read bounded: it is a few hundred bytes when rewind wrote it."""
    data = os.pread(fd, 4096, 0)
    if not data:
        return False
    try:
        return msgspec.json.decode(data, type=LockInfo)
    except msgspec.DecodeError:
        return None


class WriterLock:
    """A held lock. `acquire` takes it (or raises LogLockedError); `release` gives it back."""

    def __init__(self, location: Location, info: LockInfo, fd: int | None = None):
        self.location = location
        self.info = info
        self.fd = fd  # the flock'd file (local filesystems)
        self.held = True

    @classmethod
    def acquire(cls, location: Location) -> WriterLock:
        info = LockInfo(
            host=socket.gethostname(),
            pid=os.getpid(),
            since=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            token=secrets.token_hex(8),
            kernel_lock=location.is_local,
        )
        if location.is_local:
            return cls._acquire_local(location, info)
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

    @classmethod
    def _acquire_local(cls, location: Location, info: LockInfo) -> WriterLock:
        path = location.path
        if os.path.lexists(path) and not os.path.isfile(path):
            raise LogLockedError(location.url, None)  # a directory, FIFO or device where the lock belongs
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LogLockedError(location.url, _read_fd(fd) or None) from None
            previous = _read_fd(fd)
            if isinstance(previous, LockInfo) and not previous.kernel_lock and not is_stale(previous):
                raise LogLockedError(location.url, previous)  # a rewind 0.1 writer, alive: no kernel lock
            if previous is not False:
                who = previous.describe() if isinstance(previous, LockInfo) else "an unreadable holder"
                warnings.warn(f"took over the lock of dead {who} ({location.url})", StaleLockBroken, stacklevel=4)
            os.ftruncate(fd, 0)
            os.pwrite(fd, msgspec.json.encode(info), 0)
        except BaseException:
            os.close(fd)  # closing drops the flock too
            raise
        return cls(location, info, fd)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        if self.fd is not None:
            fd, self.fd = self.fd, None
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # empty: released cleanly (the file stays, see the docstring)
            os.close(fd)  # and the kernel lock goes with the descriptor
            return
        current = read_lock(self.location)
        if current is not None and current.token == self.info.token:
            with contextlib.suppress(FileNotFoundError):
                self.location.remove()
