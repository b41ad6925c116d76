"""The KL reference: a model as it was when the reference was last refreshed, fixed. Built here and
nowhere else, on its three paths: from the live model at a refresh (`reference_of`), from a checkpoint
when a run is opened (`reference_at`), and for another config when a fork changes it (`rebuilt`).

Parameters that do not train are shared with the model they come from, not copied: they cannot change
while that model lives (a growth builds a new model from copies), so a frozen or NF4 trunk is held once.
A sharded model cannot be copied (FSDP2 forbids it): its reference is built from its whole weights and
sharded in turn. NF4 stacks hold no float weights; a reference made from weights takes theirs from the
float weights they were quantised from (`trunk_sources`), unchanged since (NF4 is for good).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from rewind.engine.model import layout as layouts
from rewind.engine.model.checkpoint_model import load_model
from rewind.engine.model.placement import is_sharded, place
from rewind.states.config import Config
from rewind.states.state import ModelLayout, State, reference_to_restore
from rewind.stores.checkpoints import CheckpointStore

Sources = dict[int, dict[str, torch.Tensor]]


def reference_of(
    model: nn.Module, config: Config, layout: ModelLayout | None, trunk_sources: Sources
) -> nn.Module:
    """The model (of `layout`) as it is now, fixed, placed as the run computes."""
    if is_sharded(model):
        reference = _from_model(model, config, layout, trunk_sources, complete=True)
    else:
        shared = {id(p): p for p in model.parameters() if not p.requires_grad}
        reference = copy.deepcopy(model, memo=shared)
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    reference = place(reference, config)  # (a copy of a placed model: only sharding and compiling are new)
    layouts.eval_mode(reference)
    return reference


def rebuilt(
    reference: nn.Module, config: Config, layout: ModelLayout | None, trunk_sources: Sources
) -> nn.Module:
    """The live reference (of `layout`, the model's when it was refreshed) rebuilt for `config` (its RoPE
    base, say), as a process starting under `config` builds it; new adapters keep their initialisation."""
    model = _from_model(reference, config, layout, trunk_sources, complete=False)
    return reference_of(model, config, layout, trunk_sources)


def reference_at(
    config: Config, store: CheckpointStore, state: State, model: nn.Module, sources: Sources
) -> nn.Module | None:
    """The reference a run has at `state`, whose restore checkpoint's model is `model` (with `sources`):
    that model itself when the reference is that checkpoint, else the checkpoint it points to."""
    ref = reference_to_restore(state)
    if ref is None:
        return None
    assert state.last_checkpoint is not None
    if ref.checkpoint == state.last_checkpoint.checkpoint:
        return reference_of(model, config, state.layout, sources)
    files = next((c.files for c in state.live_checkpoints if c.checkpoint == ref.checkpoint), None)
    loaded = load_model(config, store, ref.checkpoint, files, ref.layout)
    return reference_of(loaded.model, config, ref.layout, loaded.sources)


def _from_model(
    model: nn.Module, config: Config, layout: ModelLayout | None, trunk_sources: Sources, *, complete: bool
) -> nn.Module:
    """A new model of `layout` for `config` with `model`'s weights (whole, gathered from every rank)."""
    nf4 = {s.stack for s in layouts.layout_of(config, layout).stacks if s.base == "nf4"}
    missing = nf4 - set(trunk_sources)
    if missing:  # cannot happen while stacks are never removed; said plainly if it ever does
        raise RuntimeError(f"the float weights of the reference's NF4 stacks {sorted(missing)} are not held")
    weights, adapters = layouts.base_and_adapters(model, nf4)
    for stack in sorted(nf4):
        weights.update(trunk_sources[stack])
    return layouts.model_from_weights(config, layout, weights, adapters, complete=complete)[0]
