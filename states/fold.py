"""State transitions: `apply(state, event)` is the only way the control state changes.

Each case checks that the transition is legal from the current state and raises `IllegalTransition`
(naming the event and the reason) otherwise, so a log that was tampered with, reordered or written
by a buggy engine is caught at fold time instead of silently producing a different run.

Resumes are derived, not trusted: the state keeps its restore anchor (the state just after the last
RunStarted, CheckpointCommitted or RunResumed and the records that belong to it), and a RunResumed
must name that anchor's checkpoint and supersede exactly the records after it. A fork's first
RunResumed is the one exception: its seed comes from the parent's log and is range-checked here.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from rewind.states.events import (
    ActivationsCached,
    CheckpointCommitted,
    CheckpointDeleted,
    ConfigChanged,
    EpochStarted,
    Evaluated,
    Event,
    FadeEnded,
    FadeStarted,
    NonFiniteLoss,
    OptimizerReset,
    ReferenceRefreshed,
    RunFinished,
    RunResumed,
    RunStarted,
    RunStopped,
    StackAppended,
    StageEntered,
    StepCommitted,
    Validated,
)
from rewind.states.growth import GrowthError, current_layout, grown_layout
from rewind.states.schedule import Schedule
from rewind.states.state import (
    CacheRef,
    CheckpointRef,
    ForkSeed,
    OptimizerResetRef,
    Reference,
    State,
    Superseded,
    anchor_checkpoint,
)

replace = msgspec.structs.replace


class IllegalTransition(Exception):
    """An event that cannot follow the state it was applied to."""

    def __init__(self, event: Event, reason: str):
        self.event = event
        self.reason = reason
        super().__init__(f"{type(event).__name__} at step {event.step}: {reason}")


def _require(condition: bool, event: Event, reason: str) -> None:
    if not condition:
        raise IllegalTransition(event, reason)


# Records that belong to the restore anchor just before them: a resume keeps them (see State.anchor).
ANCHOR_FOLLOWERS = (CheckpointDeleted, ConfigChanged)


def apply(state: State, event: Event) -> State:
    """The state after `event`, with the seq count and the restore anchor kept up to date."""
    new = _transition(state, event)
    if isinstance(event, RunStarted | CheckpointCommitted | RunResumed):
        opened = replace(new, next_seq=new.next_seq + 1, anchor_open=True, anchor=None)
        return replace(opened, anchor=opened)
    if state.anchor_open and isinstance(event, ANCHOR_FOLLOWERS):
        extended = replace(new, next_seq=state.next_seq + 1, anchor=None)
        return replace(extended, anchor=extended)
    return replace(new, next_seq=state.next_seq + 1, anchor_open=False, anchor=state.anchor)


def _transition(state: State, event: Event) -> State:
    if not state.started:
        _require(isinstance(event, RunStarted), event, "the first event of a run must be RunStarted")
    elif state.finished:
        _require(False, event, "the run has already finished")

    match event:
        case RunStarted(config=config, config_hash=config_hash, parent=parent, num_threads=num_threads):
            _require(not state.started, event, "the run has already started")
            schedule = Schedule(config)
            baseline = "baseline_evaluation" in event.features and bool(config.training.evaluations)
            return State(
                started=True,
                config_hash=config_hash,
                num_stages=schedule.num_stages,
                tokens_per_step=schedule.tokens_per_step,
                num_steps=schedule.num_steps,
                reference_update_stages=sorted(schedule.reference_update_stages),
                optimizer_reset_stages=sorted(config.optimization.reset_optimizer_stages),
                parent_run=parent.run if parent else "",
                num_threads=num_threads,
                cpu_capability=event.cpu_capability,
                features=list(event.features),
                baseline_step=0 if baseline else -1,
                num_layers=config.architecture.num_layers,
                data=dict(event.data),
                tokenizer=event.tokenizer,
                pretrained=event.pretrained,
                device=event.device,
                world_size=event.world_size,
            )
        case StageEntered(stage=stage):
            _require(stage == state.num_stages_entered, event, f"expected stage {state.num_stages_entered} next")
            _require(stage < state.num_stages, event, f"the run has only {state.num_stages} stages")
            pending = state.pending_refreshes
            if stage in state.reference_update_stages:
                pending = [*pending, stage]
            resets = state.pending_optimizer_resets
            if stage in state.optimizer_reset_stages:
                resets = [*resets, stage]
            return replace(
                state,
                stage=stage,
                num_stages_entered=stage + 1,
                pending_refreshes=pending,
                pending_optimizer_resets=resets,
            )
        case OptimizerReset(stage=stage, lr_restarted=lr_restarted):
            _require(
                bool(state.pending_optimizer_resets) and state.pending_optimizer_resets[0] == stage,
                event,
                f"no optimizer reset is due for stage {stage} (due: {state.pending_optimizer_resets})",
            )
            return replace(
                state,
                pending_optimizer_resets=state.pending_optimizer_resets[1:],
                last_optimizer_reset=OptimizerResetRef(stage=stage, step=event.step, lr_restarted=lr_restarted),
            )
        case ReferenceRefreshed(stage=stage, checkpoint=checkpoint):
            _require(
                bool(state.pending_refreshes) and state.pending_refreshes[0] == stage,
                event,
                f"no refresh is due for stage {stage} (due: {state.pending_refreshes})",
            )
            return replace(
                state,
                reference=Reference(stage=stage, step=event.step, checkpoint=checkpoint, layout=state.layout),
                pending_refreshes=state.pending_refreshes[1:],
            )
        case FadeStarted(boundary=b):
            _require(0 <= b < state.num_stages - 1, event, f"boundary {b} does not exist")
            _require(not state.fades_started or b > state.fades_started[-1], event, "fades start in order")
            return replace(state, fades_started=[*state.fades_started, b])
        case FadeEnded(boundary=b):
            _require(b in state.fades_started and b not in state.fades_ended, event, f"fade {b} is not running")
            return replace(state, fades_ended=[*state.fades_ended, b])
        case StackAppended():
            try:
                layout = grown_layout(current_layout(state), event)
            except GrowthError as exc:
                raise IllegalTransition(event, str(exc)) from None
            # The trunk changed: whatever cache there was holds another trunk's outputs.
            return replace(
                state,
                layout=layout,
                num_growths=state.num_growths + 1,
                activation_cache=None,
                grown_since_checkpoint=True,
            )
        case ActivationsCached():
            layout = current_layout(state)
            _require(event.version == layout.version, event, f"the trunk is at version {layout.version}")
            _require(event.num_steps >= 0 and event.num_rows >= 0, event, "counts must be >= 0")
            cache = CacheRef(
                version=event.version,
                first_step=event.step,
                num_steps=event.num_steps,
                num_rows=event.num_rows,
                path=event.path,
                num_bytes=event.num_bytes,
            )
            return replace(state, activation_cache=cache)
        case EpochStarted(dataset=dataset, epoch=epoch):
            _require(event.step == state.step, event, f"expected step {state.step} (an epoch starts with a step)")
            # Not necessarily past the last one: a fork onto a larger file counts its epochs afresh.
            _require(epoch >= 1, event, "an epoch that starts is epoch 1 or later (epoch 0 is the first read)")
            return replace(state, epochs={**state.epochs, dataset: epoch})
        case StepCommitted():
            _require(event.step == state.step + 1, event, f"expected step {state.step + 1}")
            _require(
                event.tokens == state.tokens + state.tokens_per_step,
                event,
                f"expected {state.tokens + state.tokens_per_step} tokens",
            )
            _require(not state.pending_refreshes, event, "a reference refresh is due before the next step")
            _require(not state.pending_optimizer_resets, event, "an optimizer reset is due before the next step")
            return replace(
                state,
                step=event.step,
                tokens=event.tokens,
                cursors=event.cursors,
                last_loss=event.loss,
                num_skipped_steps=state.num_skipped_steps + int(event.skipped),
            )
        case Validated():
            _require(event.step == state.step, event, f"expected step {state.step}")
            return replace(state, last_validated_step=event.step)
        case NonFiniteLoss():
            _require(event.step == state.step, event, f"expected step {state.step}")
            return state
        case Evaluated(boundary=boundary):
            _require(event.step == state.step, event, f"expected step {state.step}")
            if boundary == -1:  # the baseline: a fork's may come after its parent's boundary evaluations
                return replace(
                    state, last_evaluated_boundary=max(state.last_evaluated_boundary, -1), baseline_step=-1
                )
            return replace(state, last_evaluated_boundary=boundary)
        case CheckpointCommitted():
            _require(event.step == state.step, event, f"a checkpoint labelled {event.step} at step {state.step}")
            ref = CheckpointRef(
                checkpoint=event.checkpoint,
                step=event.step,
                tokens=event.tokens,
                reason=event.reason,
                manifest_sha256=event.manifest_sha256,
                files=event.files,
            )
            return replace(
                state,
                last_checkpoint=ref,
                live_checkpoints=[*state.live_checkpoints, ref],
                grown_since_checkpoint=False,
            )
        case CheckpointDeleted(checkpoint=name):
            live = [c for c in state.live_checkpoints if c.checkpoint != name]
            _require(len(live) < len(state.live_checkpoints), event, f"checkpoint {name} is not live")
            _require(
                state.reference is None or state.reference.checkpoint != name,
                event,
                f"checkpoint {name} holds the current reference",
            )
            return replace(state, live_checkpoints=live)
        case RunStopped(reason=reason):
            return replace(state, stopped_reason=reason)
        case RunResumed():
            return _resumed(state, event)
        case ConfigChanged(config=config, config_hash=new_hash):
            schedule = Schedule(config)
            _require(
                schedule.tokens_per_step == state.tokens_per_step,
                event,
                f"tokens per step would change from {state.tokens_per_step} to {schedule.tokens_per_step}",
            )
            _require(
                schedule.num_stages >= state.num_stages_entered,
                event,
                f"the run already entered {state.num_stages_entered} stages; the new config has {schedule.num_stages}",
            )
            _require(schedule.num_steps >= state.step, event, f"the new config ends before step {state.step}")
            _require(
                len(config.growth) >= state.num_growths,
                event,
                f"the model already grew {state.num_growths} times; the new config has {len(config.growth)} growth entries",
            )
            # Evaluations count as done only for boundaries that have ended under the new schedule: a
            # finished run forked into a longer one must evaluate its (new) end again.
            ended = [i for i in range(schedule.num_stages - 1) if schedule.entry_steps[i + 1] <= state.step]
            if schedule.num_steps <= state.step:
                ended.append(schedule.num_stages - 1)
            evaluated = min(state.last_evaluated_boundary, max(ended, default=-1))
            return replace(
                state,
                config_hash=new_hash,
                num_stages=schedule.num_stages,
                num_steps=schedule.num_steps,
                reference_update_stages=sorted(schedule.reference_update_stages),
                optimizer_reset_stages=sorted(config.optimization.reset_optimizer_stages),
                last_evaluated_boundary=evaluated,
                # Before the first update the weights are the seed's, so the architecture may still
                # change; the data may change at any time, and a cache of the old data's rows with it.
                num_layers=config.architecture.num_layers if state.step == 0 else state.num_layers,
                activation_cache=None,
                # The new config's data on record (what a resume under it checks); the tokenizer is
                # the run's for life (the session refuses another once a step has been taken).
                data=dict(event.data),
                tokenizer=event.tokenizer,
            )
        case RunFinished():
            _require(
                state.num_stages_entered == state.num_stages,
                event,
                f"only {state.num_stages_entered} of {state.num_stages} stages were entered",
            )
            _require(not state.pending_refreshes, event, "a reference refresh is still due")
            _require(not state.pending_optimizer_resets, event, "an optimizer reset is still due")
            return replace(state, finished=True)
    raise IllegalTransition(event, "unknown event type")


def _resumed(state: State, event: RunResumed) -> State:
    anchor = state.anchor
    first, last = event.superseded_first_seq, event.superseded_last_seq
    if event.seed is not None and (anchor is None or anchor_checkpoint(anchor) != event.checkpoint):
        return _seeded(state, event, event.seed)
    _require(anchor is not None, event, "no restore point to resume from")
    assert anchor is not None
    _require(
        anchor_checkpoint(anchor) == event.checkpoint,
        event,
        f"resumes from {event.checkpoint or 'the start'}, but the log's restore point is "
        f"{anchor_checkpoint(anchor) or 'the start'}",
    )
    _require(event.step == anchor.step, event, f"the restore point is at step {anchor.step}")
    _require(first == anchor.next_seq, event, f"the records after the restore point start at seq {anchor.next_seq}")
    # Folding every record, the superseded ones were applied and this record's seq is last + 1;
    # folding only the effective ones, they were skipped and this record's seq is `first`.
    _require(
        last >= first - 1 and state.next_seq in (first, last + 1),
        event,
        f"supersedes records {first}..{last}, but it is record {state.next_seq}",
    )
    if event.seed is not None:  # written by rewind 0.1, which stored the state: it must agree
        _require(_agrees(anchor, event.seed), event, "the state it records differs from the log's restore point")
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
    _require(bool(state.parent_run), event, "only a fork's log may seed its state")
    _require(state.step == 0 and not state.resumes, event, "a fork is seeded before its first step")
    _require(event.superseded_last_seq < event.superseded_first_seq, event, "a fork's seed supersedes nothing")
    tokens_per_step = seed.tokens_per_step or state.tokens_per_step
    num_stages = seed.num_stages or state.num_stages
    _require(event.step >= 0 and event.tokens == event.step * tokens_per_step, event, "step and tokens disagree")
    _require(0 <= seed.num_stages_entered <= num_stages, event, f"the run has {num_stages} stages")
    _require(-1 <= seed.stage < max(seed.num_stages_entered, 1), event, f"stage {seed.stage} was not entered")
    _require(all(v >= 0 for v in seed.cursors.values()), event, "data cursors must be >= 0")
    _require(seed.num_skipped_steps >= 0, event, "skipped steps must be >= 0")
    _require(
        all(0 < s < seed.num_stages_entered for s in seed.pending_optimizer_resets),
        event,
        "a seeded optimizer reset is for a stage not entered",
    )
    reset = seed.last_optimizer_reset
    _require(reset is None or 0 <= reset.step <= event.step, event, "the seed's last optimizer reset is after the fork")
    names = [c.checkpoint for c in seed.live_checkpoints]
    _require(event.checkpoint in names, event, f"the seed does not hold checkpoint {event.checkpoint}")
    _require(all(c.step <= event.step for c in seed.live_checkpoints), event, "a seeded checkpoint is after the fork")
    last = next(c for c in seed.live_checkpoints if c.checkpoint == event.checkpoint)
    _require(last.step == event.step, event, f"checkpoint {event.checkpoint} is not at step {event.step}")
    _require(seed.reference is None or seed.reference.checkpoint in names, event, "the seed's reference is not held")
    resume = Superseded(
        first_seq=event.superseded_first_seq,
        last_seq=event.superseded_last_seq,
        checkpoint=event.checkpoint,
        step=event.step,
    )
    return replace(
        state,
        config_hash=seed.config_hash or state.config_hash,
        tokens_per_step=tokens_per_step,
        num_stages=num_stages,
        num_steps=seed.num_steps or state.num_steps,
        reference_update_stages=seed.reference_update_stages or state.reference_update_stages,
        step=event.step,
        tokens=event.tokens,
        stage=seed.stage,
        num_stages_entered=seed.num_stages_entered,
        fades_started=seed.fades_started,
        fades_ended=seed.fades_ended,
        pending_refreshes=seed.pending_refreshes,
        reference=seed.reference,
        layout=seed.layout,
        num_layers=seed.num_layers or state.num_layers,
        num_growths=seed.num_growths,
        cursors=seed.cursors,
        last_loss=seed.last_loss,
        num_skipped_steps=seed.num_skipped_steps,
        last_checkpoint=last,
        live_checkpoints=seed.live_checkpoints,
        last_evaluated_boundary=seed.last_evaluated_boundary,
        last_validated_step=seed.last_validated_step,
        # The parent's behaviours, so the child computes what the parent would have. No baseline: the
        # child starts from the parent's weights, which the parent evaluated, and an evaluation the parent
        # never made would be the first thing `rewind diff` finds between a fork and its parent.
        features=seed.features,
        pending_optimizer_resets=seed.pending_optimizer_resets,
        last_optimizer_reset=seed.last_optimizer_reset,
        baseline_step=-1,
        resumes=[resume],
        stopped_reason="",
    )


def seed_of(state: State) -> ForkSeed:
    """The seed a fork of a run at `state` (its last checkpoint) starts from: every field the seed has,
    as the state holds it."""
    return ForkSeed(**{name: getattr(state, name) for name in ForkSeed.__struct_fields__})


def fold(events: Iterable[Event], state: State | None = None) -> State:
    """Fold events into a state, starting from `state` (the empty state by default)."""
    current = state if state is not None else State()
    for event in events:
        current = apply(current, event)
    return current
