"""Nothing derived is trusted on resume that the log does not vouch for: a state snapshot forged with
its checksum recomputed (another KL reference, another held rollout batch) changes nothing a resume
trains, and the resume says which snapshot disagrees with the log (rewind.stores.folding); a log that
commits a checkpoint twice, which no run writes, is named by verify and refused by a resume."""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from pathlib import Path

import msgspec
import pytest
import torch

from rewind.states.events import ActivationsCached, CheckpointCommitted, ReferenceRefreshed, RolloutsRecorded
from rewind.states.state import State
from rewind.stores import snapshots
from rewind.stores.activations import ActivationCache, CacheError, CacheSpec
from rewind.stores.cachebinding import OLDER_RELEASE, cache_identity, identity_problem
from rewind.stores.checkpoints import CheckpointStore
from rewind.stores.eventlog import EventLog
from rewind.stores.folding import SnapshotsIgnored
from rewind.stores.fsio import filesystem
from rewind.stores.runs import read_seq_events
from rewind.stores.temporaries import TEMPORARIES
from rewind.stores.trunks import TrunkStore, serialize
from tests.engine.test_loop import one_line, run_cli, train_args
from tests.tools.rundir_forgery import rewrite_log, tree_state
from tests.tools.small_posttrain import POSTTRAIN, SMALL

# The small post-training run with a checkpoint every step and windows of two updates on one batch:
# stopped after step 9 (the grpo stage's second step), a resume trains step 9 on the batch held.
GRPO = [
    *SMALL,
    "--set", "logging.checkpoint_interval=1",
    "--set", "logging.report_interval=1",
    "--set", "stages[3].grpo={group_size=4, max_new_tokens=10, kl_beta=0.02, num_iterations=2}",
]  # fmt: skip


def train(run: Path, *args: str) -> None:
    code, _, err = run_cli("train", POSTTRAIN, "--run-dir", run, "--no-progress", *GRPO, *args)
    assert code == 0, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """(the run trained straight through, the same run stopped after step 9)."""
    base = tmp_path_factory.mktemp("grpo")
    straight, stopped = base / "straight", base / "stopped"
    train(straight)
    train(stopped, "--max-steps", "9")
    return straight, stopped


def committed(run: Path) -> list[bytes]:
    """Every checkpoint the run committed, record bytes: names and hashes of every file (not the digest
    of the control state, whose bookkeeping a resume changes: its seqs, its resumes)."""
    return [
        msgspec.msgpack.encode(msgspec.structs.replace(e, state_sha256=""))
        for _, e in read_seq_events(run)
        if isinstance(e, CheckpointCommitted)
    ]


def forge_newest_snapshot(run: Path, **changes) -> int:
    """Change fields of the newest snapshot's state (and of its restore anchor, which a resume restarts
    from), the checksum recomputed as a forger would. Returns its seq."""
    seq = snapshots.list_seqs(str(run))[-1]
    snapshot = snapshots.read(str(run), seq)
    assert snapshot is not None and snapshot.state.anchor is not None
    anchor = msgspec.structs.replace(snapshot.state.anchor, **changes)
    state = msgspec.structs.replace(snapshot.state, anchor=anchor, **changes)
    (run / "snapshots" / f"{seq:012d}.state").write_bytes(snapshots.encode(msgspec.structs.replace(snapshot, state=state)))
    return seq


def resume(run: Path) -> list[str]:
    """Resume; the warnings it said (the command prints rewind's warnings on stderr, one line each)."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", SnapshotsIgnored)
        code, _, err = run_cli("resume", run, "--no-progress")
    assert code == 0, err
    return [line for line in err.splitlines() if "warning" in line]


def test_a_forged_kl_reference_in_a_snapshot_is_not_trained_on(runs, tmp_path):
    straight, stopped = runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    state = snapshots.read(str(run), snapshots.list_seqs(str(run))[-1]).state
    older = [c.checkpoint for c in state.live_checkpoints if c.checkpoint != state.reference.checkpoint]
    seq = forge_newest_snapshot(run, reference=msgspec.structs.replace(state.reference, checkpoint=older[-1]))
    code, out, _ = run_cli("verify", run)
    assert code == 1 and f"PROBLEM snapshot {seq:012d}: differs from the fold" in out
    said = resume(run)
    assert committed(run)[-1] == committed(straight)[-1]  # bit for bit the straight run's weights
    assert len(said) == 1 and f"snapshot {seq:012d}: differs from the fold of the log" in said[0], said


def another_windows_batch(run: Path, straight: Path) -> tuple[RolloutsRecorded, RolloutsRecorded]:
    """(the batch the newest snapshot holds, another window's batch of the same run at its step, its file
    copied in): what a consistent forgery of the held batch puts in a snapshot."""
    held = snapshots.read(str(run), snapshots.list_seqs(str(run))[-1]).state.rollouts
    other = next(e for _, e in read_seq_events(straight) if isinstance(e, RolloutsRecorded) and e.sha256 != held.sha256)
    shutil.copy(straight / other.path, run / other.path)
    return held, msgspec.structs.replace(other, step=held.step)

def test_a_forged_held_rollout_batch_in_a_snapshot_is_not_trained_on(runs, tmp_path):
    straight, stopped = runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    _, other = another_windows_batch(run, straight)
    seq = forge_newest_snapshot(run, rollouts=other)
    said = resume(run)
    assert committed(run)[-1] == committed(straight)[-1]
    assert len(said) == 1 and f"snapshot {seq:012d}: differs from the fold of the log" in said[0], said


def test_a_checkpoint_committed_twice_is_named_by_verify_and_refused_by_a_resume(tmp_path):
    """No run commits a checkpoint twice; a log that does would make retention delete it twice, fifty
    steps after the resume. verify names the record, a resume refuses it up front: one line, nothing
    written."""
    run = tmp_path / "run"
    assert run_cli(*train_args(run, "--max-steps", "6"))[0] == 0
    records = read_seq_events(run)
    at = max(i for i, (_, e) in enumerate(records) if isinstance(e, CheckpointCommitted))
    events = [e for _, e in records[: at + 1]] + [records[at][1]] + [e for _, e in records[at + 1 :]]
    shutil.rmtree(run / "events")
    with EventLog.open(run, "w") as log:  # the real writer: framing and CRCs are right
        for event in events:
            log.append(event)
        log.commit()
    name = records[at][1].checkpoint
    code, out, _ = run_cli("verify", run)
    assert code == 1
    assert f"PROBLEM record: seq {at + 1} " in out and f"checkpoint {name} committed a second time" in out, out
    before = tree_state(run)
    code, _, err = run_cli(*train_args(run))
    assert code == 1 and one_line(err) == (
        f"rewind: {run}: event log record {at + 1} (CheckpointCommitted at step {records[at][1].step}): checkpoint {name} "
        f"committed a second time (it is live since step {records[at][1].step}); a run commits a checkpoint once: "
        "the log was edited"
    )
    assert tree_state(run) == before


def killed_before_the_rename(monkeypatch, write) -> None:
    """Run `write` as a process killed between writing its temporary and renaming it into place."""

    def die(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(os, "replace", die)
        patched.setattr(os, "rename", die)
        with pytest.raises(KeyboardInterrupt):
            write()


def test_the_temporaries_a_killed_writer_leaves_are_noted_by_verify_and_removed_by_a_resume(tmp_path, monkeypatch):
    """A kill while a rollout file, a frozen stack's file, a snapshot or a checkpoint is written leaves
    its temporary (written by the real writers here); verify notes them and a resume removes exactly
    them, never a file of another name."""
    run = tmp_path / "run"
    assert run_cli(*train_args(run, "--max-steps", "4"))[0] == 0
    data = b"rollout bytes"
    (run / "rollouts").mkdir()
    target = filesystem(str(run)).join("rollouts", f"{hashlib.sha256(data).hexdigest()}.safetensors")
    killed_before_the_rename(monkeypatch, lambda: target.write_atomic(data))
    trunk, digest = serialize({"w": torch.ones(2)})
    killed_before_the_rename(monkeypatch, lambda: TrunkStore(run).write(trunk, digest))
    seq = snapshots.list_seqs(str(run))[-1]
    killed_before_the_rename(monkeypatch, lambda: snapshots.write(str(run), snapshots.read(str(run), seq)))
    killed_before_the_rename(monkeypatch, lambda: CheckpointStore(run).write(9, {"model": {"w": torch.ones(2)}}))
    left = sorted(str(p.relative_to(run)) for part in TEMPORARIES for p in (run / part).iterdir() if ".tmp-" in p.name)
    assert [p.split("/")[0] for p in left] == ["checkpoints", "rollouts", "snapshots", "trunks"], left
    # Names rewind does not write stay whatever they look like.
    others = ["rollouts/.tmp-notes", "rollouts/notes.safetensors.tmp-1-00000000", "snapshots/000000000001.state.tmp-",
              "trunks/.tmp-mine", "checkpoints/.tmp-mine"]  # fmt: skip
    for other in others:
        (run / other).mkdir() if other.startswith("checkpoints") else (run / other).write_text("mine")
    code, out, _ = run_cli("verify", run)
    assert code == 0, out
    said = "temporaries a killed write left (never read; the next resume removes them): "
    noted = [line.removeprefix(said).split(", ") for line in out.splitlines() if line.startswith(said)]
    assert len(noted) == 1 and sorted(noted[0]) == left, out
    assert run_cli(*train_args(run, "--max-steps", "1"))[0] == 0
    assert not any((run / path).exists() for path in left)
    assert all((run / other).exists() for other in others)
    assert "temporaries" not in run_cli("verify", run)[1]


def test_an_activation_cache_is_bound_to_what_the_log_records(tmp_path):
    """Its identity covers the record's fields and the state's account of the trunk's inputs; a cache of
    another identity is not the run's (complete: not read; partial: started over, none of its chunks
    kept), one without an identity is an older release's."""
    state = State(config_hash="c" * 64, tokenizer="t" * 64)
    record = ActivationsCached(step=10, tokens=0, version=1, num_steps=3, num_rows=6, path="cache/x.zarr")
    state = msgspec.structs.replace(state, activation_cache=record)
    ours = cache_identity(state, 1, 10, 3, 6, "cache/x.zarr")
    assert len({ours, cache_identity(msgspec.structs.replace(state, config_hash="d" * 64), 1, 10, 3, 6, "cache/x.zarr"),
                cache_identity(msgspec.structs.replace(state, tokenizer=""), 1, 10, 3, 6, "cache/x.zarr"),
                cache_identity(msgspec.structs.replace(state, parent_run="p"), 1, 10, 3, 6, "cache/x.zarr"),
                cache_identity(state, 1, 11, 3, 6, "cache/x.zarr")}) == 5  # fmt: skip
    url = str(tmp_path / "x.zarr")
    spec = CacheSpec(num_rows=6, seq_len=2, width=3, dtype="float32", rows_per_chunk=2, identity=ours)
    theirs = CacheSpec(**{**spec.__dict__, "identity": "e" * 64})
    cache = ActivationCache.create(url, theirs)
    for chunk in range(3):
        cache.write_chunk(chunk, torch.ones(2, 2, 3))
    cache.mark_complete()
    assert identity_problem(ActivationCache.open(url).spec, state).startswith("not this run's")
    mine = ActivationCache.create(url, spec)  # the writer of this run: nothing of theirs is kept
    assert mine.missing_chunks() == [0, 1, 2]
    for chunk in range(3):
        mine.write_chunk(chunk, torch.zeros(2, 2, 3))
    mine.mark_complete()
    assert identity_problem(ActivationCache.open(url).spec, state) == ""
    older = str(tmp_path / "older.zarr")
    cache = ActivationCache.create(older, CacheSpec(**{**spec.__dict__, "identity": ""}))
    for chunk in range(3):
        cache.write_chunk(chunk, torch.zeros(2, 2, 3))
    cache.mark_complete()
    assert identity_problem(ActivationCache.open(older).spec, state) == OLDER_RELEASE
    with pytest.raises(CacheError, match="identity must be a sha256"):
        CacheSpec(**{**spec.__dict__, "identity": "../x"})


def forge_with_digest(run: Path, also=lambda seq, event: event, **changes) -> int:
    """The reviewer's forgery: the newest snapshot's state changed (forge_newest_snapshot) AND the state
    digest of the CheckpointCommitted after it set to the forged state's, the log rewritten by the real
    writer (framing and CRCs right; `also` changes other records). Returns the snapshot's seq."""
    seq = forge_newest_snapshot(run, **changes)
    forged = snapshots.read(str(run), seq)
    digest = snapshots.state_digest(forged.state, forged.config)
    kept = run.parent / "snapshots-kept"
    shutil.copytree(run / "snapshots", kept)  # rewrite_log drops them: caches of the old log

    def vouch(at: int, event):
        assert at != seq + 1 or isinstance(event, CheckpointCommitted)
        return msgspec.structs.replace(event, state_sha256=digest) if at == seq + 1 else also(at, event)

    rewrite_log(run, vouch)
    shutil.rmtree(run / "snapshots", ignore_errors=True)
    shutil.copytree(kept, run / "snapshots")
    assert snapshots.vouched_by(forged, read_seq_events(run)[seq + 1][1])
    return seq


def older_reference(run: Path):
    """The newest snapshot's KL reference made to name another live checkpoint, older than the one in force."""
    state = snapshots.read(str(run), snapshots.list_seqs(str(run))[-1]).state
    older = [c.checkpoint for c in state.live_checkpoints if c.checkpoint < state.reference.checkpoint]
    return msgspec.structs.replace(state.reference, checkpoint=older[-1])


def test_a_snapshot_forged_with_its_digest_is_not_trained_on(runs, tmp_path):
    """A forger who puts the forged snapshot's digest into the record after it (the frame's CRC
    recomputed) gets past vouching; the checkpoint that record commits records the KL reference's
    digest in its manifest, so the resume sees the fold from the snapshot disagree with it, folds the
    log whole and says so in one line. verify names the snapshot and the record, and says what a resume
    does with them."""
    straight, stopped = runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    seq = forge_with_digest(run, reference=older_reference(run))
    code, out, _ = run_cli("verify", run)
    assert code == 1 and f"PROBLEM snapshot {seq:012d}: differs from the fold" in out, out
    assert f"its state digest is not the fold of the log before it; it is that of snapshot {seq:012d}" in out, out
    assert "starts from no snapshot" not in out and f"Deleting {run}/snapshots/" in out, out
    said = resume(run)
    assert committed(run)[-1] == committed(straight)[-1]  # bit for bit the straight run's weights
    assert len(said) == 1 and f"snapshot {seq:012d}: record {seq + 1} vouches for it, but checkpoint " in said[0]
    assert "manifest disagrees with the fold from it on reference (the log was folded whole" in said[0], said


def test_deleting_the_snapshots_folds_the_log_whole(runs, tmp_path):
    """The way forward verify gives for such a forgery: without snapshots a resume folds the log whole
    and trains what the straight run trained, without a word about the forged digest."""
    straight, stopped = runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    forge_with_digest(run, reference=older_reference(run))
    shutil.rmtree(run / "snapshots")
    assert resume(run) == []
    assert committed(run)[-1] == committed(straight)[-1]


def test_a_log_that_disagrees_with_its_checkpoint_is_refused_whole_or_from_a_snapshot(runs, tmp_path):
    """The log forged too (its reference refresh names the older checkpoint the snapshot names): the
    whole fold disagrees with the checkpoint's manifest as the snapshot's does, so the resume is refused
    in one line, nothing recorded; verify names the checkpoint."""
    _, stopped = runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    reference = older_reference(run)
    refreshes = [seq for seq, e in read_seq_events(run) if isinstance(e, ReferenceRefreshed)]

    def refresh_older(seq, event):
        return msgspec.structs.replace(event, checkpoint=reference.checkpoint) if seq == refreshes[-1] else event

    seq = forge_with_digest(run, also=refresh_older, reference=reference)
    name = read_seq_events(run)[seq + 1][1].checkpoint
    code, out, _ = run_cli("verify", run)
    assert code == 1 and f"PROBLEM checkpoint {name}: manifest disagrees with the log on reference" in out, out
    before = tree_state(run)
    code, _, err = run_cli("resume", run, "--no-progress")
    assert code == 1 and one_line(err) == (
        f"rewind: {run}: event log record {seq + 1} (CheckpointCommitted at step 9): checkpoint {name}'s manifest "
        "disagrees with the log on reference, folded whole or from a snapshot: the log or the checkpoint was "
        f"edited; nothing was changed (`rewind verify {run}` names the records and snapshots at fault)"
    )
    assert tree_state(run) == before


def test_a_held_rollout_batch_forged_with_its_digest_is_not_trained_on(runs, tmp_path):
    """No manifest holds the grpo batch a snapshot holds, so a resume looks it up among the records of its
    step: another window's batch (its file copied in), forged into the snapshot with the digest after it,
    is not one the log records there; the log is folded whole, one warning line, the straight run's bits."""
    straight, stopped = runs
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    held, other = another_windows_batch(run, straight)
    seq = forge_with_digest(run, rollouts=other)
    said = resume(run)
    assert committed(run)[-1] == committed(straight)[-1]
    assert len(said) == 1 and f"snapshot {seq:012d}: record {seq + 1} vouches for it, but the rollout batch" in said[0]
    assert f"is not one the log records at step {held.step} (the log was folded whole" in said[0], said
