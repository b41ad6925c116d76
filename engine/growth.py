"""What a growth does to the live objects: the model rebuilt for the new layout, the optimizer rebuilt
over what now trains, with the moments of every parameter that trains on carried by name.

The new model is never patched in place: it is built from the new layout exactly as a resume builds
it (`rewind.engine.layout`), and the weights go in by their unwrapped names: the old model's base
weights (a frozen stack's from its stored float copy), the new stack's from its initialisation, and the
adapters that already existed. So a run that grew and a run resumed just after the growth hold the
same objects, down to the order of the optimizer's parameters.

What becomes frozen keeps its float weights in `parts.trunk_sources` (checkpoints store them once and
NF4 quantises from them); what is dropped from the optimizer (a stack that stops training) loses its
moments, which is part of the logged transition (the layout says what trains).
"""

from __future__ import annotations

import torch
from torch import nn

from rewind.engine import layout as layouts
from rewind.engine.checkpointing import model_groups
from rewind.engine.parts import Parts, frozen_copy
from rewind.engine.placement import full_tensor, place
from rewind.engine.step import apply_hyperparameters, build_optimizer
from rewind.states.config import Config
from rewind.states.events import StackAppended
from rewind.states.schedule import Schedule
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
    moments of every parameter that trained before and trains now."""
    model, sources = layouts.model_from_weights(config, layout, weights, model_groups(parts).get("adapters", {}))
    model = place(model, config)
    optimizer = build_optimizer(model, config)
    names = layouts.parameter_names(model)
    _carry_moments(parts.optimizer, parts.param_names, optimizer, names)
    apply_hyperparameters(optimizer, config)
    kept = {stack: digest for stack, digest in parts.trunk_hashes.items() if stack in sources and _same(parts, sources, stack)}
    return Parts(
        config=config,
        run_dir=parts.run_dir,
        schedule=parts.schedule if config is parts.config else Schedule(config),
        model=model,
        optimizer=optimizer,
        datasets=parts.datasets,
        store=parts.store,
        reference=parts.reference,
        param_names=names,
        trunk_sources=sources,
        trunk_hashes=kept,
    )


def reference_for(parts: Parts, config: Config, layout: ModelLayout | None) -> nn.Module:
    """The live reference (of `layout`, the model's when it was refreshed) rebuilt for `config`, from the
    tensors held in memory: its own, and for its NF4 stacks (which hold no float weights) the float
    weights `parts` keeps of them, unchanged since they were quantised (NF4 is for good)."""
    assert parts.reference is not None
    nf4 = {s.stack for s in layouts.layout_of(config, layout).stacks if s.base == "nf4"}
    missing = nf4 - set(parts.trunk_sources)
    if missing:  # cannot happen while stacks are never removed; said plainly if it ever does
        raise RuntimeError(f"the float weights of the reference's NF4 stacks {sorted(missing)} are not held")
    weights, adapters = {}, {}
    for name, tensor in parts.reference.state_dict().items():  # whole (a sharded reference's are gathered)
        if layouts.is_adapter(name):
            adapters[layouts.unwrapped(name)] = full_tensor(tensor)
        elif layouts.stack_of(name) not in nf4:
            weights[layouts.unwrapped(name)] = full_tensor(tensor)
    for stack in nf4:
        weights.update(parts.trunk_sources[stack])
    return frozen_copy(layouts.model_from_weights(config, layout, weights, adapters)[0], config, layout)


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
