"""Checkpoints hold the model and the optimizer; the KL reference is the model of the checkpoint the
refresh named (by pointer), which retention keeps and a resume loads. A checkpoint's name is its state's:
a run stopped and resumed names its checkpoints as the run that never stopped."""

from __future__ import annotations

import pytest
import torch

from rewind.engine.data.rundata import home_of
from rewind.engine.model import tensors
from rewind.engine.run.checkpointing import reference_digest
from rewind.engine.run.parts import build_parts, open_datasets
from rewind.states.events import CheckpointCommitted, ReferenceRefreshed
from rewind.states.fold import fold
from rewind.states.history import config_in_force
from rewind.states.state import Reference, State
from rewind.stores.checkpoints import MANIFEST, CheckpointError, CheckpointStore
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import one_torch_thread, run_cli, straight_run, train_args


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return straight_run(tmp_path_factory)


def test_checkpoints_hold_no_copy_of_the_reference_and_resume_follows_the_pointer(straight):
    records = read_seq_events(straight)
    events = [e for _, e in records]
    committed = [e for e in events if isinstance(e, CheckpointCommitted)]
    assert committed and all(set(e.files) == {"model.safetensors", "optimizer.safetensors"} for e in committed)
    (refresh,) = [e for e in events if isinstance(e, ReferenceRefreshed)]
    state = fold(events)
    assert state.reference.checkpoint == refresh.checkpoint
    assert refresh.checkpoint in {c.checkpoint for c in state.live_checkpoints}  # kept by retention
    store = CheckpointStore(straight)
    held = next(c for c in state.live_checkpoints if c.checkpoint == refresh.checkpoint)
    # The reference by its content: the full sha256 of its checkpoint's manifest, not its short name.
    last = store.load_manifest(state.last_checkpoint.checkpoint)
    assert last.meta["reference_sha256"] == held.manifest_sha256
    with one_torch_thread():
        config = config_in_force(records)
        parts = build_parts(config, str(straight), state, open_datasets(config, home_of(str(straight), state)))
    expected = store.load(refresh.checkpoint, groups=("model",))["model"]
    loaded = tensors.model_tensors(parts.reference)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert not any(p.requires_grad for p in parts.reference.parameters())


def test_a_stopped_and_resumed_run_names_its_checkpoints_as_the_straight_run(straight, tmp_path):
    """Stopped at step 6 (the clean stop Ctrl-C makes too), resumed: the reference checkpoint and every
    later one are written by the resumed process, at other log positions than the straight run's, yet
    they are the same state, so they get the same names and manifests; only WRITTEN dates them."""
    run = tmp_path / "run"
    code, _, err = run_cli(*train_args(run, "--max-steps", "6"))
    assert code == 0, err
    code, _, err = run_cli(*train_args(run))
    assert code == 0, err
    want, got = fold(e for _, e in read_seq_events(straight)), fold(e for _, e in read_seq_events(run))
    assert got.resumes and got.reference is not None and got.reference.step > 6
    named = [[(c.checkpoint, c.manifest_sha256) for c in s.live_checkpoints] for s in (want, got)]
    assert named[0] == named[1]
    assert got.reference == want.reference
    name = got.last_checkpoint.checkpoint
    manifests = [(r / "checkpoints" / name / MANIFEST).read_bytes() for r in (straight, run)]
    assert manifests[0] == manifests[1]
    store, straight_store = CheckpointStore(run), CheckpointStore(straight)
    manifest = store.load_manifest(name)
    assert store.log_seq(name, manifest) > straight_store.log_seq(name, manifest)  # the resume's records
    assert "log_seq" not in manifest.meta


def test_the_reference_digest_is_its_live_checkpoints_manifest_hash():
    ref = CheckpointCommitted(
        checkpoint="00000004-0a0b0c0d", step=4, tokens=64, reason="reference", manifest_sha256="ab" * 32
    )
    other = CheckpointCommitted(
        checkpoint="00000008-01020304", step=8, tokens=128, reason="interval", manifest_sha256="cd" * 32
    )
    reference = Reference(stage=1, step=4, checkpoint=ref.checkpoint)
    state = State(live_checkpoints=[ref, other], reference=reference)
    assert reference_digest(state) == "ab" * 32
    assert reference_digest(State(live_checkpoints=[ref, other])) == ""  # no reference in force
    with pytest.raises(CheckpointError, match="00000004-0a0b0c0d is not live"):
        reference_digest(State(live_checkpoints=[other], reference=reference))
