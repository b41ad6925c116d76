"""Reading files named by a run directory without leaving it: a run directory is untrusted input.

Names come from files anyone can edit (a manifest's file entries, checkpoint directory names, snapshot
names), so before a byte is read the name must be a plain name (no `..`, no separator, not absolute),
the path must resolve (symlinks followed) to a place inside the run directory, and what is there must be
a regular file: a FIFO would block a reader forever, /dev/zero would feed it forever. Sizes are checked
against what the caller expects before reading, and reads go in bounded pieces, so a file that grows
while it is read cannot make a reader take more than it asked for.

Local paths only: object stores have no symlinks, FIFOs or devices, and their keys are checked by name.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator, Sequence

from rewind.states.admission import plain_name_problem

CHUNK_BYTES = 1 << 22


class NotConfined(Exception):
    """A name from a run directory that leads outside it, or to something that is not a regular file."""


def inside_path(run_root: str, parts: Sequence[str]) -> str:
    """The real path of `run_root/parts...`, whether or not anything is there yet (a place about to be
    written), refused (NotConfined) unless every part is a plain name and the path, every link on the
    way resolved, stays inside `run_root` (itself resolved: a run directory may be a link)."""
    for part in parts:
        if problem := plain_name_problem(part):
            raise NotConfined(problem)
    root = os.path.realpath(run_root)
    resolved = os.path.realpath(os.path.join(run_root, *parts))
    if os.path.commonpath([root, resolved]) != root or resolved == root:
        raise NotConfined(f"{'/'.join(parts)} leads outside the run directory (to {resolved})")
    return resolved


def confined_path(run_root: str, parts: Sequence[str]) -> str:
    """`inside_path` of something that must be there: FileNotFoundError when nothing is."""
    resolved = inside_path(run_root, parts)
    os.stat(resolved)  # FileNotFoundError for a dangling name, before any other complaint
    return resolved


def _open_regular(path: str, display: str) -> tuple[int, int]:
    """(fd, size) of the regular file at `path` (already resolved); NotConfined for anything else.
    Checked before opening too: opening some devices has effects of its own."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise NotConfined(f"{display} is not a regular file")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NOCTTY", 0)
    fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    info = os.fstat(fd)  # what was opened, in case the name was swapped since the check
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotConfined(f"{display} is not a regular file")
    return fd, info.st_size


def _size_problem(size: int, expected: int | None, limit: int | None) -> str:
    if expected is not None and size != expected:
        return f"{size} bytes, but {expected} were recorded"
    if limit is not None and size > limit:
        return f"{size} bytes, more than the {limit} a file of its kind may hold"
    return ""


def _pieces(fd: int, size: int, display: str) -> Iterator[bytes]:
    num_read = 0
    while num_read <= size:  # one byte past the size: a file that grew since the stat shows
        piece = os.read(fd, min(CHUNK_BYTES, size + 1 - num_read))
        if not piece:
            break
        num_read += len(piece)
        yield piece
    if num_read != size:
        raise NotConfined(f"{display}: changed size while being read ({size} -> {num_read} bytes)")


def read_file(run_root: str, parts: Sequence[str], *, expected_size: int | None = None, max_size: int | None = None) -> bytes:
    """The bytes of a regular file inside the run, whose size must be `expected_size` (when given) and at
    most `max_size` (when given). NotConfined names the problem; FileNotFoundError when it is absent."""
    display = "/".join(parts)
    fd, size = _open_regular(confined_path(run_root, parts), display)
    try:
        if problem := _size_problem(size, expected_size, max_size):
            raise NotConfined(f"{display}: {problem}")
        return b"".join(_pieces(fd, size, display))
    finally:
        os.close(fd)


def hash_file(run_root: str, parts: Sequence[str], *, expected_size: int | None = None) -> str:
    """sha256 of a regular file inside the run, of the size recorded for it, read in bounded pieces."""
    display = "/".join(parts)
    fd, size = _open_regular(confined_path(run_root, parts), display)
    try:
        if problem := _size_problem(size, expected_size, None):
            raise NotConfined(f"{display}: {problem}")
        digest = hashlib.sha256()
        for piece in _pieces(fd, size, display):
            digest.update(piece)
        return digest.hexdigest()
    finally:
        os.close(fd)
