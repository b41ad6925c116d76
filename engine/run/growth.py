"""What a growth does to the live objects: the model rebuilt for the new layout, the optimizer rebuilt
over what now trains, with the moments of every parameter that trains on carried by name.

The new model is never patched in place: it is built from the new layout exactly as a resume builds
it (`rewind.engine.model.layout`), and the weights go in by their unwrapped names: the old model's base
weights (a frozen stack's from its stored float copy), the new stack's from its initialisation, and the
adapters that already existed. So a run that grew and a run resumed just after the growth hold the
same objects, down to the order of the optimizer's parameters.

What becomes frozen keeps its float weights in `parts.trunk_sources` (checkpoints store them once and
NF4 quantises from them); what is dropped from the optimizer (a stack that stops training) loses its
moments, which is part of the logged transition (the layout says what trains).
"""

from __future__ import annotations

import dataclasses

import torch

from rewind.engine.model import layout as layouts
from rewind.engine.run.checkpointing import model_groups
from rewind.engine.run.parts import Parts, assembled
from rewind.engine.step.step import apply_hyperparameters
from rewind.states.config import Config
from rewind.states.events import StackAppended
from rewind.states.state import ModelLayout


def plain_weights(parts: Parts) -> dict[str, torch.Tensor]:
    """Every base weight of the live model under its unwrapped name, frozen stacks' included."""
    weights = dict(model_groups(parts)["model"])
    for tensors in parts.trunk_sources.values():
        weights.update(tensors)
    return weights


def grow(parts: Parts, before: ModelLayout, after: ModelLayout, event: StackAppended) -> Parts:
    """The live objects after `event`, which grew the model of layout `before` into `after` (the fold's
    layouts on either side of it): see the module docstring."""
    weights = plain_weights(parts)
    order = [(s.stack, s.num_blocks) for s in before.stacks]
    new_stack = layouts.new_stack_weights(
        weights, order, event.stack, event.num_blocks, event.init, event.position, parts.config.run.seed, parts.config
    )
    dtype = torch.bfloat16 if event.precision == "bf16" else torch.float32  # drawn (or copied) as float32
    weights.update({f"stacks.{event.stack}.{name}": tensor.to(dtype) for name, tensor in new_stack.items()})
    return transplant(parts, parts.config, after, weights)


def transplant(parts: Parts, config: Config, layout: ModelLayout | None, weights: dict[str, torch.Tensor]) -> Parts:
    """Parts for `config` whose model is `layout` holding `weights` (unwrapped base weights) and the
    adapters `parts` has (new adapters keep their initialisation), and whose optimizer carries the
    moments of every parameter that trained before and trains now. The reference stays `parts`'."""
    model, sources = layouts.model_from_weights(config, layout, weights, model_groups(parts).get("adapters", {}))

    def moments(optimizer, names) -> None:
        _carry_moments(parts.optimizer, parts.param_names, optimizer, names)
        apply_hyperparameters(optimizer, config)

    kept = {stack: digest for stack, digest in parts.trunk_hashes.items() if stack in sources and _same(parts, sources, stack)}
    new = assembled(
        config,
        parts.run_dir,
        parts.datasets,
        model,
        moments=moments,
        sources=sources,
        hashes=kept,
        schedule=parts.schedule if config is parts.config else None,
        store=parts.store,
    )
    return dataclasses.replace(new, reference=parts.reference)


def _same(parts: Parts, sources: dict[int, dict[str, torch.Tensor]], stack: int) -> bool:
    """Whether a stack's stored weights are unchanged (then its trunk file's hash still holds)."""
    before = parts.trunk_sources.get(stack)
    return before is not None and before.keys() == sources[stack].keys() and all(
        torch.equal(before[name], sources[stack][name]) for name in before
    )


def _carry_moments(old, old_names, new, new_names) -> None:
    """Optimizer state of each parameter of `new` whose name had state in `old` (copied, not shared)."""
    by_name = {old_names[p]: state for p, state in old.state.items() if p in old_names}
    for parameter, name in new_names.items():
        state = by_name.get(name)
        if state is not None and parameter.requires_grad:
            # Moments shaped like their parameter follow its dtype (see transplant); step counts stay.
            new.state[parameter] = {
                k: (v.to(parameter.dtype, copy=True) if v.shape == parameter.shape else v.clone()) if isinstance(v, torch.Tensor) else v
                for k, v in state.items()
            }
