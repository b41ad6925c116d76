"""Reading files rewind did not write, or that anyone could have replaced (a tokenizer.json, a manifest,
a config.json, a token file, a weights header): only a regular file (a FIFO would block the reader,
/dev/zero never ends; a link is followed to what must be a regular file), never more than a byte cap
stated per kind of file (a `RefusedFile` otherwise), and JSON through msgspec with nesting too deep or
text not UTF-8 refused as malformed. `rewind.stores.fsio.Location.read_bounded` and `read_json` read
whole files this way on any filesystem.
"""

from __future__ import annotations

import errno
import os
import stat

import msgspec


class RefusedFile(OSError):
    """A file rewind will not read: not a regular file, or larger than a file of its kind may be.

    An OSError (errno EINVAL, EISDIR or EFBIG; `strerror` says why, `filename` names the file), so that
    every caller that already puts a failed read in one line ("PATH: cannot read: REASON") says it."""


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """(fd, its stat) of the local file at `path`, opened for reading only if it is a regular file
    (links followed): RefusedFile for a directory, FIFO, device or socket. The kind is checked before
    the open (opening some devices does something) and again on the descriptor (the name may have been
    swapped in between); the open does not block (O_NONBLOCK: a FIFO's open would wait for a writer),
    and reads do (cleared once the file is known to be regular). FileNotFoundError when absent."""
    refuse_irregular(os.stat(path).st_mode, path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        info = os.fstat(fd)
        refuse_irregular(info.st_mode, path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, info


_IRREGULAR = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def refuse_irregular(mode: int, path: str) -> None:
    if stat.S_ISREG(mode):
        return
    if stat.S_ISDIR(mode):
        raise RefusedFile(errno.EISDIR, "is a directory, not a file", path)
    kind = next((name for test, name in _IRREGULAR if test(mode)), "not a plain file")
    raise RefusedFile(errno.EINVAL, f"{kind}, not a regular file", path)


def too_large(size: int, max_bytes: int, path: str) -> RefusedFile:
    return RefusedFile(
        errno.EFBIG, f"{size:,} bytes, more than the {max_bytes:,} a file of its kind may hold", path
    )


def decode_json(data: bytes | str, kind: object = object) -> object:
    """msgspec's JSON decode of untrusted bytes (as `kind`, default any JSON), where a string that is not
    UTF-8 and nesting deeper than the interpreter's recursion limit (a thousand levels: no file rewind
    reads comes near) are a msgspec.DecodeError like any other malformed JSON, not a UnicodeDecodeError
    or a RecursionError."""
    try:
        return msgspec.json.decode(data, type=kind)
    except RecursionError:
        raise msgspec.DecodeError("JSON is malformed: nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise msgspec.DecodeError(f"JSON is malformed: not UTF-8 (byte {exc.start})") from None
