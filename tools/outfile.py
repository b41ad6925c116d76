"""Files a tool writes for the user (exported weights, plots): checked before any work is done, and
written whole or not at all (temp file, fsync, rename), so a full device or a bad path is an error, never
a report of a file that is not there.

What is there already: a plot (`--plot FILE`) replaces the file the user named, as drawing it again is
what the option is for; an export never replaces a file (`check_target(..., replace=False)`) or writes
into a directory that is not empty (`check_out_directory`) unless asked to (`--overwrite`), and then only
a directory an earlier export wrote. An export's outputs are written together (`write_outputs`): each into
a temporary sibling, renamed into place only once every one is whole, so a failure leaves none of them.

A kill (which no `except` sees) can leave those siblings: `.NAME.tmp-PID-HEX` (an output being written) and
`.NAME.old-PID-HEX` (what --overwrite moved aside, NAME's earlier export, removed once the new one is in
place). So before an output path is checked, its own siblings are put right (`recover`): a `.NAME.old-*`
where NAME is missing (killed between the two renames) is renamed back to NAME, the earlier export as it
was; the others are removed; one line on stderr says what was done. Only names of exactly that pattern, of
the kind rewind writes there (a regular file, or a directory of regular files), and of a process that is
no longer running, are touched. A kill between the renames of two outputs leaves those renamed new and
the others as they were: each is whole, but they are not of one export (the summary line of the killed
export never came)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import shutil
import stat
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from rewind.tools.errors import CommandError, UsageError

# A run's own files: nothing a tool writes may land among them (an export over events/00000000.log
# would replace the run's log).
RUN_PARTS = ("events", "checkpoints", "snapshots", "tb", "rollouts", "data", "cache", "trunks")


def _inside_a_run(option: str, out: str, places: Iterable[Path]) -> None:
    for parent in places:
        if parent.name in RUN_PARTS and (parent.parent / "events").is_dir():
            raise UsageError(
                f"{option} {out}: inside the run directory {parent.parent}'s {parent.name}/; write elsewhere"
            )


def check_target(out: str, option: str = "--to", kind: str = ".safetensors", *, replace: bool = True) -> Path:
    """The output path, refused up front (exit 2) unless it is, or can become, a regular file outside a
    run's own files: a directory, a device such as /dev/full or /dev/null, or a FIFO is not a place for
    output, writing beside one and renaming over it would replace the device node, and a file under a
    run's events/ or checkpoints/ is the run's. `replace` False: an existing file is refused too (an
    export's, without --overwrite)."""
    if not out.strip():
        raise UsageError(f"{option} '': an empty path; name the {kind} file to write")
    target = Path(out)
    _inside_a_run(option, out, target.absolute().parents)
    recover(option, out)
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
    if not replace:
        raise UsageError(f"{option} {out}: exists; name a new file, or give --overwrite to replace it")
    return target


def check_out_directory(option: str, out_dir: str, names: Iterable[str], *, overwrite: bool) -> Path:
    """An export's output directory, refused up front (exit 2) unless it is new or empty, or, with
    `overwrite`, holds nothing but files of `names` (what an earlier export wrote there, which it replaces
    whole): a user's files are never deleted nor mixed with an export's. Never a URL, a link, a file, or a
    place among a run's own files."""
    if not out_dir.strip():
        raise UsageError(f"{option} '': an empty path; name the directory to write to")
    if "://" in out_dir or "::" in out_dir:
        raise UsageError(f"{option} {out_dir}: a local directory is expected, not a URL")
    target = Path(out_dir)
    _inside_a_run(option, out_dir, (target.absolute(), *target.absolute().parents))
    recover(option, out_dir)
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return target  # missing directories are created
    except NotADirectoryError:  # a file where a directory of the path belongs
        blocker = next(p for p in reversed(target.parents) if p.exists() and not p.is_dir())
        raise UsageError(f"{option} {out_dir}: {blocker} is not a directory") from None
    if not stat.S_ISDIR(info.st_mode):
        raise UsageError(f"{option} {out_dir}: exists and is not a directory; name a new directory")
    found = sorted(os.listdir(target))
    if not found:
        return target
    if not overwrite:
        raise UsageError(
            f"{option} {out_dir}: exists and is not empty; name a new or empty directory "
            "(--overwrite replaces an earlier export there)"
        )
    ours = set(names)
    foreign = [n for n in found if n not in ours or not stat.S_ISREG(os.lstat(target / n).st_mode)]
    if foreign:
        raise UsageError(
            f"{option} {out_dir}: holds what no export writes ({', '.join(foreign[:3])}"
            f"{', ...' if len(foreign) > 3 else ''}), which --overwrite would delete; name another directory"
        )
    return target


def _debris(target: Path) -> list[tuple[str, Path]]:
    """(kind "tmp" or "old", path) of the siblings a killed write of `target` left (see the module's
    docstring): rewind's exact names, of a process no longer running, of the kind rewind writes."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(tmp|old)-([0-9]+)-[0-9a-f]{{8}}", re.ASCII)
    parent = target.absolute().parent
    try:
        names = sorted(os.listdir(parent))
    except OSError:  # a missing parent: nothing left there
        return []
    found = []
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or _running(int(match.group(2))):
            continue
        path = parent / name
        with contextlib.suppress(OSError):
            if stat.S_ISREG(os.lstat(path).st_mode) or (not path.is_symlink() and _files_only(path)):
                found.append((match.group(1), path))
    return found


def _files_only(path: Path) -> bool:
    """Whether `path` is a directory holding regular files alone, as an export's directory does."""
    if not path.is_dir():
        return False
    with os.scandir(path) as entries:
        return all(entry.is_file(follow_symlinks=False) for entry in entries)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return True  # this process's own: a write in flight
    try:
        os.kill(pid, 0)
    except PermissionError:
        return True  # another user's process
    except (OSError, OverflowError):  # no such process (ProcessLookupError), or no such pid at all
        return False
    return True


def recover(option: str, out: str) -> None:
    """Put right what a killed export left beside `out` (see the module's docstring): an earlier export it
    had moved aside back in place when `out` is missing, its other temporaries removed; one line on
    stderr when there was any."""
    target = Path(out)
    found = _debris(target)
    if not found:
        return
    said = []
    aside = [path for kind, path in found if kind == "old"]
    if aside and not os.path.lexists(target):
        newest = max(aside, key=lambda path: os.lstat(path).st_ctime_ns)  # the rename is the newest change
        try:
            os.rename(newest, target)
        except OSError:
            pass  # left as it was: the checks below say what is in the way
        else:
            said.append(f"put back the earlier export a killed export had moved aside ({newest.name})")
            found = [(kind, path) for kind, path in found if path != newest]
    removed = []
    for _, path in found:
        _remove(path)
        if not os.path.lexists(path):
            removed.append(path.name)
    if removed:
        said.append(f"removed what a killed export left beside it: {', '.join(removed)}")
    if said:
        print(f"rewind: {option} {out}: {'; '.join(said)}", file=sys.stderr)


@dataclasses.dataclass(frozen=True)
class Output:
    """What a command writes for the user at `target`: a file (`data` its bytes) or a directory (`data`
    {file name: bytes}); `option` names it in messages."""

    option: str
    target: Path
    data: bytes | dict[str, bytes]


def write_outputs(outputs: Sequence[Output]) -> None:
    """Every output whole, or none changed. Each is written into a temporary sibling of its target (every
    file synced); once all are there, each target that exists (what the checks let through: an empty
    directory, or what --overwrite replaces) is moved aside and the temporary renamed into its place, and
    only then is what was moved aside deleted. A failure removes the temporaries and puts back what was
    moved aside: CommandError (exit 1) naming the output, for what the filesystem refused (OSError)."""
    from rewind.stores import fsio

    temporaries: dict[Path, Path] = {}  # target -> its temporary, written or being written
    placed: list[tuple[Path, Path | None]] = []  # (target, what it replaced, moved aside)
    current = outputs[0] if outputs else None
    try:
        for current in outputs:
            temporaries[current.target] = _sibling(current.target, "tmp")
            _write_temporary(current, temporaries[current.target], fsio)
        for current in outputs:
            aside = _sibling(current.target, "old") if os.path.lexists(current.target) else None
            if aside is not None:
                os.rename(current.target, aside)
            placed.append((current.target, aside))
            os.rename(temporaries[current.target], current.target)
            del temporaries[current.target]
            fsio.fsync_dir(str(current.target.absolute().parent))
    except BaseException as exc:
        _undo(temporaries.values(), placed)
        if isinstance(exc, OSError) and current is not None:
            why = exc.strerror or exc
            where = f"{current.option} {current.target}"
            raise CommandError(f"{where}: cannot write it ({why}); nothing was written", 1) from None
        raise
    for _, aside in placed:
        if aside is not None:
            _remove(aside)


def _sibling(target: Path, what: str) -> Path:
    return target.absolute().parent / f".{target.name}.{what}-{os.getpid()}-{secrets.token_hex(4)}"


def _write_temporary(output: Output, tmp: Path, fsio) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)  # a missing parent directory is created
    if isinstance(output.data, bytes):
        files = {tmp: output.data}
    else:
        files = {tmp / name: data for name, data in output.data.items()}
        tmp.mkdir()
    for path, data in files.items():
        _write_new(path, data)
    if not isinstance(output.data, bytes):
        fsio.fsync_dir(str(tmp))


def _undo(temporaries: Iterable[Path], placed: list[tuple[Path, Path | None]]) -> None:
    """Best effort, after a failure: nothing of ours left, and what was there back in its place."""
    for tmp in temporaries:
        _remove(tmp)
    for target, aside in reversed(placed):
        _remove(target)
        if aside is not None:
            with contextlib.suppress(OSError):
                os.rename(aside, target)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def write_file_atomically(target: Path, data: bytes) -> None:
    """Write `data` to a temporary file beside `target`, fsync it, rename it over `target` and fsync
    the directory: the file is there whole or not at all, and a full disk or a read-only directory is
    an OSError here, not a truncated file reported as written. A missing parent directory is created."""
    from rewind.stores import fsio

    directory = target.parent
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{target.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        _write_new(tmp, data)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsio.fsync_dir(str(directory))


def _write_new(path: Path, data: bytes) -> None:
    """Create `path` (it must not exist), write `data` whole and fsync it."""
    from rewind.stores import fsio

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fsio.write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
