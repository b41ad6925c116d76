"""Model growth, decided: when each configured growth joins, what it makes of the model, what trains.

A run's model is a `ModelLayout` (rewind.states.state): its stacks from input side to output side,
each with a stable identity, how its base weights are held and its LoRA adapters; plus whether the
embedding and the head train. The initial layout is one stack (id 0) of `architecture.num_layers`
trainable blocks. Each `[[growth]]` entry of the config becomes, at its join step, a `StackAppended`
event carrying its decisions (`growth_event`), and the fold turns that event into the next layout
(`grown_layout`). Both are pure functions here, so a dry-run shows the growth plan, and the engine
builds the live model from the layout the log folds to, never from the config alone.

What trains after a growth, by the `trunk` choice (for every stack already there):
    full    base weights and any adapters train; the embedding trains
    frozen  base weights and adapters fixed; the embedding fixed
    lora    base weights fixed; adapters train (a stack without adapters gets them now, at the rank
            the `lora.pattern` gives its stack id)
    qlora   as lora, and the base weights of the linear layers are quantised to NF4
The new stack always trains (through its own adapters when its precision is nf4). The final norm and
the head train unless an `anchor` (prepend only) keeps them fixed: on the output side the loss flows
through them, and a new stack appended under a fixed head would have to learn the old last stack's
output distribution. A stack once quantised stays quantised (`full` after `qlora` is refused).

Pure: no torch, no I/O; the engine performs what is decided here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from rewind.states.events import StackAppended
from rewind.states.stagekinds import rules_of
from rewind.states.state import ModelLayout, StackLayout, State

if TYPE_CHECKING:
    from rewind.states.config import Config, LoraSection
    from rewind.states.schedule import Schedule

replace = msgspec.structs.replace


def initial_layout(num_layers: int) -> ModelLayout:
    """The model a run starts with: stack 0, every part trainable."""
    return ModelLayout(stacks=[StackLayout(stack=0, num_blocks=num_layers)])


def current_layout(state: State) -> ModelLayout:
    """The layout a run has at `state` (its initial model until the first growth)."""
    return state.layout if state.layout is not None else initial_layout(state.num_layers)


def trunk_rank(lora: LoraSection, stack: int) -> int:
    """The rank of the adapters a trunk stack gets, by its stack id and `lora.pattern`."""
    match lora.pattern:
        case "fixed":
            return lora.trunk_rank
        case "increasing":
            return lora.trunk_rank * 2**stack
        case "decreasing":
            return max(1, lora.trunk_rank >> stack)
        case "linear":
            return lora.trunk_rank * (stack + 1)
        case "table":
            return lora.ranks[stack]
    raise ValueError(f"unknown rank pattern {lora.pattern!r}")


def growth_event(config: Config, index: int, layout: ModelLayout, step: int, tokens: int) -> StackAppended:
    """The StackAppended that performs config.growth[`index`] on a model of `layout`."""
    spec = config.growth[index]
    trunk_ranks = {}
    if spec.trunk in ("lora", "qlora"):
        trunk_ranks = {
            str(s.stack): trunk_rank(config.lora, s.stack) for s in layout.stacks if s.adapter_rank == 0
        }
    return StackAppended(
        step=step,
        tokens=tokens,
        stack=len(layout.stacks),
        num_blocks=spec.num_blocks,
        position=spec.position,
        growth=index,
        init=spec.init,
        trunk=spec.trunk,
        precision=spec.precision,
        rank=config.lora.rank if spec.precision == "nf4" else 0,
        trunk_ranks=trunk_ranks,
        alpha_per_rank=config.lora.alpha_per_rank,
        anchor=spec.anchor,
    )


class GrowthError(ValueError):
    """A StackAppended that cannot apply to the layout (the fold turns it into IllegalTransition)."""


def grown_layout(layout: ModelLayout, event: StackAppended) -> ModelLayout:
    """The layout after `event`. Raises GrowthError for a growth the layout cannot take."""
    if event.stack != len(layout.stacks):
        raise GrowthError(f"expected stack {len(layout.stacks)} next, got {event.stack}")
    if event.num_blocks <= 0:
        raise GrowthError(f"a stack needs at least one block, got {event.num_blocks}")
    if event.init == "copy" and event.num_blocks > sum(s.num_blocks for s in layout.stacks):
        raise GrowthError(f"init copy needs {event.num_blocks} blocks to copy, the model has fewer")
    unknown = set(event.trunk_ranks) - {str(s.stack) for s in layout.stacks}
    if unknown:
        raise GrowthError(f"adapters for stacks that do not exist: {sorted(unknown)}")
    trunk = [_as_trunk(s, event) for s in layout.stacks]
    new = StackLayout(
        stack=event.stack,
        num_blocks=event.num_blocks,
        base="nf4" if event.precision == "nf4" else "trainable",
        dtype="bf16" if event.precision == "bf16" else "fp32",
        adapter_rank=event.rank,
        adapter_alpha=event.alpha_per_rank * event.rank,
        adapters_train=event.rank > 0,
        joined_step=event.step,
    )
    if event.precision == "nf4" and event.rank <= 0:
        raise GrowthError("an nf4 stack trains through its own adapters: rank must be positive")
    stacks = [*trunk, new] if event.position == "append" else [new, *trunk]
    return ModelLayout(
        stacks=stacks,
        embed_trains=event.trunk == "full",
        head_trains=not event.anchor,
        version=layout.version + 1,
        growth=event.growth,
    )


def _as_trunk(stack: StackLayout, event: StackAppended) -> StackLayout:
    """A stack already in the model, after a growth with `event.trunk`."""
    mode = event.trunk
    rank = event.trunk_ranks.get(str(stack.stack), 0)
    if rank and stack.adapter_rank:
        raise GrowthError(f"stack {stack.stack} already has adapters (rank {stack.adapter_rank})")
    if mode in ("lora", "qlora") and not (rank or stack.adapter_rank):
        raise GrowthError(f"trunk {mode}: stack {stack.stack} gets no adapter rank")
    if mode not in ("lora", "qlora") and rank:
        raise GrowthError(f"trunk {mode} attaches no adapters, but stack {stack.stack} is given rank {rank}")
    if mode == "full" and stack.base == "nf4":
        raise GrowthError(f"stack {stack.stack} is quantised to nf4 and cannot train its base again")
    base = stack.base
    if mode == "full":
        base = "trainable"
    elif mode == "qlora":
        base = "nf4"
    elif base == "trainable":
        base = "frozen"
    if rank:
        return replace(stack, base=base, adapter_rank=rank, adapter_alpha=event.alpha_per_rank * rank, adapters_train=True)
    return replace(stack, base=base, adapters_train=stack.adapter_rank > 0 and mode != "frozen")


def depth_of_training(config: Config, layout: ModelLayout) -> tuple[int, int]:
    """(position, number of stacks) for masked diffusion with time as depth: the position (0 = input
    side) of the newest stack, the one a stage after a growth trains, among the stacks the plan will
    have in the end (1 + the growth entries), so a stack's level does not depend on how far the run got."""
    newest = max(s.stack for s in layout.stacks)
    return [s.stack for s in layout.stacks].index(newest), 1 + len(config.growth)


def trunk_is_frozen(layout: ModelLayout) -> bool:
    """Whether everything before the last stack (embedding included) is fixed, so that its output is a
    pure function of the input tokens and can be cached."""
    if layout.embed_trains or len(layout.stacks) < 2:
        return False
    return all(s.base != "trainable" and not s.adapters_train for s in layout.stacks[:-1])


def caches_trunk(config: Config, layout: ModelLayout) -> bool:
    """Whether training at `layout` reads the trunk's outputs from an activation cache."""
    if not 0 <= layout.growth < len(config.growth) or config.growth[layout.growth].cache == "off":
        return False  # (a config without the entry: refused as a continuation, see engine.session)
    spec = config.growth[layout.growth]
    # A packed sft stage's rows attend per document, a dpo or grpo stage's rows are its own: the cache holds the
    # trunk outputs of whole rows as pretraining draws them.
    packed = any(rules_of(s).packs_documents(s) for s in config.stages)
    return spec.position == "append" and trunk_is_frozen(layout) and config.objective.kind == "clm" and not packed


def cache_span(schedule: Schedule, state: State, step: int) -> int:
    """The number of steps a cache of the current trunk made before step `step` covers: up to the next
    growth or the end of the run."""
    later = [s for s in schedule.growth_steps[state.num_growths :] if s > step]
    return max(0, min([*later, schedule.num_steps]) - step)


def stack_table(layout: ModelLayout) -> list[dict]:
    """One row per stack, input side first, for tools: id, blocks, base, adapters."""
    return [
        {
            "stack": s.stack,
            "num_blocks": s.num_blocks,
            "base": s.base if s.dtype == "fp32" or s.base == "nf4" else f"{s.base} ({s.dtype})",
            "adapters": f"rank {s.adapter_rank}" + ("" if s.adapters_train else " (fixed)") if s.adapter_rank else "",
            "joined_step": s.joined_step,
        }
        for s in layout.stacks
    ]
