"""What the exactness harness checks (tests/engine/exactness.py runs the runs): where each resume had to
restart, read from the log its process found, and how the killed run compares with the straight one.

The expectations are computed here from the raw records, never with the engine's own history code
(`effective`, `restore_point`): one of the deliberate breakages is in that code.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import torch

from rewind.states.events import (
    CheckpointCommitted,
    CheckpointDeleted,
    ConfigChanged,
    Event,
    RunFinished,
    RunResumed,
    RunStarted,
    StepCommitted,
)
from rewind.stores.checkpoints import TMP_PREFIX, CheckpointStore
from rewind.stores.codec import LogError
from rewind.stores.runs import LogNotFoundError, read_seq_events
from tests.engine.breakage_launcher import Launcher

SeqEvent = tuple[int, Event]


@dataclass(frozen=True)
class Straight:
    run_dir: Path
    seconds_per_step: float  # the straight run's wall time per step, process start included


@dataclass
class Killed:
    """What happened to a run trained through kills (exactness.train_killed)."""

    run_dir: Path
    num_kills: int = 0
    kills: list[str] = field(default_factory=list)  # what each kill hit, for failure messages
    # The committed log each process found (after a kill), and the records that process appended.
    resumes: list[tuple[list[SeqEvent], list[SeqEvent]]] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)


# --- reading a log the way a resume must -------------------------------------------------------------


def committed(run_dir: Path) -> list[SeqEvent]:
    """The committed records, [] while there is no log (polling: a read racing a commit is retried)."""
    for _ in range(3):
        try:
            return read_seq_events(run_dir)
        except LogNotFoundError:
            return []
        except (LogError, OSError):
            time.sleep(0.005)
    return read_seq_events(run_dir)


def superseded_seqs(records: list[SeqEvent]) -> set[int]:
    """Seqs the log's RunResumed records supersede."""
    return {
        seq
        for _, e in records
        if isinstance(e, RunResumed)
        for seq in range(e.superseded_first_seq, e.superseded_last_seq + 1)
    }


@dataclass(frozen=True)
class Expected:
    """Where a resume of a log must restart: its last effective checkpoint ("" and 0: the start), and
    the first seq it supersedes (everything after the last restore anchor and its followers)."""

    checkpoint: str
    step: int
    first_seq: int
    last_seq: int


def expected_resume(records: list[SeqEvent]) -> Expected:
    gone = superseded_seqs(records)
    live = [(seq, e) for seq, e in records if seq not in gone]
    checkpoint, step, first = "", 0, 0
    for seq, event in live:
        if isinstance(event, CheckpointCommitted):
            checkpoint, step = event.checkpoint, event.step
        if isinstance(event, RunStarted | CheckpointCommitted | RunResumed):
            first = seq + 1
        elif isinstance(event, CheckpointDeleted | ConfigChanged) and first == seq:
            first = seq + 1  # records that belong to the anchor before them
    return Expected(checkpoint, step, first, records[-1][0])


def committed_past_checkpoint(records: list[SeqEvent]) -> bool:
    """Does the log hold a committed step after its restore anchor (what a resume must supersede)?"""
    if not records:
        return False
    expected = expected_resume(records)
    return any(isinstance(e, StepCommitted) for seq, e in records if seq >= expected.first_seq)


def checkpoint_in_flight(run_dir: Path) -> bool:
    folder = run_dir / "checkpoints"
    try:
        return any(p.name.startswith(TMP_PREFIX) for p in folder.iterdir())
    except OSError:
        return False


# --- the comparison ---------------------------------------------------------------------------------


def final_weights(run_dir: Path) -> dict:
    """The model tensors of the run's final checkpoint, read straight from the store."""
    records = read_seq_events(run_dir)
    final = [e for _, e in records if isinstance(e, CheckpointCommitted) and e.reason == "final"][-1]
    return CheckpointStore(str(run_dir)).load(final.checkpoint, final.files, groups=["model"])["model"]


def weights_differ(want: dict, got: dict) -> str:
    if want.keys() != got.keys():
        return f"tensor names differ: {sorted(want.keys() ^ got.keys())[:4]}"
    for name in want:
        a, b = want[name].contiguous(), got[name].contiguous()
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{name}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        # Raw bytes, not float equality: -0.0 vs 0.0 or a NaN payload would show.
        if not a.reshape(-1).view(torch.uint8).equal(b.reshape(-1).view(torch.uint8)):
            return f"{name} differs"
    return ""


def effective_steps(server: Launcher, run_dir: Path, breakage: str = "", marks: Path | None = None) -> list[bytes]:
    """The effective StepCommitted records as msgpack bytes (floats bit for bit), computed by the
    engine's `effective()` in a child (where a breakage may have patched it)."""
    out = server.scratch / f"effective-{os.urandom(4).hex()}.msgpack"
    code, output = server.run("effective-steps", [str(run_dir), str(out)], breakage, marks)
    assert code == 0, output
    return msgspec.msgpack.decode(out.read_bytes(), type=list[bytes])


def resume_problem(before: list[SeqEvent], appended: list[SeqEvent]) -> str:
    """Did the process that found `before` restart where it had to? "" if so."""
    want = expected_resume(before)
    if not appended:
        return ""  # killed before its first commit: the next process resumes the same log
    seq, first = appended[0]
    if not isinstance(first, RunResumed):
        return f"record {seq} after a kill is {type(first).__name__}, not RunResumed"
    got = (first.checkpoint, first.step, first.superseded_first_seq, first.superseded_last_seq)
    if got != (want.checkpoint, want.step, want.first_seq, want.last_seq):
        return (
            f"record {seq}: resumed from {first.checkpoint or 'the start'} (step {first.step}) superseding "
            f"{first.superseded_first_seq}..{first.superseded_last_seq}; the last checkpoint before the kill was "
            f"{want.checkpoint or 'none'} (step {want.step}), superseding {want.first_seq}..{want.last_seq}"
        )
    return ""


def recompute_problem(records: list[SeqEvent]) -> str:
    """Every superseded StepCommitted must have been recomputed to the same bytes after its resume."""
    gone = superseded_seqs(records)
    kept = {e.step: msgspec.msgpack.encode(e) for seq, e in records if seq not in gone and isinstance(e, StepCommitted)}
    for seq, event in records:
        if seq in gone and isinstance(event, StepCommitted) and kept.get(event.step) != msgspec.msgpack.encode(event):
            return f"superseded step {event.step} (record {seq}) came out differently after the resume"
    return ""


def check(server: Launcher, straight: Straight, killed: Killed, breakage: str = "", marks: Path | None = None) -> dict[str, str]:
    """Every way the killed run differs from the straight one, by check name ({}: none). The resumes
    are checked however the run ended; the results only once it finished."""
    problems = dict(killed.problems)
    resumes = [p for before, appended in killed.resumes if (p := resume_problem(before, appended))]
    if resumes:
        problems["restore-point"] = resumes[0]
    records = read_seq_events(killed.run_dir)
    if problem := recompute_problem(records):
        problems["recomputed"] = problem
    gone = superseded_seqs(records)
    if not any(seq in gone and isinstance(e, StepCommitted) for seq, e in records):
        problems["superseded"] = "no resume superseded a committed step"
    if not isinstance(records[-1][1], RunFinished):
        problems["finished"] = f"the log ends with {type(records[-1][1]).__name__}"
        return problems
    if difference := weights_differ(final_weights(straight.run_dir), final_weights(killed.run_dir)):
        problems["weights"] = difference
    want = effective_steps(server, straight.run_dir, breakage, marks)
    got = effective_steps(server, killed.run_dir, breakage, marks)
    if want != got:
        mismatch = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
        problems["effective-steps"] = f"{len(got)} effective steps against {len(want)}; first difference at #{mismatch}"
    return problems


@contextmanager
def trained_beside(command: list[str], **popen) -> Iterator[subprocess.Popen]:
    """A straight run trained in a background process while the block kills another (one thread each:
    two cores do both at once). It must have ended with exit 0 when the block ends; on a failure in the
    block it is killed, never left behind."""
    done = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)
    try:
        yield done
        assert done.wait(timeout=300) == 0, done.stderr.read()
    finally:
        if done.poll() is None:
            done.kill()
            done.wait()
        done.stderr.close()
