"""Bounded reads of one segment of the event log: segments are untrusted input.

A segment may be any size (a crash can leave a hole of gigabytes of zeros; a hostile or broken file
may be 16 GiB of garbage), so nothing here ever reads a segment whole: readers take windows of about
`WINDOW_BYTES` (or one frame, at most `MAX_FRAME`) with `read(offset, size)`. And only a regular file
is read: a name that is a directory, FIFO or device, or a symlink that leads out of the events
directory, raises `UnreadableSegmentError` before a byte is read (opening a FIFO would block; a
device may be endless).

`SegmentSource` is what the parsers take: a local file (pread on one descriptor), an object on an
fsspec filesystem (ranged gets), or bytes already in memory (tests, tools).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat

from rewind.stores.codec import MAGIC, MAGIC_V1, UnreadableSegmentError
from rewind.stores.fsio import Location

WINDOW_BYTES = 1 << 20
_KINDS = {
    stat.S_ISDIR: "a directory",
    stat.S_ISFIFO: "a FIFO",
    stat.S_ISCHR: "a device",
    stat.S_ISBLK: "a device",
}


class SegmentSource:
    """The bytes of one segment, `size` of them as of opening. Subclasses implement `_read`."""

    name: str
    size: int

    def read(self, offset: int, size: int) -> bytes:
        """Bytes [offset, offset + size), fewer where the segment (as of opening) ends first."""
        size = min(size, self.size - offset)
        return self._read(offset, size) if size > 0 and offset >= 0 else b""

    def _read(self, offset: int, size: int) -> bytes:
        raise NotImplementedError

    def next_data(self, offset: int) -> int:
        """The first offset at or after `offset` that may hold anything but zeros (a sparse file's
        holes are skipped where the filesystem says where they are); `size` if none."""
        return offset

    def close(self) -> None:
        pass

    def __enter__(self) -> SegmentSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class BytesSource(SegmentSource):
    def __init__(self, data: bytes, name: str = "") -> None:
        self.name, self.data, self.size = name, data, len(data)

    def _read(self, offset: int, size: int) -> bytes:
        if offset == 0 and size == self.size:
            return self.data
        return self.data[offset : offset + size]


class LocalSource(SegmentSource):
    def __init__(self, path: str, name: str, fd: int, size: int) -> None:
        self.path, self.name, self.fd, self.size = path, name, fd, size

    def _read(self, offset: int, size: int) -> bytes:
        return os.pread(self.fd, size, offset)

    def next_data(self, offset: int) -> int:
        if offset >= self.size or not hasattr(os, "SEEK_DATA"):
            return min(offset, self.size)
        try:
            return min(os.lseek(self.fd, offset, os.SEEK_DATA), self.size)
        except OSError as exc:  # ENXIO: nothing but a hole from here on; else: not supported here
            return self.size if exc.errno == errno.ENXIO else offset

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


class RemoteSource(SegmentSource):
    def __init__(self, location: Location, size: int) -> None:
        self.location, self.name, self.size = location, location.name, size

    def _read(self, offset: int, size: int) -> bytes:
        return self.location.fs.cat_file(self.location.path, start=offset, end=offset + size)


def as_source(data: bytes | SegmentSource, name: str = "") -> SegmentSource:
    return data if isinstance(data, SegmentSource) else BytesSource(data, name)


def open_segment(location: Location) -> SegmentSource:
    """The segment at `location` for bounded reads; UnreadableSegmentError if it is no regular file
    of its directory (nothing read), FileNotFoundError if it is gone."""
    name = location.name
    if not location.is_local:
        info = location.fs.info(location.path)
        if info.get("type") != "file":
            raise UnreadableSegmentError(
                f"{location.url}: not a regular file ({info.get('type')}); nothing read"
            )
        return RemoteSource(location, int(info.get("size") or 0))
    path = location.path
    if os.path.islink(path):
        home = os.path.realpath(os.path.dirname(path))
        target = os.path.realpath(path)
        if os.path.commonpath([home, target]) != home:
            raise UnreadableSegmentError(f"{path}: a symlink leading out of the run ({target}); nothing read")
    _check_regular(path, os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        _check_regular(path, info.st_mode)  # swapped between the check and the open
    except BaseException:
        os.close(fd)
        raise
    return LocalSource(path, name, fd, info.st_size)


def _check_regular(path: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in _KINDS.items() if test(mode)), "not a regular file")
        raise UnreadableSegmentError(f"{path}: {kind}, not a regular file; nothing read")


_MAGIC_PREFIX = MAGIC[:2]
assert MAGIC_V1[:2] == _MAGIC_PREFIX  # both formats' magics start alike: one search finds either


def magic_in(window: bytes, at: int) -> int:
    """Index of the first frame magic (either format) in `window` at or after `at`, or -1. One pass:
    finds the shared prefix and checks the rest, so a window dense with false starts costs no more
    than one without (two `find`s of the two magics would each scan on to the window's end)."""
    while (at := window.find(_MAGIC_PREFIX, at)) >= 0:
        if window[at : at + 4] in (MAGIC, MAGIC_V1):
            return at
        at += 1
    return -1


def find_magic(source: SegmentSource, start: int, end: int | None = None) -> int | None:
    """Offset of the first frame magic (either format) in [start, end) (to the end of the segment
    by default), or None; reads windows, and skips what the filesystem knows to be holes (a sparse
    tail of gigabytes costs nothing)."""
    end = source.size if end is None else min(end, source.size)
    offset = source.next_data(start)
    while offset < end:
        window = source.read(offset, WINDOW_BYTES + 3)
        found = magic_in(window, 0)
        if found >= 0:
            return offset + found if offset + found < end else None
        if len(window) <= 3:
            return None
        offset = source.next_data(offset + len(window) - 3)  # a magic may straddle two windows
    return None
