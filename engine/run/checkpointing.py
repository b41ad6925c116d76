"""Checkpoints of the live objects: which tensors a checkpoint holds, and writing them (reading one back:
rewind.engine.model.checkpoint_model, and rewind.engine.run.parts for the live objects at a checkpoint).

A checkpoint holds the model and the optimizer (AdamW moments included, keyed by parameter name). The KL
reference is not copied into every checkpoint: it *is* the model of the checkpoint a ReferenceRefreshed
named, which retention never deletes while it is the reference, so loading follows that pointer. (Runs
written by rewind 0.1 carry a `reference` group as well; it is checked by replay and otherwise unused.)

A run started with "content_named_checkpoints" writes manifest format 2: it records the training state
(the tensors, the optimizer's settings, the control state, the frozen stacks' and the KL reference's
content digests) and nothing about when it was written, so its name is the same whenever the same state
is checkpointed, straight or after any number of resumes. Older runs keep writing format 1.

Writing is durable before the caller may announce it: the store writes under a temporary name, syncs,
renames; only then does the engine append the CheckpointCommitted this module returns, and the journal
commits that record on the spot (rewind.engine.run.journal). The record also carries the digest of the
control state it follows (rewind.stores.snapshots.state_digest): what lets a resume start from the
snapshot of that state.
"""

from __future__ import annotations

from rewind.engine.model import layout as layouts
from rewind.engine.model.checkpoint_model import Groups
from rewind.engine.model.ranks import is_writer, shared_event
from rewind.engine.model.tensors import model_tensors, optimizer_tensors
from rewind.engine.step.live import Parts
from rewind.states.events import CheckpointCommitted
from rewind.states.state import CheckpointReason, State, control_summary
from rewind.stores.checkpoints import (
    FORMAT_VERSION,
    FORMAT_WITH_LOG_SEQ,
    CheckpointError,
    group_file,
)
from rewind.stores.snapshots import state_digest
from rewind.stores.trunks import TrunkStore, serialize


def model_groups(parts: Parts) -> Groups:
    """The model's tensors by role, under unwrapped names: `model` (base weights that are not a frozen
    stack's), `adapters` (LoRA, when there are any). A frozen or quantised stack's base weights are in
    parts.trunk_sources, stored once (`trunk_files`)."""
    base, adapters = layouts.base_and_adapters(parts.model, set(parts.trunk_sources))
    return {"model": base, "adapters": adapters} if adapters else {"model": base}


def checkpoint_groups(parts: Parts) -> tuple[Groups, dict]:
    """The tensors a checkpoint holds, per group, and the optimizer's layout metadata."""
    moments, optimizer_meta = optimizer_tensors(parts.optimizer, parts.param_names)
    return {**model_groups(parts), "optimizer": moments}, optimizer_meta


def trunk_files(parts: Parts) -> dict[str, str]:
    """{stack id: sha256} of every frozen stack's weights, each written to RUN/trunks/ if it is not
    there yet (a fork's first checkpoint writes what its parent's run directory held)."""
    trunks = TrunkStore(parts.run_dir)
    for stack, tensors in sorted(parts.trunk_sources.items()):
        if not trunks.exists(parts.trunk_hashes[stack]):
            data, digest = serialize(tensors)
            trunks.write(data, digest)
    return {str(stack): parts.trunk_hashes[stack] for stack in sorted(parts.trunk_sources)}


def write_checkpoint(parts: Parts, state: State, reason: CheckpointReason, log_seq: int) -> CheckpointCommitted:
    """Write the live tensors durably; returns the event that announces them (not yet appended).
    `log_seq`: the last record durable in the log as it is written (every record before it is, see
    rewind.engine.run.journal); a log found to end before it lost acknowledged records (stores.orphans)."""
    groups, optimizer_meta = checkpoint_groups(parts)  # whole tensors (gathered from every rank's shards)
    if not is_writer():  # rank 0 writes; the others learn what it wrote from its event
        return shared_event(None)  # type: ignore[return-value]
    meta = {
        "optimizer": optimizer_meta,
        "stack_sizes": parts.model.stack_sizes,
        # The control state the tensors belong to; `rewind verify` checks it against the fold.
        "control": control_summary(state),
    }
    by_content = state.behaviours.content_named_checkpoints
    if by_content:
        meta["reference_sha256"] = reference_digest(state)
    else:
        meta["reference"] = state.reference.checkpoint if state.reference is not None else ""
    if parts.trunk_sources:  # written before the manifest that names them
        meta["trunks"] = trunk_files(parts)
    version = FORMAT_VERSION if by_content else FORMAT_WITH_LOG_SEQ
    written = parts.store.write(state.step, groups, meta, log_seq=log_seq, format_version=version)
    committed = CheckpointCommitted(
        step=state.step,
        tokens=state.tokens,
        checkpoint=written.name,
        manifest_sha256=written.manifest_sha256,
        files=written.files,
        reason=reason,
        state_sha256=state_digest(state, parts.config),  # vouches for the snapshot of `state` (loop.checkpoint)
    )
    return shared_event(committed)  # type: ignore[return-value]


def reference_digest(state: State) -> str:
    """The content digest of the KL reference in force ("" = none): the manifest sha256 its checkpoint's
    CheckpointCommitted recorded (retention keeps that checkpoint live). In a run that writes format 2,
    that hash covers only the state, so the same reference gives the same digest however the run got
    there, and a checkpoint recording it cannot share a name with one taken under another reference."""
    if state.reference is None:
        return ""
    held = next((c for c in state.live_checkpoints if c.checkpoint == state.reference.checkpoint), None)
    if held is None:
        raise CheckpointError(f"the KL reference's checkpoint {state.reference.checkpoint} is not live")
    return held.manifest_sha256


def tensor_hashes(parts: Parts, files: dict[str, str]) -> dict[str, str]:
    """(file name -> sha256) that a checkpoint of the live objects would record, for the groups named in
    `files` (the hashes a CheckpointCommitted recorded): replay checks live tensors against a logged
    checkpoint with it, even after retention deleted the files."""
    groups, _ = checkpoint_groups(parts)
    if parts.reference is not None:
        groups["reference"] = model_tensors(parts.reference)  # rewind 0.1 checkpoints hold it
    wanted = {name.removesuffix(".safetensors") for name in files}
    return dict(group_file(group, tensors) for group, tensors in groups.items() if group in wanted)
