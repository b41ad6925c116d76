"""A resume's transition: a RunResumed restores the fold's own restore anchor, or (a fork's first one)
adopts the parent's state its seed carries, after range checks against the child's config.

Resumes are derived, not trusted: the state keeps its restore anchor (the state just after the last
RunStarted, CheckpointCommitted or RunResumed and the records that belong to it), and a RunResumed
must name that anchor's checkpoint and supersede exactly the records after it. A fork's first
RunResumed is the one exception: its seed comes from the parent's log and is range-checked here.
"""

from __future__ import annotations

import msgspec

from rewind.states.events import RunResumed
from rewind.states.state import SEED_FALLS_BACK_TO_CHILD, ForkSeed, State, Superseded, anchor_checkpoint
from rewind.states.transition import mutates, require

replace = msgspec.structs.replace


@mutates(RunResumed)
def resumed(state: State, event: RunResumed) -> State:
    anchor = state.anchor
    first, last = event.superseded_first_seq, event.superseded_last_seq
    if event.seed is not None and (anchor is None or anchor_checkpoint(anchor) != event.checkpoint):
        return _seeded(state, event, event.seed)
    require(anchor is not None, event, "no restore point to resume from")
    assert anchor is not None
    require(
        anchor_checkpoint(anchor) == event.checkpoint,
        event,
        f"resumes from {event.checkpoint or 'the start'}, but the log's restore point is "
        f"{anchor_checkpoint(anchor) or 'the start'}",
    )
    require(event.step == anchor.step, event, f"the restore point is at step {anchor.step}")
    require(
        first == anchor.next_seq, event, f"the records after the restore point start at seq {anchor.next_seq}"
    )
    # Folding every record, the superseded ones were applied and this record's seq is last + 1;
    # folding only the effective ones, they were skipped and this record's seq is `first`.
    require(
        last >= first - 1 and state.next_seq in (first, last + 1),
        event,
        f"supersedes records {first}..{last}, but it is record {state.next_seq}",
    )
    if event.seed is not None:  # written by rewind 0.1, which stored the state: it must agree
        require(
            _agrees(anchor, event.seed), event, "the state it records differs from the log's restore point"
        )
    resume = Superseded(first_seq=first, last_seq=last, checkpoint=event.checkpoint, step=event.step)
    # Checkpoints committed after the restore point stay on disk (the log is append-only), but
    # resuming from the last committed one means there are none: the anchor's view is the truth.
    return replace(
        anchor,
        resumes=[*state.resumes, resume],
        stopped_reason="",
        next_seq=max(first, last + 1),
        device=event.device,
        world_size=event.world_size,
        num_threads=event.num_threads or anchor.num_threads,
    )


def _agrees(anchor: State, seed: ForkSeed) -> bool:
    return (anchor.stage, anchor.num_stages_entered, anchor.cursors, anchor.reference) == (
        seed.stage,
        seed.num_stages_entered,
        seed.cursors,
        seed.reference,
    )


def _seeded(state: State, event: RunResumed, seed: ForkSeed) -> State:
    """A fork's start: the parent's state at the fork checkpoint, checked against the child's config."""
    require(bool(state.parent_run), event, "only a fork's log may seed its state")
    require(state.step == 0 and not state.resumes, event, "a fork is seeded before its first step")
    require(event.superseded_last_seq < event.superseded_first_seq, event, "a fork's seed supersedes nothing")
    tokens_per_step = seed.tokens_per_step or state.tokens_per_step
    num_stages = seed.num_stages or state.num_stages
    require(
        event.step >= 0 and event.tokens == event.step * tokens_per_step, event, "step and tokens disagree"
    )
    require(0 <= seed.num_stages_entered <= num_stages, event, f"the run has {num_stages} stages")
    require(-1 <= seed.stage < max(seed.num_stages_entered, 1), event, f"stage {seed.stage} was not entered")
    require(all(v >= 0 for v in seed.cursors.values()), event, "data cursors must be >= 0")
    require(seed.num_skipped_steps >= 0, event, "skipped steps must be >= 0")
    require(
        all(0 < s < seed.num_stages_entered for s in seed.pending_optimizer_resets),
        event,
        "a seeded optimizer reset is for a stage not entered",
    )
    reset = seed.last_optimizer_reset
    require(
        reset is None or 0 <= reset.step <= event.step,
        event,
        "the seed's last optimizer reset is after the fork",
    )
    names = [c.checkpoint for c in seed.live_checkpoints]
    require(event.checkpoint in names, event, f"the seed does not hold checkpoint {event.checkpoint}")
    require(
        all(c.step <= event.step for c in seed.live_checkpoints),
        event,
        "a seeded checkpoint is after the fork",
    )
    last = next(c for c in seed.live_checkpoints if c.checkpoint == event.checkpoint)
    require(last.step == event.step, event, f"checkpoint {event.checkpoint} is not at step {event.step}")
    require(
        seed.reference is None or seed.reference.checkpoint in names,
        event,
        "the seed's reference is not held",
    )
    resume = Superseded(
        first_seq=event.superseded_first_seq,
        last_seq=event.superseded_last_seq,
        checkpoint=event.checkpoint,
        step=event.step,
    )
    # Every field the seed has, as the parent held it; a config-derived one it leaves unset is the child's.
    adopted = {name: getattr(seed, name) for name in ForkSeed.__struct_fields__}
    adopted.update({name: adopted[name] or getattr(state, name) for name in SEED_FALLS_BACK_TO_CHILD})
    return replace(
        state,
        **adopted,
        step=event.step,
        tokens=event.tokens,
        last_checkpoint=last,
        # No baseline: the child starts from the parent's weights, which the parent evaluated, and an
        # evaluation the parent never made would be the first thing `rewind diff` finds between a fork
        # and its parent.
        baseline_step=-1,
        resumes=[resume],
        stopped_reason="",
    )


def seed_of(state: State) -> ForkSeed:
    """The seed a fork of a run at `state` (its last checkpoint) starts from: every field the seed has,
    as the state holds it."""
    return ForkSeed(**{name: getattr(state, name) for name in ForkSeed.__struct_fields__})
