"""What each transition does to the live objects: written once, here.

The live loop calls `apply_effect` for every event it records, and `rewind replay` for every event it
re-walks, with the state before and after the event, so a transition behaves the same whether it happens for the first time or is re-executed;
resume and fork build their live objects from the folded state instead (`parts.build_parts`), which is
what these effects leave behind. A new transition (a stack joining, adapters attached) gets its effect
here and nowhere else.

Events that change no live object (steps are executed by the loop's step code, which produces them;
bookkeeping such as checkpoints, stops and evaluations) have no effect.
"""

from __future__ import annotations

import dataclasses

from rewind.engine.model import reference
from rewind.engine.run.growth import grow, plain_weights, transplant
from rewind.engine.run.parts import Parts, fresh_parts, open_datasets, starting_weights
from rewind.states.config import Config
from rewind.states.events import (
    ActivationsCached,
    ConfigChanged,
    Event,
    OptimizerReset,
    ReferenceRefreshed,
    RunResumed,
    StackAppended,
)
from rewind.states.growth import current_layout
from rewind.states.state import State


def apply_effect(parts: Parts, before: State, after: State, event: Event) -> Parts:
    """The live objects after `event`, which took the control state from `before` to `after`."""
    match event:
        case ReferenceRefreshed():
            # The reference is the weights as they are now, which is what the checkpoint the event
            # names holds: a resume loads it from there (parts.load_checkpoint).
            fixed = reference.reference_of(parts.model, parts.config, current_layout(after), parts.trunk_sources)
            return dataclasses.replace(parts, reference=fixed)
        case OptimizerReset():
            clear_optimizer_state(parts)
            return parts
        case ConfigChanged(config=config):
            # Before any update, the weights are the seed's: a new seed means new weights.
            fresh = before.step == 0 and before.last_checkpoint is None
            return rebuilt(parts, config, before, carry_tensors=not fresh)
        case RunResumed():
            # The live objects are already at the restore point: a resuming process loaded them from
            # its checkpoint (build_parts), and a replay walking the effective records has just
            # re-executed the steps up to it (the superseded ones are not in its stream).
            return parts
        case StackAppended():
            return grow(parts, current_layout(before), current_layout(after), event)
        case ActivationsCached():
            # The cache was written before its record (the loop's perform); a replay or a resume finds
            # it by the state, and training reads it (rewind.engine.run.trunkcache).
            return parts
    return parts


def clear_optimizer_state(parts: Parts) -> None:
    """Forget every moment and step count, in place, as a freshly built optimizer has none: the next
    update starts them again (AdamW's bias correction from step 1). The groups' settings stay. The same
    object is kept, so nothing that holds it (the loop, a replay) needs to learn of a new one."""
    parts.optimizer.state.clear()


def rebuilt(parts: Parts, config: Config, state: State, *, carry_tensors: bool) -> Parts:
    """Live objects for `config` (dropout, seed, RoPE and the optimizer's settings come from it), holding
    the tensors `parts` holds unless the run is still at its seed's weights. The model keeps its layout
    (growth is in the log, not the config); the reference keeps its weights and is rebuilt for `config`
    (its RoPE base, say), as a process starting under `config` builds it."""
    home = parts.datasets.home  # the run's tokenizer and data directory, whatever the config
    if not carry_tensors:  # still at the weights the run started from (the seed's or pretrained ones)
        return fresh_parts(config, parts.run_dir, open_datasets(config, home), starting_weights(config, state))
    new = transplant(parts, config, state.layout, plain_weights(parts))
    fixed = new.reference
    if parts.reference is not None and state.reference is not None:
        fixed = reference.rebuilt(parts.reference, config, state.reference.layout, parts.trunk_sources)
    # The config's own datasets, as a fresh start would open them.
    return dataclasses.replace(new, datasets=open_datasets(config, home), reference=fixed)
