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

Files a user or a run directory supplies (a tokenizer.json, a manifest, a config.json, a token file)
are read through `Location.read_bounded` / `read_json` (built on rewind.stores.untrusted): only a
regular file, at most a byte cap stated per kind of file, JSON through msgspec. A file appended to (a
log segment, metrics.jsonl) is opened by `open_appending`: a regular file too, never waited on.

Errors: a URL whose filesystem cannot be had (its fsspec backend is not installed, or the protocol is
unknown) raises `FilesystemUnavailable`, a `LogError`, naming the package to install. What the
filesystem itself refuses (ENOSPC, EROFS, EACCES, ...) is never caught here: it leaves as the OSError
it is, errno and filename intact, for the command line to put in one line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from typing import NamedTuple

import fsspec
from fsspec.spec import AbstractFileSystem

from rewind.stores.codec import LogError

# Re-exported (`X as X`): the readers of untrusted files have always imported them from here.
from rewind.stores.untrusted import RefusedFile as RefusedFile
from rewind.stores.untrusted import decode_json as decode_json
from rewind.stores.untrusted import open_regular as open_regular
from rewind.stores.untrusted import refuse_irregular, too_large

LOCAL_PROTOCOLS = frozenset({"file", "local"})

# The pip package behind each protocol whose backend lives outside fsspec (fsspec's own message, the
# fallback, names some of them but not all, and in different words).
BACKEND_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "hf": "huggingface_hub",
    "sftp": "paramiko",
    "ssh": "paramiko",
    "webdav": "webdav4",
    "dropbox": "dropboxdrivefs",
    "oci": "ocifs",
    "oss": "ossfs",
    "hdfs": "pyarrow",
    "smb": "smbprotocol",
}

# Where a link cannot be made for want of support (not for want of space or permission, which must
# surface as they are): the filesystem has no hard links, or not across these two names.
_NO_LINK_ERRNOS = frozenset(
    {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}
)


class FilesystemUnavailable(LogError):
    """The filesystem of a URL cannot be used here: unknown protocol, or its backend is not installed."""


# Read at a time by the bounded readers (a cap is checked before each piece, never after the whole).
_READ_PIECE = 1 << 22


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

    @property
    def parent(self) -> Location:
        return self._replace(path=self.path.rstrip("/").rsplit("/", 1)[0] or "/")

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

    def read_head(self, max_bytes: int) -> bytes:
        """At most `max_bytes + 1` bytes from the start of a file that may be hostile (a lock file):
        one byte more than asked tells the caller it is too large. Locally only a regular file is
        read, never through a symbolic link and never waiting on a FIFO: anything else raises an
        OSError (ELOOP, or EINVAL for a FIFO, device, socket or directory)."""
        if not self.is_local:
            return self.fs.cat_file(self.path, start=0, end=max_bytes + 1)
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", self.path)
            return os.pread(fd, max_bytes + 1, 0)
        finally:
            os.close(fd)

    def read_bounded(self, max_bytes: int) -> bytes:
        """The whole file, which must be a regular file (`open_regular`) of at most `max_bytes` bytes:
        RefusedFile otherwise, before more than `max_bytes + 1` bytes are read (a file that grows while
        it is read included). FileNotFoundError when it is absent."""
        if not self.is_local:  # (object stores hold no FIFOs or devices: only the size is checked)
            size = int(self.fs.size(self.path))
            if size > max_bytes:
                raise too_large(size, max_bytes, self.url)
            data = self.fs.cat_file(self.path, start=0, end=max_bytes + 1)
        else:
            fd, info = open_regular(self.path)
            try:
                if info.st_size > max_bytes:
                    raise too_large(info.st_size, max_bytes, self.path)
                pieces: list[bytes] = []
                num_read = 0
                while num_read <= max_bytes and (piece := os.read(fd, min(_READ_PIECE, max_bytes + 1 - num_read))):
                    pieces.append(piece)
                    num_read += len(piece)
                data = b"".join(pieces)
            finally:
                os.close(fd)
        if len(data) > max_bytes:
            raise RefusedFile(errno.EFBIG, f"grew past {max_bytes:,} bytes while it was read", self.url)
        return data

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
            write_new_file(tmp, data)
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
            write_new_file(tmp, data)
            try:
                os.link(tmp, self.path)
            except OSError as exc:
                if exc.errno not in _NO_LINK_ERRNOS:
                    raise  # FileExistsError, and a full disk or a refusal, as they are
                write_new_file(self.path, data)
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
        """Local only: a raw fd appending to the file, which must be a regular file (`open_appending`).
        `create` makes a new file (failing if one is there) and fsyncs the directory, so the file's name
        is as durable as its synced data."""
        fd = open_appending(self.path, exclusive=create)
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
        if not self.is_local:  # only the prefix is fetched: the rest may be gigabytes of a torn write
            self.write_atomic(self.fs.cat_file(self.path, start=0, end=size) if size > 0 else b"")
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
    """The filesystem behind a plain path or an fsspec URL, the path on it, and whether it is local.

    Raises FilesystemUnavailable (one line, naming what to install) when fsspec cannot provide it."""
    url = os.fspath(url)
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise _unavailable(url, exc) from None
    except ValueError as exc:
        if not str(exc).startswith("Protocol not known"):
            raise
        raise _unavailable(url, exc) from None
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    is_local = bool(LOCAL_PROTOCOLS.intersection(protocols))
    if is_local:
        path = os.path.abspath(path)
    return Location(fs, path, is_local)


def _unavailable(url: str, exc: Exception) -> FilesystemUnavailable:
    """Which protocol of `url` (a chain such as `simplecache::s3://...` has several) failed, and why."""
    for part in url.split("::"):
        protocol = fsspec.core.split_protocol(part)[0]
        if protocol is None:
            continue
        if protocol not in fsspec.available_protocols():
            return FilesystemUnavailable(f"{url}: unknown protocol {protocol!r}")
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as missing:
            package = BACKEND_PACKAGES.get(protocol)
            if package is None:
                return FilesystemUnavailable(f"{url}: protocol {protocol!r} is not available: {missing}")
            return FilesystemUnavailable(
                f"{url}: protocol {protocol!r} needs the package {package}, which is not installed "
                f"(pip install {package})"
            )
    return FilesystemUnavailable(f"{url}: cannot open this filesystem: {exc}")


def read_json(location: Location, max_bytes: int, kind: object = object) -> object:
    """`location.read_bounded(max_bytes)` decoded by `decode_json`: RefusedFile / FileNotFoundError /
    OSError for the file, msgspec.DecodeError (ValidationError included) for what it holds."""
    return decode_json(location.read_bounded(max_bytes), kind)


def open_appending(path: str, *, exclusive: bool = False) -> int:
    """A raw fd appending to the local file `path`, created if missing (`exclusive`: which must be
    missing, FileExistsError otherwise). What is there must be a regular file (links followed): a FIFO,
    device, socket or directory is a RefusedFile, found before the open (opening a FIFO to write waits
    for a reader, opening a device can act) and again on the descriptor (the name may have been swapped
    in between). The open never blocks (O_NONBLOCK, cleared once the file is known to be regular)."""
    if not exclusive:
        with contextlib.suppress(FileNotFoundError):
            refuse_irregular(os.stat(path).st_mode, path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | (os.O_EXCL if exclusive else 0)
    fd = os.open(path, flags | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        refuse_irregular(os.fstat(fd).st_mode, path)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_new_file(path: str, data: bytes | bytearray) -> None:
    """Create the local file `path` (it must not exist) holding `data`, synced: durable once its directory is."""
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
