"""Checkpoints of the live objects: which tensors a checkpoint holds, writing them, loading them back.

A checkpoint holds the model and the optimizer (AdamW moments included, keyed by parameter name). The KL
reference is not copied into every checkpoint: it *is* the model of the checkpoint a ReferenceRefreshed
named, which retention never deletes while it is the reference, so loading follows that pointer. (Runs
written by rewind 0.1 carry a `reference` group as well; it is checked by replay and otherwise unused.)

Writing is durable before the caller may announce it: the store writes under a temporary name, syncs,
renames; only then does the engine append the CheckpointCommitted this module returns, and the journal
commits that record on the spot (rewind.engine.journal).
"""

from __future__ import annotations

import torch

from rewind.engine import snapshot
from rewind.engine.parts import Parts, build_model, frozen_copy
from rewind.engine.step import apply_hyperparameters
from rewind.states.events import CheckpointCommitted
from rewind.states.state import CheckpointReason, State, control_summary
from rewind.stores.checkpoints import group_file

Groups = dict[str, dict[str, torch.Tensor]]


def checkpoint_groups(parts: Parts) -> tuple[Groups, dict]:
    """The tensors a checkpoint holds, per group, and the optimizer's layout metadata."""
    optimizer_tensors, optimizer_meta = snapshot.optimizer_tensors(parts.optimizer, parts.param_names)
    return {"model": snapshot.model_tensors(parts.model), "optimizer": optimizer_tensors}, optimizer_meta


def write_checkpoint(parts: Parts, state: State, reason: CheckpointReason, log_seq: int) -> CheckpointCommitted:
    """Write the live tensors durably; returns the event that announces them (not yet appended).
    `log_seq`: the last record durable in the log as it is written (every record before it is, see
    rewind.engine.journal); a log found to end before it lost acknowledged records (stores.orphans)."""
    groups, optimizer_meta = checkpoint_groups(parts)
    meta = {
        "optimizer": optimizer_meta,
        "stack_sizes": parts.model.stack_sizes,
        # The control state the tensors belong to; `rewind verify` checks it against the fold.
        "control": control_summary(state),
        "reference": state.reference.checkpoint if state.reference is not None else "",
        "log_seq": log_seq,
    }
    written = parts.store.write(state.step, groups, meta)
    return CheckpointCommitted(
        step=state.step,
        tokens=state.tokens,
        checkpoint=written.name,
        manifest_sha256=written.manifest_sha256,
        files=written.files,
        reason=reason,
    )


def load_checkpoint(parts: Parts, state: State) -> None:
    """Load the state's last checkpoint into the model and optimizer, and its reference (if any) from
    the checkpoint the reference points to. Every file is checked against the hashes the log recorded."""
    ref = state.last_checkpoint
    assert ref is not None
    groups = parts.store.load(ref.checkpoint, ref.files, groups=("model", "optimizer"))
    snapshot.load_model_tensors(parts.model, groups["model"])
    meta = parts.store.load_manifest(ref.checkpoint).meta
    restore_optimizer(parts, groups["optimizer"], meta["optimizer"])
    parts.reference = None
    if state.reference is not None:
        if state.reference.checkpoint == ref.checkpoint:
            weights = groups["model"]
        else:
            files = next((c.files for c in state.live_checkpoints if c.checkpoint == state.reference.checkpoint), None)
            weights = parts.store.load(state.reference.checkpoint, files, groups=("model",))["model"]
        reference = build_model(parts.config)
        snapshot.load_model_tensors(reference, weights)
        parts.reference = frozen_copy(reference)


def restore_optimizer(parts: Parts, tensors: dict[str, torch.Tensor], layout: dict) -> None:
    """The saved moments into the live optimizer, under the settings of the config in force."""
    snapshot.load_optimizer_tensors(parts.optimizer, parts.param_names, tensors, layout)
    apply_hyperparameters(parts.optimizer, parts.config)


def tensor_hashes(parts: Parts, files: dict[str, str]) -> dict[str, str]:
    """(file name -> sha256) that a checkpoint of the live objects would record, for the groups named in
    `files` (the hashes a CheckpointCommitted recorded): replay checks live tensors against a logged
    checkpoint with it, even after retention deleted the files."""
    groups, _ = checkpoint_groups(parts)
    if parts.reference is not None:
        groups["reference"] = snapshot.model_tensors(parts.reference)  # rewind 0.1 checkpoints hold it
    wanted = {name.removesuffix(".safetensors") for name in files}
    return dict(group_file(group, tensors) for group, tensors in groups.items() if group in wanted)
