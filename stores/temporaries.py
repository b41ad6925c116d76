"""What a killed writer leaves in a run: the temporaries rewind itself names, and nothing else.

Every file of a run that rewind writes whole goes first to a temporary beside its final name, then is
renamed into place, so a reader sees all of it or none. A kill in between leaves the temporary. No
reader takes one for a file (each looks for exact names), so it is litter, not damage: a resume, with
its RunResumed on record and the run's lock held (so no writer is in flight), removes them
(CheckpointStore.set_aside_orphans calls `remove`), and `rewind verify` notes them (`stale`).

Only names matching exactly what rewind writes in each directory count; anything else found there is
someone's, and is never touched:

    checkpoints/.tmp-<step:08d>-<16 hex>/                a checkpoint being written (stores.checkpoints)
    checkpoints/.tmp-deleted-<16 hex>/                   a checkpoint being deleted
    rollouts/.<sha256>.safetensors.tmp-<pid>-<8 hex>     a rollout batch (fsio's write_atomic)
    trunks/.<sha256>.safetensors.tmp-<pid>-<8 hex>       a frozen stack's weights (the same)
    snapshots/<seq:012d>.state.tmp-<pid>                 a state snapshot (stores.snapshots)

A directory of these that is a link is not looked into (it leads somewhere the run does not own), and
an entry is removed only if it is what its name says: a real directory for a checkpoint's temporary, a
regular file for the others. Local run directories only: an object store's writes are single puts
(a checkpoint's files go straight under its name, its manifest last), which leave no temporary.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat

from rewind.stores.fsio import filesystem

_ATOMIC = r"\.[0-9a-f]{64}\.safetensors\.tmp-[0-9]+-[0-9a-f]{8}"
# directory -> (the names of its temporaries, whether they are directories)
TEMPORARIES: dict[str, tuple[re.Pattern[str], bool]] = {
    "checkpoints": (re.compile(r"\.tmp-(?:[0-9]{8,}|deleted)-[0-9a-f]{16}", re.ASCII), True),
    "rollouts": (re.compile(_ATOMIC, re.ASCII), False),
    "trunks": (re.compile(_ATOMIC, re.ASCII), False),
    "snapshots": (re.compile(r"[0-9]{12}\.state\.tmp-[0-9]+", re.ASCII), False),
}


def is_temporary(directory: str, name: str) -> bool:
    """Whether `name` in the run's `directory` is one of rewind's temporaries there (by name alone)."""
    pattern, _ = TEMPORARIES[directory]
    return pattern.fullmatch(name) is not None


def stale(run_dir: str, directories: tuple[str, ...] = tuple(TEMPORARIES)) -> list[str]:
    """The temporaries in the run (paths relative to it, "rollouts/.<...>.tmp-<...>"), in `directories`."""
    location = filesystem(run_dir)
    if not location.is_local:
        return []
    found = []
    for directory in directories:
        pattern, is_dir = TEMPORARIES[directory]
        where = os.path.join(location.path, directory)
        with contextlib.suppress(OSError):
            if not stat.S_ISDIR(os.lstat(where).st_mode):
                continue  # absent, or a link out of the run: not looked into
            for name in sorted(os.listdir(where)):
                if not pattern.fullmatch(name):
                    continue
                mode = os.lstat(os.path.join(where, name)).st_mode
                if (stat.S_ISDIR(mode) if is_dir else stat.S_ISREG(mode)):
                    found.append(f"{directory}/{name}")
    return found


def remove(run_dir: str, directories: tuple[str, ...] = tuple(TEMPORARIES)) -> list[str]:
    """Remove the run's temporaries in `directories`; returns what went. Only with the run's lock held
    and no write of this process in flight."""
    root = filesystem(run_dir).path
    removed = []
    for relative in stale(run_dir, directories):
        path = os.path.join(root, relative)
        with contextlib.suppress(FileNotFoundError):
            if TEMPORARIES[relative.split("/", 1)[0]][1]:
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(relative)
    return removed
