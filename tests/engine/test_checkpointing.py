"""Checkpoints hold the model and the optimizer; the KL reference is the model of the checkpoint the
refresh named (by pointer), which retention keeps and a resume loads."""

from __future__ import annotations

import pytest
import torch

from rewind.engine import snapshot
from rewind.engine.parts import build_parts, open_datasets
from rewind.engine.rundata import place_of
from rewind.states.events import CheckpointCommitted, ReferenceRefreshed
from rewind.states.fold import fold
from rewind.states.history import config_in_force
from rewind.stores.checkpoints import CheckpointStore
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import one_torch_thread, straight_run


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
    assert store.load_manifest(state.last_checkpoint.checkpoint).meta["reference"] == refresh.checkpoint
    with one_torch_thread():
        config = config_in_force(records)
        parts = build_parts(config, str(straight), state, open_datasets(config, place_of(str(straight), state)))
    expected = store.load(refresh.checkpoint, groups=("model",))["model"]
    loaded = snapshot.model_tensors(parts.reference)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    assert not any(p.requires_grad for p in parts.reference.parameters())
