"""What is due: the pure decisions the engine asks for, one at a time.

`decide(state, schedule)` returns the next `Intent` of a run: a duty left over from the step just
committed (validate, evaluate, checkpoint, retention), a control transition due before the next step
(reference refresh, fade, stage entry, growth, the end), or the next step itself. It looks only at the
folded state and the schedule, never at history, so a run resumed from any cut point produces exactly
the events a one-pass run would have. A control transition that needs nothing measured or written is
its event, which the engine records as it is; the other intents (a step, a validation, an evaluation,
a checkpoint, the trunk's cache, retention) the engine performs and turns into their events, adding
what only it can know (what it measured, the checkpoint or cache it wrote).

`plan` iterates the control part over a whole run, jumping between the steps where something can
change, which is what makes a million-step dry-run take well under a second.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec

from rewind.states.config import Config
from rewind.states.config_identity import canonical, config_hash
from rewind.states.events import (
    RUN_FEATURES,
    ActivationsCached,
    Event,
    FadeEnded,
    FadeStarted,
    OptimizerReset,
    ReferenceRefreshed,
    RunFinished,
    RunStarted,
    StackAppended,
    StageEntered,
)
from rewind.states.fold import apply
from rewind.states.growth import cache_span, caches_trunk, current_layout, growth_event
from rewind.states.lr import lr_at
from rewind.states.schedule import Schedule
from rewind.states.stagekinds import rules_of
from rewind.states.state import CheckpointReason, State


@dataclass(frozen=True, slots=True)
class CacheTrunk:
    """Compute and store the frozen trunk's outputs for the next `num_steps` steps (`num_rows` rows)."""

    version: int
    num_steps: int
    num_rows: int


@dataclass(frozen=True, slots=True)
class RunStep:
    index: int  # the step with this index runs (state.step steps are done)


@dataclass(frozen=True, slots=True)
class Validate:
    pass


@dataclass(frozen=True, slots=True)
class Evaluate:
    boundary: int  # n - 1 = the end of the run, -1 = the baseline before the first update


@dataclass(frozen=True, slots=True)
class TakeCheckpoint:
    reason: CheckpointReason


@dataclass(frozen=True, slots=True)
class DeleteCheckpoints:
    names: tuple[str, ...]  # retention: oldest first


@dataclass(frozen=True, slots=True)
class SampleRollouts:
    """Sample the rollout batch a grpo stage's next steps update on (the window starting at this step),
    keep it and record it (RolloutsRecorded)."""

    stage: int


# The control transitions that are their events: due before a step, nothing to measure or write first.
ControlEvent = (
    StageEntered | FadeStarted | FadeEnded | ReferenceRefreshed | OptimizerReset | StackAppended | RunFinished
)
Control = ControlEvent | CacheTrunk
Intent = Control | RunStep | Validate | Evaluate | TakeCheckpoint | DeleteCheckpoints | SampleRollouts


def decide(state: State, schedule: Schedule) -> Intent | None:
    """The next thing the run must do, or None once it has finished."""
    if not state.started or state.finished:
        return None
    duty = pending_duty(state, schedule)
    if duty is not None:
        return duty
    if state.step == state.baseline_step:
        # Before the first update of the run (or of a fork): the weights it starts from, on record.
        return Evaluate(-1)
    control = control_intent(state, schedule, state.step)
    if isinstance(control, ReferenceRefreshed) and not _holds_model_at(state, state.step):
        return TakeCheckpoint("reference")  # the reference is named by a committed checkpoint of the model
    if control is not None:
        return control
    return rollouts_due(state, schedule, state.step) or RunStep(state.step)


def rollouts_due(state: State, schedule: Schedule, step: int) -> SampleRollouts | None:
    """A rollout stage's next batch (grpo, distill), due before the first step of each window of
    num_iterations steps (counted from the stage's entry) unless the state holds one sampled in that
    window (a fork that begins mid-window samples its own at its first step)."""
    if state.stage < 0 or step >= schedule.num_steps:
        return None
    stage = schedule.config.stages[state.stage]
    every = rules_of(stage).rollout_window(stage)
    if not every:
        return None
    start = schedule.entry_steps[state.stage]
    window = start + (step - start) // every * every
    held = state.rollouts
    # (A record without settings predates them: taken as the config's.)
    same = held is not None and held.settings in ("", rollout_settings(schedule.config, state.stage))
    if same and held.stage == state.stage and held.step >= window:
        return None
    return SampleRollouts(state.stage)


def rollout_settings(config: Config, stage: int) -> str:
    """A digest of what shapes stage `stage`'s rollout batches: how they are sampled and scored (its
    kind's `rollout_shaping`: a grpo stage's group size, temperature, new tokens, rewards, their scaling,
    whether reference log-probs are kept), its datasets, the batch and context sizes. A config change
    that alters it (a fork in place mid-window) samples again rather than train on a batch made
    otherwise; one that changes only the updates (their number, loss, clip, KL weight) trains on the
    batch held."""
    record = config.stages[stage]
    shaping = {
        **rules_of(record).rollout_shaping(config, record),
        "datasets": canonical(record.datasets),
        "batch_size": config.training.batch_size,
        "block_size": config.architecture.block_size,
    }
    return hashlib.sha256(msgspec.json.encode(shaping, order="sorted")).hexdigest()[:16]


def pending_duty(state: State, schedule: Schedule) -> Intent | None:
    """What is left to do after the step that brought the run to `state.step` (none before step 1)."""
    done = state.step
    if done == 0:
        return None
    logging = schedule.config.logging
    if logging.validation_interval and done % logging.validation_interval == 0 and state.last_validated_step < done:
        return Validate()
    boundary = boundary_ending_at(schedule, done)
    if boundary is not None and boundary > state.last_evaluated_boundary:
        return Evaluate(boundary)
    reason = checkpoint_reason(schedule, done, boundary)
    if reason is not None and not _checkpoint_at(state, done):
        return TakeCheckpoint(reason)
    doomed = checkpoints_to_delete(state, logging.keep_last_checkpoints)
    return DeleteCheckpoints(tuple(doomed)) if doomed else None


def boundary_ending_at(schedule: Schedule, done: int) -> int | None:
    """The stage boundary (n - 1 = the end of the run) whose last step is step `done`, if any."""
    if done >= schedule.num_steps:
        return schedule.num_stages - 1
    # The last stage entered at step `done` (entry_steps ascend): its boundary with the stage before.
    entered = bisect.bisect_right(schedule.entry_steps, done, lo=1) - 1
    return entered - 1 if entered >= 1 and schedule.entry_steps[entered] == done else None


def checkpoint_reason(schedule: Schedule, done: int, boundary: int | None) -> CheckpointReason | None:
    if done >= schedule.num_steps:
        return "final"
    if boundary is not None:
        return "boundary"
    interval = schedule.config.logging.checkpoint_interval
    return "interval" if interval and done % interval == 0 else None


def _checkpoint_at(state: State, step: int) -> bool:
    last = state.last_checkpoint
    return last is not None and last.step == step


def _holds_model_at(state: State, step: int) -> bool:
    """Whether the last checkpoint holds the model as it is before the step with index `step`."""
    return _checkpoint_at(state, step) and not state.grown_since_checkpoint


def control_intent(state: State, schedule: Schedule, step: int) -> Control | None:
    """The next control transition due before the step with index `step`, or None: its event (at that
    step), or CacheTrunk, which the engine performs before recording."""
    if not state.started or state.finished:
        return None
    at = {"step": step, "tokens": schedule.tokens_of(step)}
    growth = growth_due(state, schedule, step)
    if growth is not None:
        return growth
    if state.pending_refreshes:
        # The reference is the model as the checkpoint at this step holds it (decide asks for one
        # first; "" in a dry-run, which takes none).
        last = state.last_checkpoint
        held = last.checkpoint if last is not None and _holds_model_at(state, step) else ""
        return ReferenceRefreshed(**at, stage=state.pending_refreshes[0], checkpoint=held)
    # After the stage's refresh: a reference checkpoint taken for the refresh then holds the moments
    # the reset clears, and a resume from it performs the reset again.
    if state.pending_optimizer_resets:
        restarts = schedule.config.optimization.reset_restarts_lr
        return OptimizerReset(**at, stage=state.pending_optimizer_resets[0], lr_restarted=restarts)
    fade = fade_due(state, schedule, step)
    if fade is not None:
        return fade
    upcoming = state.num_stages_entered
    if upcoming < schedule.num_stages and (step >= schedule.num_steps or schedule.entry_steps[upcoming] <= step):
        return StageEntered(**at, stage=upcoming)
    if step >= schedule.num_steps:
        return RunFinished(**at)
    return cache_due(state, schedule, step)


def fade_due(state: State, schedule: Schedule, step: int) -> FadeStarted | FadeEnded | None:
    """The first fade, in the schedule's order, that is due to start (not started, its start step come)
    or to end (started, not ended, its end step come) before the step with index `step`."""
    due = bisect.bisect_right(schedule.fade_start_steps, step)  # fades whose start has come
    if due == 0:
        return None
    at = {"step": step, "tokens": schedule.tokens_of(step)}
    started, ended, order = state.fades_started, state.fades_ended, schedule.fade_boundaries
    s, e = len(started), len(ended)
    if started == order[:s] and ended == order[:e]:
        # As a run under one config has them: fades started and ended in the schedule's order, so the
        # first one not ended (e) is the next to end and the first one not started (s) the next to start.
        if e < s and e < bisect.bisect_right(schedule.fade_end_steps, step):
            return FadeEnded(**at, boundary=order[e])
        return FadeStarted(**at, boundary=order[s]) if s < due else None
    # Another config's fades on record (a ConfigChanged, a fork's seed): look at each one due.
    for ramp, end_step in zip(schedule.fades[:due], schedule.fade_end_steps, strict=False):
        if ramp.boundary not in started:
            return FadeStarted(**at, boundary=ramp.boundary)
        if ramp.boundary not in ended and end_step <= step:
            return FadeEnded(**at, boundary=ramp.boundary)
    return None


def growth_due(state: State, schedule: Schedule, step: int) -> StackAppended | None:
    """The next growth, once its step has come and (joining at a stage) its stage has been entered: so
    at a stage entry the order is StageEntered, StackAppended, then the stage's reference refresh (of
    the grown model) and optimizer reset."""
    index = state.num_growths
    if index >= len(schedule.growth_steps) or schedule.growth_steps[index] > step:
        return None
    spec = schedule.config.growth[index]
    if spec.at_stage >= 0 and spec.at_stage >= state.num_stages_entered:
        return None
    layout = current_layout(state)
    return growth_event(schedule.config, index, layout, step, schedule.tokens_of(step))


def cache_due(state: State, schedule: Schedule, step: int) -> CacheTrunk | None:
    """Caching the trunk's outputs, when training reads them and no complete cache of this trunk is on
    record (the last thing before the first step over a new trunk, so a kill while writing it resumes
    the writing)."""
    layout = current_layout(state)
    if state.activation_cache is not None or not caches_trunk(schedule.config, layout):
        return None
    num_steps = cache_span(schedule, state, step)
    if num_steps == 0:
        return None
    return CacheTrunk(layout.version, num_steps, num_steps * schedule.config.training.batch_size)


def dry_run_event(control: Control, step: int, tokens: int) -> Event:
    """The event a control transition due at `step` is recorded as where nothing is written (a dry-run,
    the planner): a CacheTrunk's ActivationsCached then has no path."""
    if isinstance(control, CacheTrunk):
        return ActivationsCached(
            step=step,
            tokens=tokens,
            version=control.version,
            num_steps=control.num_steps,
            num_rows=control.num_rows,
        )
    return control


def due_events(state: State, schedule: Schedule, step: int) -> tuple[State, list[Event]]:
    """Every control event due before step `step` in a dry-run (no checkpoints), and the state after."""
    events: list[Event] = []
    while (control := control_intent(state, schedule, step)) is not None:
        event = dry_run_event(control, step, schedule.tokens_of(step))
        events.append(event)
        state = apply(state, event)
    return state, events


def started_state(config: Config) -> tuple[RunStarted, State]:
    """The RunStarted of a new run of `config` (with this release's features) and the state after it."""
    started = RunStarted(
        step=0, tokens=0, config=config, config_hash=config_hash(config), features=list(RUN_FEATURES)
    )
    return started, apply(State(), started)


def step_lr(state: State, schedule: Schedule, step: int) -> float:
    """The LR the step with index `step` trains at, in a run at `state`: the schedule's curve under the
    run's own features (see rewind.states.lr), counted from the last optimizer reset that restarted it
    (the ABCD trainer's tx.init restarts optax's step count, so its schedule replays from its step 0,
    decay included only if the run gets that far again)."""
    reset = state.last_optimizer_reset
    count = step - reset.step if reset is not None and reset.lr_restarted else step
    curve = lr_at(
        schedule.config.optimization,
        count,
        schedule.num_steps,
        schedule.entry_steps,
        warmup_from_zero=not state.behaviours.lr_warmup_floor,
    )
    return curve * schedule.lr_scale(step)


def plan(schedule: Schedule, state: State | None = None, from_step: int = 0) -> Iterator[Event]:
    """The control events of a whole run (RunStarted excluded), from `state` at step `from_step` on."""
    if state is None:
        _, state = started_state(schedule.config)
    step = from_step
    while not state.finished:
        state, events = due_events(state, schedule, step)
        yield from events
        step = schedule.next_transition_step(step + 1)


def checkpoints_to_delete(state: State, keep_last: int) -> list[str]:
    """Retention: keep the last `keep_last`, every stage-boundary and final checkpoint (and, in runs
    started with "reference_checkpoints_kept", every one taken for a reference refresh), and whatever a
    resume would load: the restore point's checkpoint and reference as well as the current ones (right
    after a refresh the restore point still names the old reference; it goes after the next checkpoint).
    Returns names to delete, oldest first."""
    live = sorted(state.live_checkpoints, key=lambda c: c.step)
    protected = {c.checkpoint for c in live[-keep_last:]}
    # A grown run keeps them whatever release started it (growth takes them routinely).
    keep_references = state.behaviours.reference_checkpoints_kept or state.num_growths > 0
    kept = ("boundary", "final", "reference") if keep_references else ("boundary", "final")
    protected |= {c.checkpoint for c in live if c.reason in kept}
    for held in (state, state.anchor):
        if held is not None and held.reference is not None:
            protected.add(held.reference.checkpoint)
        if held is not None and held.last_checkpoint is not None:
            protected.add(held.last_checkpoint.checkpoint)
    return [c.checkpoint for c in live if c.checkpoint not in protected]
