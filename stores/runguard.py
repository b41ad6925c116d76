"""What a writer checks in a run directory before it writes anything there: a command writes only inside
what it owns.

Every process that writes a run holds its lock (rewind.stores.lock), and taking the lock looks over the
whole run directory first (`check_writable`), so that no write, rename or append ever follows a name
out of the run, whichever directory it is in (checkpoints/orphaned/, snapshots/, tb/, rollouts/, the
ones to come) and whoever writes there. A directory that must not be written is one holding:

- a symbolic link, anywhere in it, that resolves outside the run (`tb -> /elsewhere`, `metrics.jsonl ->
  ~/.bashrc`, a link to /dev/zero): a checkpoint set aside, a snapshot, a TensorBoard file or a metrics
  line would land there. A link that stays inside the run is followed, as reads follow it
  (rewind.stores.confine confines the files a run reads the same way);
- anything that is neither a directory nor a regular file (a FIFO, a device, a socket): no file of a run
  is one, and opening one to read or append blocks or acts;
- a file, a FIFO or a link where rewind keeps a directory (`RUN_DIRECTORIES`: `checkpoints/orphaned` a
  regular file), or a directory where it appends to a file (`RUN_FILES`: `metrics.jsonl`).

The writer is refused in one line (`NotWritable`, exit 1) naming the first problem and the way forward,
before it has written, moved or recorded anything; `rewind verify` lists every problem (`write_problems`).
Object stores have no links, FIFOs or devices, and a key is no directory: nothing to look at there.
"""

from __future__ import annotations

import os
import stat

from rewind.states.admission import CACHE_DIR, ROLLOUTS_DIR
from rewind.stores.confine import NotConfined
from rewind.stores.fsio import Location

# The directories a run writes, and what rewind keeps in each. Named here, not imported: the lock, which
# every writer takes, would import every store (and the stores cannot import the engine's DATA_DIR);
# tests/stores/test_confined_writes.py holds the names to the stores' and the engine's own.
RUN_DIRECTORIES = {
    "events": "where rewind keeps the run's event log",
    "checkpoints": "where rewind keeps the run's checkpoints",
    "checkpoints/orphaned": "where rewind keeps checkpoints no record names",
    "snapshots": "where rewind keeps snapshots of the folded state",
    ROLLOUTS_DIR: "where rewind keeps a grpo stage's rollout batches",
    "tb": "where rewind writes TensorBoard files",
    "plots": "where rewind draws the run's plots",
    "data": "where rewind keeps the run's tokenizer and tokenised documents",
    CACHE_DIR: "where rewind keeps activation caches",
    "trunks": "where rewind keeps frozen stacks' weights",
}
# The files a run appends to, the same way: a directory there is no file to append to.
RUN_FILES = {"metrics.jsonl": "where rewind writes the metrics projection"}

_SPECIAL_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotWritable(NotConfined):
    """A run directory a writer must not write: a name in it leads out of it, or is not what it must be."""


def write_problems(run: Location) -> list[str]:
    """One line per entry of the local run directory `run` that would lead a writer out of the run or
    onto something that is not a file ([] when none does, or on an object store). Each line names the
    entry by the run's path and says what to do about it."""
    if not run.is_local or not os.path.isdir(run.path):
        return []
    root = os.path.realpath(run.path)
    problems: list[str] = []
    pending = [""]  # directories to look into, relative to the run, "" for the run itself
    while pending:
        relative = pending.pop()
        try:
            with os.scandir(os.path.join(run.path, relative)) as listing:
                entries = list(listing)
        except OSError:  # unreadable or gone meanwhile: a writer meets that error itself, in its own words
            continue
        for entry in entries:
            name = f"{relative}/{entry.name}" if relative else entry.name
            if problem := _problem(root, run.url, name, entry):
                problems.append(problem)
            elif entry.is_dir(follow_symlinks=False):
                pending.append(name)
    return sorted(problems)  # in the order of their paths: the same list every time


def check_writable(run: Location) -> None:
    """NotWritable naming the first of `write_problems` (and how many more there are); None when none."""
    problems = write_problems(run)
    if not problems:
        return
    more = ""
    if len(problems) > 1:
        more = f" (and {len(problems) - 1} more: `rewind verify {run.url}` lists them)"
    raise NotWritable(f"{problems[0]}{more}; nothing was written")


def _problem(root: str, display: str, name: str, entry: os.DirEntry) -> str:
    where = f"{display}/{name}"
    kept = RUN_DIRECTORIES.get(name)
    if entry.is_symlink():
        target = os.path.realpath(entry.path)
        if os.path.commonpath([root, target]) != root:
            return (
                f"{where} leads outside the run directory (to {target}): a symbolic link, and rewind writes "
                "only inside the run; replace the link with a copy of what it points to, or remove it"
            )
        if kept is not None and not os.path.isdir(target):
            return f"{where} is a symbolic link to no directory ({target}), {kept}: move it away"
        return ""
    try:
        mode = entry.stat(follow_symlinks=False).st_mode
    except OSError:  # gone since the listing
        return ""
    if stat.S_ISDIR(mode) and name in RUN_FILES:
        return f"{where} is a directory, {RUN_FILES[name]}: move it away"
    if stat.S_ISDIR(mode) or (stat.S_ISREG(mode) and kept is None):
        return ""
    kind = next((what for test, what in _SPECIAL_KINDS if test(mode)), "neither a file nor a directory")
    if kept is not None:
        return f"{where} is {'a file' if stat.S_ISREG(mode) else kind}, {kept}: move it away"
    return f"{where} is {kind}, not a regular file: no file of a run is one (opening it can block); remove it"
