"""Files a tool writes for the user (exported weights, plots): checked before any work is done, and
written whole or not at all (temp file, fsync, rename), so a full device or a bad path is an error, never
a report of a file that is not there."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from rewind.tools.errors import UsageError

# A run's own files: nothing a tool writes may land among them (an export over events/00000000.log
# would replace the run's log).
RUN_PARTS = ("events", "checkpoints", "snapshots", "tb")


def check_target(out: str, option: str = "--to", kind: str = ".safetensors") -> Path:
    """The output path, refused up front (exit 2) unless it is, or can become, a regular file outside a
    run's own files: a directory, a device such as /dev/full or /dev/null, or a FIFO is not a place for
    output, writing beside one and renaming over it would replace the device node, and a file under a
    run's events/ or checkpoints/ is the run's."""
    if not out.strip():
        raise UsageError(f"{option} '': an empty path; name the {kind} file to write")
    target = Path(out)
    for parent in target.absolute().parents:
        if parent.name in RUN_PARTS and (parent.parent / "events").is_dir():
            raise UsageError(
                f"{option} {out}: inside the run directory {parent.parent}'s {parent.name}/; write elsewhere"
            )
    try:
        info = target.stat()
    except FileNotFoundError:
        return target  # missing directories are created
    except NotADirectoryError:  # a file where a directory of the path belongs
        blocker = next(p for p in reversed(target.parents) if p.exists() and not p.is_dir())
        raise UsageError(f"{option} {out}: {blocker} is not a directory") from None
    except OSError as exc:
        raise UsageError(f"{option} {out}: cannot use this path ({exc.strerror})") from None
    if stat.S_ISDIR(info.st_mode):
        raise UsageError(f"{option} {out}: is a directory; name the {kind} file to write inside it")
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(
            f"{option} {out}: not a regular file (a device, FIFO or socket); name a file to write"
        )
    return target


def write_file_atomically(target: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `target`, fsync it, rename it over `target` and fsync
    the directory: the file is there whole or not at all, and a full disk or a read-only directory is
    an OSError here, not a truncated file reported as written. A missing parent directory is created."""
    from rewind.stores import fsio

    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fsio.write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsio.fsync_dir(str(directory))
