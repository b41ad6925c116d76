"""State transitions: `apply(state, event)` is the only way the control state changes.

Each case checks that the transition is legal from the current state and raises `IllegalTransition`
(naming the event and the reason) otherwise, so a log that was tampered with, reordered or written
by a buggy engine is caught at fold time instead of silently producing a different run.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from rewind.states.events import (
    CheckpointCommitted,
    CheckpointDeleted,
    ConfigChanged,
    Evaluated,
    Event,
    FadeEnded,
    FadeStarted,
    NonFiniteLoss,
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
from rewind.states.schedule import Schedule
from rewind.states.state import CheckpointRef, Reference, Stack, State, Superseded

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


def apply(state: State, event: Event) -> State:
    if not state.started:
        _require(isinstance(event, RunStarted), event, "the first event of a run must be RunStarted")
    elif state.finished:
        _require(False, event, "the run has already finished")

    match event:
        case RunStarted(config=config, config_hash=config_hash, parent=parent, num_threads=num_threads):
            _require(not state.started, event, "the run has already started")
            schedule = Schedule(config)
            return State(
                started=True,
                config_hash=config_hash,
                num_stages=schedule.num_stages,
                tokens_per_step=schedule.tokens_per_step,
                num_steps=schedule.num_steps,
                reference_update_stages=sorted(schedule.reference_update_stages),
                parent_run=parent.run if parent else "",
                num_threads=num_threads,
            )
        case StageEntered(stage=stage):
            _require(stage == state.num_stages_entered, event, f"expected stage {state.num_stages_entered} next")
            _require(stage < state.num_stages, event, f"the run has only {state.num_stages} stages")
            pending = state.pending_refreshes
            if stage in state.reference_update_stages:
                pending = [*pending, stage]
            return replace(state, stage=stage, num_stages_entered=stage + 1, pending_refreshes=pending)
        case ReferenceRefreshed(stage=stage, checkpoint=checkpoint):
            _require(
                bool(state.pending_refreshes) and state.pending_refreshes[0] == stage,
                event,
                f"no refresh is due for stage {stage} (due: {state.pending_refreshes})",
            )
            return replace(
                state,
                reference=Reference(stage=stage, step=event.step, checkpoint=checkpoint),
                pending_refreshes=state.pending_refreshes[1:],
            )
        case FadeStarted(boundary=b):
            _require(0 <= b < state.num_stages - 1, event, f"boundary {b} does not exist")
            _require(not state.fades_started or b > state.fades_started[-1], event, "fades start in order")
            return replace(state, fades_started=[*state.fades_started, b])
        case FadeEnded(boundary=b):
            _require(b in state.fades_started and b not in state.fades_ended, event, f"fade {b} is not running")
            return replace(state, fades_ended=[*state.fades_ended, b])
        case StackAppended(stack=stack, num_blocks=num_blocks, position=position, trunk=trunk):
            _require(stack == len(state.stacks), event, f"expected stack {len(state.stacks)} next")
            new = Stack(stack=stack, num_blocks=num_blocks, position=position, trunk=trunk, step=event.step)
            return replace(state, stacks=[*state.stacks, new])
        case StepCommitted():
            _require(event.step == state.step + 1, event, f"expected step {state.step + 1}")
            _require(
                event.tokens == state.tokens + state.tokens_per_step,
                event,
                f"expected {state.tokens + state.tokens_per_step} tokens",
            )
            _require(not state.pending_refreshes, event, "a reference refresh is due before the next step")
            return replace(
                state,
                step=event.step,
                tokens=event.tokens,
                cursors=event.cursors,
                last_loss=event.loss,
                num_skipped_steps=state.num_skipped_steps + int(event.skipped),
            )
        case Validated() | NonFiniteLoss():
            _require(event.step == state.step, event, f"expected step {state.step}")
            return state
        case Evaluated(boundary=boundary):
            _require(event.step == state.step, event, f"expected step {state.step}")
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
            return replace(state, last_checkpoint=ref, live_checkpoints=[*state.live_checkpoints, ref])
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
        case RunResumed(restored=restored):
            _require(restored.started, event, "the restored state is not of a started run")
            resume = Superseded(
                first_seq=event.superseded_first_seq,
                last_seq=event.superseded_last_seq,
                checkpoint=event.checkpoint,
                step=event.step,
            )
            # Checkpoints committed after the restore point stay on disk (the log is append-only), but
            # resuming from the last committed one means there are none: keep the restored view.
            return replace(restored, resumes=[*state.resumes, resume], stopped_reason="")
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
                last_evaluated_boundary=evaluated,
            )
        case RunFinished():
            _require(
                state.num_stages_entered == state.num_stages,
                event,
                f"only {state.num_stages_entered} of {state.num_stages} stages were entered",
            )
            _require(not state.pending_refreshes, event, "a reference refresh is still due")
            return replace(state, finished=True)
    raise IllegalTransition(event, "unknown event type")


def fold(events: Iterable[Event], state: State | None = None) -> State:
    """Fold events into a state, starting from `state` (the empty state by default)."""
    current = state if state is not None else State()
    for event in events:
        current = apply(current, event)
    return current
