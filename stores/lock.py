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

The lock file is untrusted input: whatever sits at its name was put there by someone. It is read at
most `MAX_LOCK_BYTES`, never through a symbolic link, and only if it is a regular file with no other
name (a hard link would make our writes land in someone else's file); a FIFO, device, directory,
socket or symbolic link there refuses with `LogLockedError` and is never opened for reading or
waited on. A holder whose fields are out of range (a pid outside 1..`PID_MAX`, a host that is not a
short printable word) is an unreadable holder, like any other garbage.

A writer writes only inside its run: once the kernel's lock is held, and before the holder is written,
the run directory the lock file's `events/` belongs to is looked over (rewind.stores.runguard): a link
anywhere in it leading out of the run, a FIFO or a device, a file where rewind keeps a directory refuse
the writer (`NotWritable`, one line) with the lock file left as it was, so a refused command has changed
nothing in the run.

Object stores (no flock): the lock file holds a lease that expires unless its writer renews it, and
every new holder claims a writer epoch in the log; see `rewind.stores.lease`.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import os
import secrets
import socket
import stat
import warnings
from typing import Annotated

import msgspec

from rewind.stores.codec import LogError
from rewind.stores.fsio import Location
from rewind.stores.runguard import check_writable

MAX_LOCK_BYTES = 4096  # what rewind writes is a few hundred bytes; more is not a lock file
RUN_LOG_DIR = "events"  # a run's lock file is RUN/events/LOCK (rewind.stores.logread.EVENTS_DIR)
PID_MAX = 1 << 22  # Linux's PID_MAX_LIMIT; other systems' pids stay below it

# Fields of a file anyone can write: bounded, printable, one word (they end up in one-line messages).
_Word = Annotated[str, msgspec.Meta(min_length=1, max_length=255, pattern=r"^[!-~]+\Z")]
_ShortWord = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[!-~]+\Z")]
_Pid = Annotated[int, msgspec.Meta(ge=1, le=PID_MAX)]


class LockInfo(msgspec.Struct, frozen=True, kw_only=True):
    host: _Word
    pid: _Pid
    since: _ShortWord  # ISO 8601, UTC: when the holder took the lock
    token: _ShortWord  # random: tells our lock from a successor's
    kernel_lock: bool = False  # held with flock (rewind >= 0.2 on a local filesystem)

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host} since {self.since}"


class StaleLockBroken(UserWarning):
    """A lock left by a dead process on this host (or an expired lease) was taken over by a new writer."""


class LogLockedError(LogError):
    """Another writer holds the log, or its lock file cannot be read or is not a file at all."""

    def __init__(self, lock_url: str, holder: LockInfo | None, reason: str = ""):
        self.lock_url = lock_url
        self.holder = holder
        if reason:
            message = f"event log lock {lock_url} {reason}; if no writer is running, remove it"
        elif holder is None:
            message = (
                f"event log is locked by an unreadable lock file {lock_url}; "
                "if no writer is running, delete it"
            )
        else:
            message = f"event log is locked by {holder.describe()} ({lock_url})"
            if getattr(holder, "expires_at", None) is not None:
                message += "; if that process is gone, the lease can be taken over once it expires"
            elif holder.host != socket.gethostname():
                message += "; if that process is gone, delete the lock file"
        super().__init__(message)


def decode_holder(data: bytes, kind: type[LockInfo] = LockInfo) -> LockInfo | None:
    """The holder `data` names, or None when it is too large, not JSON, or out of range."""
    if len(data) > MAX_LOCK_BYTES:
        return None
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.DecodeError:  # ValidationError (a field out of range) included
        return None


def read_lock(location: Location) -> LockInfo | None:
    """The holder named by the lock file; None if there is none, or it cannot be read or decoded."""
    try:
        return decode_holder(location.read_head(MAX_LOCK_BYTES))
    except OSError:  # missing, or not a regular file: no holder this code can name
        return None


def is_stale(holder: LockInfo) -> bool:
    """True only when the holder is certainly dead: same host, and no process has its pid, or the
    process is a zombie (killed, not yet reaped: `kill(pid, 0)` still succeeds on it)."""
    if holder.host != socket.gethostname() or not 0 < holder.pid <= PID_MAX:  # pid <= 0 signals a group
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
            stat_line = handle.read(4096)
    except OSError:
        return False  # no /proc here: cannot tell, so alive
    # "pid (comm) state ...": comm may hold spaces and parentheses, so the state follows the last ")".
    return stat_line[stat_line.rfind(b")") + 2 : stat_line.rfind(b")") + 3] == b"Z"


def _read_fd(fd: int) -> LockInfo | bool | None:
    """What the lock file says: a LockInfo; False when it is empty (released cleanly, or new); None
    when it holds something else (garbage, too large, fields out of range)."""
    data = os.pread(fd, MAX_LOCK_BYTES + 1, 0)
    if not data:
        return False
    return decode_holder(data)


def not_a_lock_file(mode: int, num_links: int) -> str:
    """Why a file of this `st_mode` and link count cannot serve as the lock file ("" if it can)."""
    kinds = (
        (stat.S_ISLNK, "is a symbolic link"),
        (stat.S_ISDIR, "is a directory"),
        (stat.S_ISFIFO, "is a FIFO"),
        (stat.S_ISCHR, "is a device"),
        (stat.S_ISBLK, "is a device"),
        (stat.S_ISSOCK, "is a socket"),
    )
    for test, what in kinds:
        if test(mode):
            return f"{what}, not a lock file"
    if not stat.S_ISREG(mode):
        return "is not a regular file"
    if num_links > 1:
        return "has other names (hard links), so writing it could change another file"
    return ""


def _open_local(location: Location) -> int:
    """An fd on the lock file, created if missing; LogLockedError for anything but a plain file.
    Checked before opening (opening a FIFO or a device can block or act) and again on the open fd
    (the name may have been swapped in between)."""
    path = location.path
    with contextlib.suppress(FileNotFoundError):
        before = os.lstat(path)
        if why := not_a_lock_file(before.st_mode, before.st_nlink):
            raise LogLockedError(location.url, None, why)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LogLockedError(location.url, None, "is a symbolic link, not a lock file") from None
        if exc.errno in (errno.EISDIR, errno.ENXIO, errno.ENODEV, errno.ETXTBSY):
            raise LogLockedError(
                location.url, None, f"cannot be used as a lock file ({exc.strerror})"
            ) from None
        raise  # EACCES, EROFS, ENOSPC...: the filesystem's answer, as it is
    try:
        after = os.fstat(fd)
        if why := not_a_lock_file(after.st_mode, after.st_nlink):
            raise LogLockedError(location.url, None, why)
    except BaseException:
        os.close(fd)
        raise
    return fd


class WriterLock:
    """A held lock. `acquire` takes it (or raises LogLockedError); `release` gives it back."""

    def __init__(self, location: Location, info: LockInfo, fd: int | None = None):
        self.location = location
        self.info = info
        self.fd = fd  # the flock'd file (local filesystems)
        self.held = True

    @classmethod
    def acquire(cls, location: Location) -> WriterLock:
        """The kernel's lock on a local lock file (an object store's is `rewind.stores.lease.ObjectLease`)."""
        info = new_holder(kernel_lock=True)
        fd = _open_local(location)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise LogLockedError(location.url, _read_fd(fd) or None) from None
            previous = _read_fd(fd)
            if isinstance(previous, LockInfo) and not previous.kernel_lock and not is_stale(previous):
                raise LogLockedError(location.url, previous)  # a rewind 0.1 writer, alive: no kernel lock
            if location.parent.name == RUN_LOG_DIR:  # the lock of a run's log (not a lone lock file)
                check_writable(location.parent.parent)
            if previous is not False:
                who = previous.describe() if isinstance(previous, LockInfo) else "an unreadable holder"
                warnings.warn(
                    f"took over the lock of dead {who} ({location.url})", StaleLockBroken, stacklevel=4
                )
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


def new_holder(*, kernel_lock: bool) -> LockInfo:
    """This process as a lock holder, with a fresh token."""
    return LockInfo(
        host=socket.gethostname(),
        pid=os.getpid(),
        since=now_iso(),
        token=secrets.token_hex(8),
        kernel_lock=kernel_lock,
    )


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
