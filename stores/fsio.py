"""Filesystem helpers shared by the stores: one `Location` for local paths and fsspec URLs alike.

`filesystem(url)` turns a plain path or an fsspec URL (`memory://runs/a`, `s3://bucket/run`) into a
`Location(fs, path, is_local)`. Every store goes through it, so the two durability regimes live here:

- Local files (fsspec protocol "file"/"local", or a plain path) get the POSIX treatment: data is
  `fdatasync`ed, and a directory is `fsync`ed after an entry is created, renamed or removed in it,
  because a new file is only durable once the directory that names it is.
- Everything else is treated as an object store: there is no append and no rename, but a whole-object
  put is atomic, so whole-object writes are the unit of durability.

Raw-fd helpers (`write_all`, `sync_fd`, `fsync_dir`) are module functions so that fault tests can
replace them to simulate a full disk or a crash between write and sync.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import NamedTuple

import fsspec
from fsspec.spec import AbstractFileSystem

LOCAL_PROTOCOLS = frozenset({"file", "local"})


class Location(NamedTuple):
    """A file or directory on some filesystem. `path` is the filesystem's own path (no protocol)."""

    fs: AbstractFileSystem
    path: str
    is_local: bool

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def url(self) -> str:
        """What to show a person: the plain path locally, the full URL elsewhere."""
        return self.path if self.is_local else self.fs.unstrip_protocol(self.path)

    def join(self, *names: str) -> Location:
        return self._replace(path="/".join([self.path.rstrip("/"), *names]))

    def exists(self) -> bool:
        return os.path.exists(self.path) if self.is_local else self.fs.exists(self.path)

    def makedirs(self) -> None:
        if self.is_local:
            os.makedirs(self.path, exist_ok=True)
        else:
            self.fs.makedirs(self.path, exist_ok=True)

    def list_names(self) -> list[str]:
        """Names of the entries directly inside this directory; [] when it does not exist."""
        try:
            if self.is_local:
                return os.listdir(self.path)
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path, detail=False)]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def size(self) -> int:
        return os.path.getsize(self.path) if self.is_local else int(self.fs.size(self.path))

    def read_bytes(self, start: int = 0) -> bytes:
        """The whole file, or everything from byte `start` on."""
        if self.is_local:
            with open(self.path, "rb") as f:
                if start:
                    f.seek(start)
                return f.read()
        return self.fs.cat_file(self.path, start=start or None)

    def write_atomic(self, data: bytes | bytearray) -> None:
        """Replace the file with `data` all at once: readers see the old bytes or the new, never a mix.

        Locally: a temporary file in the same directory, fsynced, renamed over the target, then the
        directory fsynced. Elsewhere a single put, which object stores make atomic.
        """
        if not self.is_local:
            self.fs.pipe_file(self.path, bytes(data))
            return
        directory, name = os.path.split(self.path)
        tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            _write_new_file(tmp, data)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.replace(tmp, self.path)
        fsync_dir(directory)

    def create_exclusive(self, data: bytes | bytearray) -> None:
        """Create the file with `data`, raising FileExistsError if it is already there.

        Locally the content is written to a temporary file first and hard-linked into place, which
        is atomic and fails if the name exists: nobody ever sees the file empty or half written
        (O_CREAT | O_EXCL is the fallback where links are not supported). On object stores it is
        best effort: an exclusive-create open where the filesystem has one, else check then put.
        """
        if self.is_local:
            directory, name = os.path.split(self.path)
            tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
            _write_new_file(tmp, data)
            try:
                os.link(tmp, self.path)
            except FileExistsError:
                raise
            except OSError:  # no hard links on this filesystem
                _write_new_file(self.path, data)
            finally:
                os.unlink(tmp)
            fsync_dir(directory)
            return
        try:
            with self.fs.open(self.path, "xb") as f:
                f.write(bytes(data))
        except (ValueError, NotImplementedError):
            # This filesystem has no exclusive-create mode: the check-then-put below can race.
            if self.fs.exists(self.path):
                raise FileExistsError(self.url) from None
            self.fs.pipe_file(self.path, bytes(data))

    def open_append(self, *, create: bool) -> int:
        """Local only: a raw fd appending to the file. `create` makes a new file (failing if one is
        there) and fsyncs the directory, so the file's name is as durable as its synced data."""
        flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o644)
        if create:
            try:
                fsync_dir(os.path.dirname(self.path))
            except BaseException:
                os.close(fd)
                raise
        return fd

    def truncate(self, size: int) -> None:
        """Cut the file to its first `size` bytes, durably. Object stores have no truncate: there the
        prefix is put back as a whole object."""
        if not self.is_local:
            self.write_atomic(self.read_bytes()[:size])
            return
        os.truncate(self.path, size)
        fd = os.open(self.path, os.O_WRONLY)
        try:
            sync_fd(fd)
        finally:
            os.close(fd)

    def remove(self, *, missing_ok: bool = True) -> None:
        try:
            if self.is_local:
                os.unlink(self.path)
                fsync_dir(os.path.dirname(self.path))
            else:
                self.fs.rm_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise


def filesystem(url: str | os.PathLike[str]) -> Location:
    """The filesystem behind a plain path or an fsspec URL, the path on it, and whether it is local."""
    fs, path = fsspec.core.url_to_fs(os.fspath(url))
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    is_local = bool(LOCAL_PROTOCOLS.intersection(protocols))
    if is_local:
        path = os.path.abspath(path)
    return Location(fs, path, is_local)


def _write_new_file(path: str, data: bytes | bytearray) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, data)
        sync_fd(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """os.write until every byte is written: a regular-file write may legitimately be short."""
    view = memoryview(data)
    try:
        while view:
            num_written = os.write(fd, view)
            view = view[num_written:]
    finally:
        view.release()


def sync_fd(fd: int) -> None:
    """Make a file's data (and the size, which fdatasync includes) durable."""
    if hasattr(os, "fdatasync"):
        os.fdatasync(fd)
    else:  # macOS and Windows have no fdatasync
        os.fsync(fd)


def fsync_dir(path: str) -> None:
    """Make a directory's entries durable (a created, renamed or removed name). No-op where unsupported."""
    if not hasattr(os, "O_DIRECTORY"):  # Windows cannot open a directory for fsync
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
