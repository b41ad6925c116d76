"""The training loop: ask `states` what is due, perform it, record the event, apply its effect.

    while (intent := decide(state, schedule)) is not None:
        event(s) = perform(intent)        the step's losses, a validation, a checkpoint written, ...
                                          (a control transition that is its event is recorded as it is)
        state = journal.record(state, e)  append (+ commit when the durability rule says so), apply
        parts = apply_effect(parts, state before, state after, e)
                                          what the transition does to the live objects (effects.py)

`decide` (rewind.states.plan) is pure: everything the loop does is a function of the folded state, so a
run resumed from any checkpoint asks for exactly what the run that never stopped did next. A resumed
process gets here with live objects built from the folded state (parts.build_parts), and then every
input to a step (weights, optimizer moments, reference, cursors, LR, rows) is what it was the first
time: the resumed run is bit for bit the run that never stopped.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass

from rewind.engine.data.cursors import epochs_started
from rewind.engine.data.rundata import check_unchanged
from rewind.engine.model.placement import launched_world_size
from rewind.engine.model.ranks import any_rank, check_same_state, is_writer, lost_peer, shared_event
from rewind.engine.run.checkpointing import write_checkpoint
from rewind.engine.run.effects import apply_effect
from rewind.engine.run.journal import Journal
from rewind.engine.run.trunkcache import write_cache
from rewind.engine.step.evaluation import evaluate, validate
from rewind.engine.step.kinds import posttraining_figures, spec_of
from rewind.engine.step.live import Parts
from rewind.engine.step.step import nonfinite_quantity
from rewind.states.events import (
    CheckpointDeleted,
    EpochStarted,
    Evaluated,
    Event,
    NonFiniteLoss,
    RunStopped,
    StackAppended,
    StepCommitted,
    Validated,
)
from rewind.states.plan import (
    CacheTrunk,
    DeleteCheckpoints,
    Evaluate,
    Intent,
    RunStep,
    SampleRollouts,
    TakeCheckpoint,
    Validate,
    decide,
    step_lr,
)
from rewind.states.state import CheckpointReason, State
from rewind.stores.folding import save_snapshot


@dataclass
class Run:
    """A run being driven: its live objects and the journal that records what happens to them."""

    parts: Parts
    journal: Journal


# Updates withheld for a non-finite loss (on_nonfinite = "skip"), as a share of the run's steps: more
# than SKIPPED_WARNING_SHARE gets a warning in the outcome's message, more than SKIPPED_FAILURE_SHARE at
# the end makes the outcome "nonfinite" (see `skipped_verdict`).
SKIPPED_WARNING_SHARE = 0.1
SKIPPED_FAILURE_SHARE = 0.5


@dataclass(frozen=True)
class Outcome:
    status: str  # "finished" | "stopped" (step limit) | "interrupted" (Ctrl-C) | "nonfinite"
    state: State
    message: str = ""  # for the user; with "finished", a warning (or "")
    num_skipped_updates: int = 0  # over the whole run (every process), not only this one


def skipped_verdict(state: State) -> tuple[bool, str]:
    """(failed, warning) for the updates the run skipped so far: state.num_skipped_steps of its
    state.step steps. More than SKIPPED_WARNING_SHARE (10%) of them skipped: a warning naming the count.
    More than SKIPPED_FAILURE_SHARE (half): failed, since the weights are then mostly not what the
    schedule trained, and a run that ends so must not exit 0 ("nonfinite", exit 1), though every step
    is on record and the run is finished. At most 10% skipped: (False, "")."""
    skipped, steps = state.num_skipped_steps, state.step
    if steps == 0 or skipped <= SKIPPED_WARNING_SHARE * steps:
        return False, ""
    failed = skipped > SKIPPED_FAILURE_SHARE * steps
    warning = (
        f"{skipped} of {steps} updates ({skipped / steps:.0%}) were skipped for a non-finite loss "
        f'(training.on_nonfinite = "skip")'
    )
    if failed:
        warning += ": more than half, so the weights are mostly untrained; see `rewind log --type NonFiniteLoss`"
    return failed, warning


def _with_warning(outcome: Outcome) -> Outcome:
    failed, warning = skipped_verdict(outcome.state)
    skipped = outcome.state.num_skipped_steps
    if outcome.status == "finished" and failed:
        return Outcome("nonfinite", outcome.state, f"the run finished, but {warning}", skipped)
    message = "; ".join(part for part in (outcome.message, warning) if part)
    return Outcome(outcome.status, outcome.state, message, skipped)


class StopRequest:
    """Ctrl-C once: finish the step in flight, checkpoint, stop. Twice: stop at once (nothing half-done
    is committed either way)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None
        self._previous_term = None

    def __enter__(self) -> StopRequest:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
            if launched_world_size() > 1:
                # torchrun passes a SIGTERM on to every rank: the same clean stop as Ctrl-C, agreed by
                # all ranks at the next step boundary (`any_rank`), so none waits for a peer that left.
                self._previous_term = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no handler, plain KeyboardInterrupt semantics
            self._previous = None
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, kind, value, traceback) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if self._previous_term is not None:
            # Leaving because a peer is gone: the launcher SIGTERMs the ranks left as soon as one dies,
            # and that must not cut the one line this rank is about to say (the process ends right after
            # it: with the peer gone, no collective can hold it; torchrun kills it if it does not).
            peer_gone = value is not None and isinstance(value, Exception) and bool(lost_peer(value))
            signal.signal(signal.SIGTERM, signal.SIG_IGN if peer_gone else self._previous_term)


def record(run: Run, state: State, event: Event) -> State:
    """Record an event and give it its effect on the live objects: the only way a run changes state
    (an illegal event raises in the journal, before anything is written or changed)."""
    new_state = run.journal.record(state, event)
    run.parts = apply_effect(run.parts, state, new_state, event)
    return new_state


def checkpoint(run: Run, state: State, reason: CheckpointReason) -> State:
    # The data the steps read is still what the run opened: else it stops here, the steps since the
    # last commit are never committed, and no checkpoint vouches for them.
    check_unchanged(run.parts.datasets.home, state.step)
    run.journal.commit()  # everything before the checkpoint is durable before its files exist (journal)
    check_same_state(state)  # a sharded run's ranks still agree on what the checkpoint belongs to
    committed = write_checkpoint(run.parts, state, reason, log_seq=run.journal.durable_seq())
    before, last = state, run.journal.last_event  # the fold up to the record before the checkpoint's
    state = record(run, state, committed)
    if is_writer() and last is not None:  # the record is committed (journal) and vouches for the fold
        # before it: cache that, so that a resume costs the tail (it starts only from a vouched snapshot)
        save_snapshot(run.parts.run_dir, before, last, run.parts.config)
    return state


def delete_checkpoints(run: Run, state: State, names: tuple[str, ...]) -> State:
    at = {"step": state.step, "tokens": state.tokens}
    for name in names:
        state = record(run, state, CheckpointDeleted(**at, checkpoint=name))
    if is_writer():  # (rank 0 owns the files of a sharded run)
        for name in names:  # the files go only once the deletions are on record: a crash leaves an orphan
            run.parts.store.delete(name)
    return state


def execute_step(parts: Parts, state: State) -> StepCommitted:
    """Run the step with index state.step (update included unless the loss is non-finite) and return
    the event that commits it; `skipped` says the update was withheld. `rewind replay` calls this too,
    so a re-execution is the very code path that produced the log."""
    config, k = parts.config, state.step
    plan = parts.schedule.step_plan(k)
    lr = step_lr(state, parts.schedule, k)  # the run's own curve: its features, its restarts
    # The primary stage's kind steps (a dpo, grpo or distill stage is never faded: all rows are its own).
    result, cursors = spec_of(config.stages[plan.stage]).train(parts, state, plan, lr)
    return StepCommitted(
        step=k + 1,
        tokens=(k + 1) * parts.schedule.tokens_per_step,
        stage=plan.stage,
        lr=lr,
        beta=plan.beta,
        loss=result.loss,
        kl=result.kl,
        grad_norm=result.grad_norm,
        rows=list(plan.rows),
        cursors=cursors,
        skipped=not result.finite,
        metrics=result.metrics,
    )


def run_one_step(run: Run, state: State) -> tuple[State, bool]:
    """Run the step with index state.step; returns (state, keep_going)."""
    committed = execute_step(run.parts, state)
    if committed.skipped:
        action = run.parts.config.training.on_nonfinite
        quantity = nonfinite_quantity(committed.loss, committed.kl, committed.grad_norm)
        at = {"step": state.step, "tokens": state.tokens}
        state = record(run, state, NonFiniteLoss(**at, loss=committed.loss, action=action, quantity=quantity))
        if action == "stop":
            return state, False
    # A dataset read past its last train row begins a new epoch: on record (with the step that read
    # it, so a step that is not committed begins none), never silently.
    for name, epoch in epochs_started(state.cursors, committed.cursors, run.parts.datasets):
        state = record(run, state, EpochStarted(step=state.step, tokens=state.tokens, dataset=name, epoch=epoch))
    return record(run, state, committed), True


def perform(run: Run, state: State, intent: Intent) -> State:
    """Do what `intent` asks (all but the step itself) and record the event(s) it makes: a control
    transition that is its event is recorded as it is."""
    parts, at = run.parts, {"step": state.step, "tokens": state.tokens}
    match intent:
        case Validate():
            return record(run, state, Validated(**at, losses=validate(parts.model, parts.datasets, parts.config, state.step)))
        case Evaluate(boundary=boundary):
            result = evaluate(parts.model, parts.datasets, parts.config, parts.datasets.home.token_num_bytes())
            # Bits per byte for running text; a task's or a response's figure is its accuracy.
            bits = {name: b for name, b in result.bits_per_byte.items() if not parts.datasets[name].has_answers}
            evaluated = Evaluated(
                **at, boundary=boundary, scores=result.scores, losses=result.losses, bits_per_byte=bits,
                posttraining=posttraining_figures(parts, boundary),
            )  # fmt: skip
            return record(run, state, evaluated)
        case TakeCheckpoint(reason=reason):
            return checkpoint(run, state, reason)
        case DeleteCheckpoints(names=names):
            return delete_checkpoints(run, state, names)
        case CacheTrunk():
            return record(run, state, write_cache(parts, state, intent))
        case SampleRollouts(stage=stage):  # every rank samples (collective forwards); rank 0's record
            sampled = spec_of(parts.config.stages[stage]).sample(parts, state, stage)
            return record(run, state, shared_event(sampled if is_writer() else None))
    return record(run, state, intent)


def pause_note(intent: Intent) -> str:
    """What a progress bar says while `intent` is performed, for the ones that can take seconds (a
    checkpoint of a large model, an evaluation over every task, a growth, the trunk's activations); ""
    for the quick ones."""
    match intent:
        case Validate():
            return "validating"
        case Evaluate(boundary=boundary):
            return "evaluating before training" if boundary < 0 else f"evaluating at the end of stage {boundary}"
        case TakeCheckpoint():
            return "writing a checkpoint"
        case StackAppended(num_blocks=num_blocks):
            return f"growing the model: {num_blocks} block(s) join"
        case CacheTrunk():
            return "caching the trunk's activations"
        case SampleRollouts():
            return "sampling rollouts"
    return ""


def stop(run: Run, state: State, reason: str) -> State:
    """A clean, resumable stop: checkpoint the last complete step unless one exists, say why."""
    if state.last_checkpoint is None or state.last_checkpoint.step != state.step:
        state = checkpoint(run, state, "stop")
    return record(run, state, RunStopped(step=state.step, tokens=state.tokens, reason=reason))


def drive(
    run: Run,
    state: State,
    *,
    max_steps: int | None = None,
    progress: Callable[[State], None] | None = None,
    pausing: Callable[[str], None] | None = None,
) -> Outcome:
    """Run until the end, a stop request, a non-finite loss (with on_nonfinite = "stop") or
    `max_steps` steps in this process. `progress` is called after each step, `pausing` before any
    other work that may take a while (with `pause_note`'s words). The outcome counts the updates the
    run skipped, and warns or fails by `skipped_verdict`."""
    quiet = pausing or (lambda _: None)
    return _with_warning(_drive(run, state, max_steps=max_steps, progress=progress, pausing=quiet))


def _drive(
    run: Run,
    state: State,
    *,
    max_steps: int | None,
    progress: Callable[[State], None] | None,
    pausing: Callable[[str], None],
) -> Outcome:
    steps_here = 0
    with StopRequest() as stop_request:
        while (intent := decide(state, run.parts.schedule)) is not None:
            if not isinstance(intent, RunStep):
                if note := pause_note(intent):
                    pausing(note)
                state = perform(run, state, intent)
                continue
            run.journal.at_step_boundary(state)
            if any_rank(stop_request.requested):  # the ranks of a sharded run stop together, after the same step
                pausing("stopping: writing a checkpoint")
                state = stop(run, state, "interrupted (Ctrl-C)")
                return Outcome("interrupted", state, f"stopped after step {state.step}; run the same command to resume")
            if max_steps is not None and steps_here >= max_steps:
                pausing("stopping: writing a checkpoint")
                state = stop(run, state, f"step limit of {max_steps} for this process")
                return Outcome("stopped", state, f"stopped after step {state.step} (--max-steps)")
            state, keep_going = run_one_step(run, state)
            if not keep_going:
                last = state.last_checkpoint
                message = (
                    f"non-finite loss at step {state.step + 1}; the run stopped at the last good checkpoint "
                    f"({last.checkpoint if last else 'none'}, step {last.step if last else 0}). "
                    'Fork it with a changed config (--fork), or set training.on_nonfinite = "skip"'
                )
                state = record(run, state, RunStopped(step=state.step, tokens=state.tokens, reason="non-finite loss"))
                return Outcome("nonfinite", state, message)
            steps_here += 1
            if progress is not None:
                progress(state)
    return Outcome("finished", state)
