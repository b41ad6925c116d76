"""The mutator of each event type but RunResumed (rewind.states.resumes): its legality checks and the
state after it. Adding an event type means adding its mutator here (see `rewind.states.transition`)."""

from __future__ import annotations

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
    RolloutsRecorded,
    RunFinished,
    RunStarted,
    RunStopped,
    StackAppended,
    StageEntered,
    StepCommitted,
    Validated,
)
from rewind.states.growth import GrowthError, current_layout, grown_layout
from rewind.states.schedule import Schedule
from rewind.states.state import OptimizerResetRef, Reference, State
from rewind.states.transition import IllegalTransition, mutates, require

replace = msgspec.structs.replace


@mutates(RunStarted)
def run_started(state: State, event: RunStarted) -> State:
    require(not state.started, event, "the run has already started")
    config = event.config
    schedule = Schedule(config)
    baseline = event.behaviours.baseline_evaluation and bool(config.training.evaluations)
    return State(
        started=True,
        config_hash=event.config_hash,
        num_stages=schedule.num_stages,
        tokens_per_step=schedule.tokens_per_step,
        num_steps=schedule.num_steps,
        reference_update_stages=sorted(schedule.reference_update_stages),
        optimizer_reset_stages=sorted(schedule.optimizer_reset_stages),
        parent_run=event.parent.run if event.parent else "",
        num_threads=event.num_threads,
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


@mutates(StageEntered)
def stage_entered(state: State, event: StageEntered) -> State:
    stage = event.stage
    require(stage == state.num_stages_entered, event, f"expected stage {state.num_stages_entered} next")
    require(stage < state.num_stages, event, f"the run has only {state.num_stages} stages")
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


def _after_due(due: list[int], stage: int, event: Event, what: str) -> list[int]:
    """The stages still due once `event` did what was due first (a stage entry queues them in order)."""
    require(bool(due) and due[0] == stage, event, f"no {what} is due for stage {stage} (due: {due})")
    return due[1:]


@mutates(OptimizerReset)
def optimizer_reset(state: State, event: OptimizerReset) -> State:
    stage = event.stage
    return replace(
        state,
        pending_optimizer_resets=_after_due(state.pending_optimizer_resets, stage, event, "optimizer reset"),
        last_optimizer_reset=OptimizerResetRef(stage=stage, step=event.step, lr_restarted=event.lr_restarted),
    )


@mutates(ReferenceRefreshed)
def reference_refreshed(state: State, event: ReferenceRefreshed) -> State:
    stage = event.stage
    return replace(
        state,
        reference=Reference(stage=stage, step=event.step, checkpoint=event.checkpoint, layout=state.layout),
        pending_refreshes=_after_due(state.pending_refreshes, stage, event, "refresh"),
    )


@mutates(FadeStarted)
def fade_started(state: State, event: FadeStarted) -> State:
    b = event.boundary
    require(0 <= b < state.num_stages - 1, event, f"boundary {b} does not exist")
    require(not state.fades_started or b > state.fades_started[-1], event, "fades start in order")
    return replace(state, fades_started=[*state.fades_started, b])


@mutates(FadeEnded)
def fade_ended(state: State, event: FadeEnded) -> State:
    b = event.boundary
    require(b in state.fades_started and b not in state.fades_ended, event, f"fade {b} is not running")
    return replace(state, fades_ended=[*state.fades_ended, b])


@mutates(StackAppended)
def stack_appended(state: State, event: StackAppended) -> State:
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


@mutates(ActivationsCached)
def activations_cached(state: State, event: ActivationsCached) -> State:
    layout = current_layout(state)
    require(event.version == layout.version, event, f"the trunk is at version {layout.version}")
    require(event.num_steps >= 0 and event.num_rows >= 0, event, "counts must be >= 0")
    return replace(state, activation_cache=event)


@mutates(RolloutsRecorded)
def rollouts_recorded(state: State, event: RolloutsRecorded) -> State:
    require(event.step == state.step, event, f"expected step {state.step} (rollouts are sampled before a step)")
    require(event.stage == state.stage, event, f"the run is in stage {state.stage}")
    require(event.num_prompts >= 1 and event.group_size >= 1, event, "counts must be >= 1")
    return replace(state, rollouts=event, cursors=event.cursors)


@mutates(EpochStarted)
def epoch_started(state: State, event: EpochStarted) -> State:
    require(event.step == state.step, event, f"expected step {state.step} (an epoch starts with a step)")
    # Not necessarily past the last one: a fork onto a larger file counts its epochs afresh.
    require(event.epoch >= 1, event, "an epoch that starts is epoch 1 or later (epoch 0 is the first read)")
    return replace(state, epochs={**state.epochs, event.dataset: event.epoch})


@mutates(StepCommitted)
def step_committed(state: State, event: StepCommitted) -> State:
    require(event.step == state.step + 1, event, f"expected step {state.step + 1}")
    require(
        event.tokens == state.tokens + state.tokens_per_step,
        event,
        f"expected {state.tokens + state.tokens_per_step} tokens",
    )
    require(not state.pending_refreshes, event, "a reference refresh is due before the next step")
    require(not state.pending_optimizer_resets, event, "an optimizer reset is due before the next step")
    return replace(
        state,
        step=event.step,
        tokens=event.tokens,
        cursors=event.cursors,
        last_loss=event.loss,
        num_skipped_steps=state.num_skipped_steps + int(event.skipped),
    )


@mutates(Validated)
def validated(state: State, event: Validated) -> State:
    require(event.step == state.step, event, f"expected step {state.step}")
    return replace(state, last_validated_step=event.step)


@mutates(NonFiniteLoss)
def nonfinite_loss(state: State, event: NonFiniteLoss) -> State:
    require(event.step == state.step, event, f"expected step {state.step}")
    return state


@mutates(Evaluated)
def evaluated(state: State, event: Evaluated) -> State:
    require(event.step == state.step, event, f"expected step {state.step}")
    if event.boundary == -1:  # the baseline: a fork's may come after its parent's boundary evaluations
        return replace(
            state, last_evaluated_boundary=max(state.last_evaluated_boundary, -1), baseline_step=-1
        )
    return replace(state, last_evaluated_boundary=event.boundary)


@mutates(CheckpointCommitted)
def checkpoint_committed(state: State, event: CheckpointCommitted) -> State:
    require(event.step == state.step, event, f"a checkpoint labelled {event.step} at step {state.step}")
    return replace(
        state,
        last_checkpoint=event,
        live_checkpoints=[*state.live_checkpoints, event],
        grown_since_checkpoint=False,
    )


@mutates(CheckpointDeleted)
def checkpoint_deleted(state: State, event: CheckpointDeleted) -> State:
    name = event.checkpoint
    live = [c for c in state.live_checkpoints if c.checkpoint != name]
    require(len(live) < len(state.live_checkpoints), event, f"checkpoint {name} is not live")
    require(
        state.reference is None or state.reference.checkpoint != name,
        event,
        f"checkpoint {name} holds the current reference",
    )
    return replace(state, live_checkpoints=live)


@mutates(RunStopped)
def run_stopped(state: State, event: RunStopped) -> State:
    return replace(state, stopped_reason=event.reason)


@mutates(ConfigChanged)
def config_changed(state: State, event: ConfigChanged) -> State:
    config = event.config
    schedule = Schedule(config)
    require(
        schedule.tokens_per_step == state.tokens_per_step,
        event,
        f"tokens per step would change from {state.tokens_per_step} to {schedule.tokens_per_step}",
    )
    require(
        schedule.num_stages >= state.num_stages_entered,
        event,
        f"the run already entered {state.num_stages_entered} stages; the new config has {schedule.num_stages}",
    )
    require(schedule.num_steps >= state.step, event, f"the new config ends before step {state.step}")
    require(
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
        config_hash=event.config_hash,
        num_stages=schedule.num_stages,
        num_steps=schedule.num_steps,
        reference_update_stages=sorted(schedule.reference_update_stages),
        optimizer_reset_stages=sorted(schedule.optimizer_reset_stages),
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


@mutates(RunFinished)
def run_finished(state: State, event: RunFinished) -> State:
    require(
        state.num_stages_entered == state.num_stages,
        event,
        f"only {state.num_stages_entered} of {state.num_stages} stages were entered",
    )
    require(not state.pending_refreshes, event, "a reference refresh is still due")
    require(not state.pending_optimizer_resets, event, "an optimizer reset is still due")
    return replace(state, finished=True)
