"""What is due: the pure decisions the engine asks for before and after every step.

`decide(state, schedule, step)` returns the next control event due before the step with index `step`
runs, or None. It looks only at the folded state (what already happened) and the schedule, never at
history, so a run resumed from any cut point produces exactly the events a one-pass run would have.
`plan` iterates it over a whole run, jumping between the steps where something can change, which is
what makes a million-step dry-run take well under a second.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from rewind.states.config import Config, config_hash
from rewind.states.events import (
    Event,
    FadeEnded,
    FadeStarted,
    ReferenceRefreshed,
    RunFinished,
    RunStarted,
    StageEntered,
)
from rewind.states.fold import apply
from rewind.states.schedule import Schedule
from rewind.states.state import CheckpointRef, State


def decide(state: State, schedule: Schedule, step: int) -> Event | None:
    tokens = schedule.tokens_of(step)
    if not state.started or state.finished:
        return None
    if state.pending_refreshes:
        return ReferenceRefreshed(step=step, tokens=tokens, stage=state.pending_refreshes[0])
    for ramp in schedule.fades:
        started = ramp.boundary in state.fades_started
        if not started and schedule.fade_start_step(ramp) <= step:
            return FadeStarted(step=step, tokens=tokens, boundary=ramp.boundary)
        if started and ramp.boundary not in state.fades_ended and schedule.fade_end_step(ramp) <= step:
            return FadeEnded(step=step, tokens=tokens, boundary=ramp.boundary)
    upcoming = state.num_stages_entered
    if upcoming < schedule.num_stages and (step >= schedule.num_steps or schedule.entry_steps[upcoming] <= step):
        return StageEntered(step=step, tokens=tokens, stage=upcoming)
    if step >= schedule.num_steps:
        return RunFinished(step=step, tokens=tokens)
    return None


def due_events(state: State, schedule: Schedule, step: int) -> tuple[State, list[Event]]:
    """Every control event due before step `step`, and the state after applying them."""
    events: list[Event] = []
    while (event := decide(state, schedule, step)) is not None:
        events.append(event)
        state = apply(state, event)
    return state, events


def started_state(config: Config) -> tuple[RunStarted, State]:
    started = RunStarted(step=0, tokens=0, config=config, config_hash=config_hash(config))
    return started, apply(State(), started)


def plan(schedule: Schedule, state: State | None = None, from_step: int = 0) -> Iterator[Event]:
    """The control events of a whole run (RunStarted excluded), from `state` at step `from_step` on."""
    if state is None:
        _, state = started_state(schedule.config)
    step = from_step
    while not state.finished:
        state, events = due_events(state, schedule, step)
        yield from events
        step = schedule.next_transition_step(step + 1)


@dataclass(frozen=True, slots=True)
class Duties:
    """What the engine must do after a step is committed (state.step steps completed)."""

    validate: bool
    evaluate_boundary: int | None  # Evaluated(boundary=...) is due; n - 1 = the end of the run
    checkpoint_reason: str | None  # "final" | "boundary" | "interval" | None


def duties_after_step(state: State, schedule: Schedule) -> Duties:
    done = state.step
    logging = schedule.config.logging
    boundary: int | None = None
    if done >= schedule.num_steps:
        boundary = schedule.num_stages - 1
    else:
        ended = [i for i in range(schedule.num_stages - 1) if schedule.entry_steps[i + 1] == done]
        boundary = ended[-1] if ended else None
    if boundary is not None and boundary <= state.last_evaluated_boundary:
        boundary = None  # already evaluated (only possible when resuming onto the same step)
    if done >= schedule.num_steps:
        reason: str | None = "final"
    elif boundary is not None:
        reason = "boundary"
    elif logging.checkpoint_interval and done % logging.checkpoint_interval == 0:
        reason = "interval"
    else:
        reason = None
    validate = bool(logging.validation_interval) and done % logging.validation_interval == 0
    return Duties(validate=validate, evaluate_boundary=boundary, checkpoint_reason=reason)


def reference_checkpoint(state: State) -> CheckpointRef | None:
    """The committed checkpoint holding the current weights, if one was taken at this very step.

    A due ReferenceRefreshed points at it; when there is none (e.g. a refresh before the first step),
    the engine must commit a checkpoint first."""
    last = state.last_checkpoint
    return last if last is not None and last.step == state.step else None


def checkpoints_to_delete(state: State, keep_last: int) -> list[str]:
    """Retention: keep the last `keep_last`, every stage-boundary and final checkpoint, and the one the
    current reference points to. Returns names to delete, oldest first."""
    live = sorted(state.live_checkpoints, key=lambda c: c.step)
    protected = {c.checkpoint for c in live[-keep_last:]}
    protected |= {c.checkpoint for c in live if c.reason in ("boundary", "final")}
    if state.reference is not None:
        protected.add(state.reference.checkpoint)
    return [c.checkpoint for c in live if c.checkpoint not in protected]
