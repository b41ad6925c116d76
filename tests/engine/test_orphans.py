"""Nothing is destroyed on doubt, and a start or resume that fails leaves the directory as it was.

A killed run's log cut at a random offset inside its committed records must not be "resumed" into a
run that deleted the intact checkpoints the shortened log no longer names: either the cut is only what
a crash could have left unacknowledged (then the run resumes, and bit for bit), or the checkpoints on
disk prove acknowledged records were lost (then train refuses with one line and changes nothing, and
verify says which checkpoint proves it and how far the log should reach). Checkpoints the log does not
name are moved under checkpoints/orphaned/, never deleted.
"""

from __future__ import annotations

import random
import shutil
import warnings
from pathlib import Path

import pytest

from rewind.engine.run import parts as parts_module
from rewind.states.events import CheckpointDeleted
from rewind.stores.checkpoints import ORPHANED_DIR, CheckpointStore
from rewind.stores.runs import read_records
from tests.engine.test_loop import effective_steps, one_torch_thread, run_cli, straight_run, train_args
from tests.tools.rundir_forgery import tree_state

LOG = Path("events") / "00000000.log"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """The shrunken tiny run stopped after step 14: checkpoints of steps 11, 12 and 14 on disk."""
    run = tmp_path_factory.mktemp("orphans") / "stopped"
    code, _, err = run_cli(*train_args(run, "--max-steps", "14"))
    assert code == 0, err
    return run


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    return straight_run(tmp_path_factory)


def checkpoint_dirs(run: Path) -> set[str]:
    """Every complete checkpoint directory on disk, wherever it is (set aside ones included)."""
    return {p.parent.name.split(".")[0] for p in (run / "checkpoints").rglob("manifest.json")}


def cut_copy(stopped: Path, tmp_path: Path, offset: int) -> Path:
    run = tmp_path / "cut"
    shutil.copytree(stopped, run)
    with open(run / LOG, "r+b") as handle:
        handle.truncate(offset)
    return run


def record_offsets(run: Path) -> list[tuple[int, str, int]]:
    """(offset, event type, step) of every record of the single segment."""
    return [(r.offset, type(r.event).__name__, r.event.step) for r in read_records(run)]


@pytest.mark.parametrize("window", ["before the checkpoint of 11", "between the checkpoints of 12 and 14"])
def test_a_cut_that_loses_acknowledged_records_is_refused_and_changes_nothing(stopped, tmp_path, window):
    offsets = record_offsets(stopped)
    at = {step: o for o, kind, step in offsets if kind == "CheckpointCommitted"}
    # Before the CheckpointCommitted of step 11: the checkpoints of 11, 12 and 14 then sit on disk
    # unnamed, each written after records the cut removed. Between those of 12 and 14: the records
    # after 12's (fade, steps 13 and 14) were committed before 14's checkpoint was written.
    low, high = (offsets[1][0], at[11]) if window.startswith("before") else (at[12] + 1, at[14])
    offset = random.Random(20240611).randrange(low, high)
    run = cut_copy(stopped, tmp_path, offset)
    on_disk, before = checkpoint_dirs(run), tree_state(run)

    code, _, err = run_cli(*train_args(run, "--max-steps", "16"))
    assert code == 1
    assert len(err.strip().splitlines()) == 1 and "lost acknowledged records" in err and "nothing was changed" in err
    assert tree_state(run) == before  # nothing appended, nothing cut, nothing moved or deleted
    assert checkpoint_dirs(run) == on_disk

    code, out, _ = run_cli("verify", run)
    assert code == 1
    lost = [line for line in out.splitlines() if "lost acknowledged records" in line]
    assert lost, out
    # Which checkpoint proves it, and how far the log should reach.
    proof = next(name for name in on_disk if name.startswith("00000014-"))
    assert any(proof in line and "held records through seq" in line and "are missing" in line for line in lost), out
    assert tree_state(run) == before


def test_a_cut_of_what_a_crash_leaves_unacknowledged_resumes_bit_for_bit_keeping_the_checkpoints(
    stopped, straight, tmp_path
):
    offsets = record_offsets(stopped)
    # Inside (or at the start of) the CheckpointCommitted of step 14: what a kill after the checkpoint of
    # 14 was renamed into place, before its record was durable, leaves. (Every record before it was
    # committed before the checkpoint was written: a cut before them is the refused case above.)
    position = next(i for i, (_, kind, step) in enumerate(offsets) if kind == "CheckpointCommitted" and step == 14)
    offset = random.Random(7).randrange(offsets[position][0], offsets[position + 1][0])
    run = cut_copy(stopped, tmp_path, offset)
    on_disk, num_kept = checkpoint_dirs(run), len(read_records(run))
    fourteen = next(name for name in on_disk if name.startswith("00000014-"))

    with warnings.catch_warnings():  # the torn tail's cut is news too
        warnings.simplefilter("always")
        code, _, err = run_cli(*train_args(run))
    assert code == 0, err
    # `rewind` shows each warning as one line on stderr.
    set_aside = [line for line in err.splitlines() if f"moved to checkpoints/{ORPHANED_DIR}/" in line]
    assert len(set_aside) == 1 and fourteen in set_aside[0] and set_aside[0].startswith("rewind: warning:"), err
    assert (run / "checkpoints" / ORPHANED_DIR / fourteen / "model.safetensors").is_file()  # kept
    # Every checkpoint that was on disk still is, unless the resumed run's own retention deleted it.
    retired = {e.checkpoint for r in read_records(run)[num_kept:] if isinstance(e := r.event, CheckpointDeleted)}
    assert on_disk - retired <= checkpoint_dirs(run)
    assert effective_steps(run) == effective_steps(straight)
    code, out, _ = run_cli("verify", run)
    assert code == 0 and f"set aside under checkpoints/{ORPHANED_DIR}/" in out, out


# --- a start or resume that fails writes nothing ------------------------------------------------------


@pytest.fixture
def failing_optimizer(monkeypatch):
    calls: list[str] = []

    def refuse(model, config):
        calls.append("built")
        raise RuntimeError("optimizer construction failed")

    monkeypatch.setattr(parts_module, "build_optimizer", refuse)
    return calls


def test_a_start_whose_optimizer_cannot_be_built_creates_nothing(tmp_path, failing_optimizer):
    run = tmp_path / "new-run"
    with pytest.raises(RuntimeError, match="optimizer construction failed"):
        run_cli(*train_args(run))
    assert failing_optimizer and not run.exists()
    run.mkdir()  # an existing, empty directory stays empty
    with pytest.raises(RuntimeError):
        run_cli(*train_args(run))
    assert list(run.iterdir()) == []


def test_a_resume_whose_optimizer_cannot_be_built_leaves_every_byte(stopped, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    with open(run / LOG, "ab") as handle:
        handle.write(b"\x01torn")  # a torn tail too: the writer would cut it, so it must not open
    before, num_records = tree_state(run), len(read_records(run))

    def refuse(model, config):
        raise RuntimeError("optimizer construction failed")

    monkeypatch.setattr(parts_module, "build_optimizer", refuse)
    for _ in range(3):
        with pytest.raises(RuntimeError, match="optimizer construction failed"):
            run_cli(*train_args(run, "--max-steps", "16"))
    assert tree_state(run) == before
    assert len(read_records(run)) == num_records
    assert CheckpointStore(run).names_on_disk() == sorted(checkpoint_dirs(stopped))
