"""The training loop: ask `states` what is due, perform it, append the events, apply them.

    while not finished:
        for each control event due before step k (decide):   perform its side effect, append, apply
        run step k (schedule's rows, LR, KL weight; cursors' batch)
        append StepCommitted, apply
        after-step duties (duties_after_step): Validated, Evaluated, CheckpointCommitted (+ retention)
        commit the log (group commit at the step boundary)

A run directory with a log is resumed: the log is folded, the last committed checkpoint loaded, and a
RunResumed event supersedes whatever the dead process wrote after that checkpoint. Every input to a
step (weights, optimizer moments, reference, cursors, LR, rows) is then identical to what it was the
first time, so the resumed run is bit for bit the run that never stopped.
"""

from __future__ import annotations

import copy
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import torch
from torch import nn

from rewind.engine import snapshot
from rewind.engine.cursors import assemble_batch
from rewind.engine.datasets import DatasetRegistry
from rewind.engine.evaluation import evaluate, validate
from rewind.engine.model import GPT
from rewind.engine.step import train_step
from rewind.states.config import Config
from rewind.states.events import (
    CheckpointCommitted,
    CheckpointDeleted,
    Evaluated,
    Event,
    NonFiniteLoss,
    ReferenceRefreshed,
    RunFinished,
    RunStopped,
    StepCommitted,
    Validated,
)
from rewind.states.fold import apply
from rewind.states.plan import checkpoints_to_delete, decide, duties_after_step, reference_checkpoint
from rewind.states.schedule import Schedule
from rewind.states.state import State, control_summary
from rewind.stores.checkpoints import CheckpointStore
from rewind.stores.eventlog import EventLog
from rewind.stores.metrics import MetricsProjection

replace = msgspec.structs.replace


@dataclass
class Parts:
    """The live objects of a run. The control state is not here: it is `fold(events)`."""

    config: Config
    schedule: Schedule
    model: GPT
    optimizer: torch.optim.Optimizer
    datasets: DatasetRegistry
    log: EventLog
    store: CheckpointStore
    metrics: MetricsProjection | None
    reference: nn.Module | None = None
    param_names: dict[nn.Parameter, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    status: str  # "finished" | "stopped" (step limit) | "interrupted" (Ctrl-C) | "nonfinite"
    state: State
    message: str = ""


class StopRequest:
    """Ctrl-C once: finish the step in flight, checkpoint, stop. Twice: stop at once (nothing half-done
    is committed either way)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def __enter__(self) -> StopRequest:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except ValueError:  # not the main thread: no handler, plain KeyboardInterrupt semantics
            self._previous = None
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def build_model(config: Config) -> GPT:
    return GPT(config.architecture, seed=config.run.seed)


def frozen_copy(model: nn.Module) -> nn.Module:
    reference = copy.deepcopy(model)
    reference.eval()
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    return reference


def emit(parts: Parts, state: State, event: Event) -> State:
    """Append an event to the log (buffered until the next commit) and apply it."""
    new_state = apply(state, event)
    parts.log.append(event)
    if parts.metrics is not None:
        parts.metrics.observe(event)
    return new_state


def checkpoint_groups(parts: Parts) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """The tensors a checkpoint holds, per group, and the optimizer's layout metadata."""
    groups = {"model": snapshot.model_tensors(parts.model)}
    optimizer_tensors, optimizer_meta = snapshot.optimizer_tensors(parts.optimizer, parts.param_names)
    groups["optimizer"] = optimizer_tensors
    if parts.reference is not None:
        groups["reference"] = snapshot.model_tensors(parts.reference)
    return groups, optimizer_meta


def save_checkpoint(parts: Parts, state: State, reason: str) -> State:
    """Write, sync and rename the checkpoint, then announce it; then apply the retention policy."""
    groups, optimizer_meta = checkpoint_groups(parts)
    meta = {
        "optimizer": optimizer_meta,
        "stack_sizes": parts.model.stack_sizes,
        # The control state the tensors belong to; `rewind verify` checks it against the fold.
        "control": control_summary(state),
    }
    written = parts.store.write(state.step, groups, meta)
    state = emit(
        parts,
        state,
        CheckpointCommitted(
            step=state.step,
            tokens=state.tokens,
            checkpoint=written.name,
            manifest_sha256=written.manifest_sha256,
            files=written.files,
            reason=reason,
        ),
    )
    parts.log.commit()  # a checkpoint counts once this record is durable, not before
    doomed = checkpoints_to_delete(state, parts.config.logging.keep_last_checkpoints)
    for name in doomed:
        state = emit(parts, state, CheckpointDeleted(step=state.step, tokens=state.tokens, checkpoint=name))
    if doomed:
        parts.log.commit()
        for name in doomed:  # deleted only once the deletion is on record: a crash leaves an orphan
            parts.store.delete(name)
    return state


def load_checkpoint(parts: Parts, state: State) -> None:
    ref = state.last_checkpoint
    assert ref is not None
    groups = parts.store.load(ref.checkpoint, ref.files)
    snapshot.load_model_tensors(parts.model, groups["model"])
    meta = parts.store.load_manifest(ref.checkpoint).meta
    snapshot.load_optimizer_tensors(parts.optimizer, parts.param_names, groups["optimizer"], meta["optimizer"])
    if "reference" in groups:
        reference = build_model(parts.config)
        snapshot.load_model_tensors(reference, groups["reference"])
        parts.reference = frozen_copy(reference)


def perform_control_events(parts: Parts, state: State, step: int) -> State:
    while (event := decide(state, parts.schedule, step)) is not None:
        if isinstance(event, ReferenceRefreshed):
            held = reference_checkpoint(state)
            if held is None:  # e.g. a refresh before the first step: take a checkpoint to point at
                state = save_checkpoint(parts, state, "reference")
                held = state.last_checkpoint
            event = replace(event, checkpoint=held.checkpoint)
            parts.reference = frozen_copy(parts.model)
        state = emit(parts, state, event)
        if isinstance(event, RunFinished):
            break
    return state


def execute_step(parts: Parts, state: State) -> StepCommitted:
    """Run the step with index state.step (update included unless the loss is non-finite) and return
    the event that commits it; `skipped` says the update was withheld. `rewind replay` calls this too,
    so a re-execution is the very code path that produced the log."""
    config, k = parts.config, state.step
    plan = parts.schedule.step_plan(k)
    tokens, mask, cursors, _ = assemble_batch(config.run.seed, config, plan.rows, state.cursors, parts.datasets)
    result = train_step(
        parts.model,
        parts.optimizer,
        tokens,
        mask,
        config=config,
        lr=plan.lr,
        beta=plan.beta,
        reference=parts.reference,
        step=k,
    )
    return StepCommitted(
        step=k + 1,
        tokens=(k + 1) * parts.schedule.tokens_per_step,
        stage=plan.stage,
        lr=plan.lr,
        beta=plan.beta,
        loss=result.loss,
        kl=result.kl,
        grad_norm=result.grad_norm,
        rows=list(plan.rows),
        cursors=cursors,
        skipped=not result.finite,
    )


def run_one_step(parts: Parts, state: State) -> tuple[State, bool]:
    """Run the step with index state.step; returns (state, keep_going)."""
    config = parts.config
    committed = execute_step(parts, state)
    if committed.skipped:
        action = config.training.on_nonfinite
        state = emit(parts, state, NonFiniteLoss(step=state.step, tokens=state.tokens, loss=committed.loss, action=action))
        if action == "stop":
            return state, False
    state = emit(parts, state, committed)
    duties = duties_after_step(state, parts.schedule)
    if duties.validate:
        losses = validate(parts.model, parts.datasets, config, state.step)
        state = emit(parts, state, Validated(step=state.step, tokens=state.tokens, losses=losses))
    if duties.evaluate_boundary is not None:
        scores, losses = evaluate(parts.model, parts.datasets, config)
        state = emit(
            parts,
            state,
            Evaluated(
                step=state.step, tokens=state.tokens, boundary=duties.evaluate_boundary, scores=scores, losses=losses
            ),
        )
    if duties.checkpoint_reason is not None:
        state = save_checkpoint(parts, state, duties.checkpoint_reason)
    return state, True


def stop(parts: Parts, state: State, reason: str) -> State:
    """A clean, resumable stop: checkpoint the last complete step unless one exists, say why."""
    if state.last_checkpoint is None or state.last_checkpoint.step != state.step:
        state = save_checkpoint(parts, state, "stop")
    state = emit(parts, state, RunStopped(step=state.step, tokens=state.tokens, reason=reason))
    parts.log.commit()
    return state


def drive(
    parts: Parts,
    state: State,
    *,
    max_steps: int | None = None,
    progress: Callable[[State], None] | None = None,
) -> Outcome:
    """Run until the end, a stop request, a non-finite loss (with on_nonfinite = "stop") or
    `max_steps` steps in this process."""
    steps_here = 0
    with StopRequest() as stop_request:
        while True:
            state = perform_control_events(parts, state, state.step)
            if state.finished:
                parts.log.commit()
                return Outcome("finished", state)
            if stop_request.requested:
                state = stop(parts, state, "interrupted (Ctrl-C)")
                return Outcome("interrupted", state, f"stopped after step {state.step}; run the same command to resume")
            if max_steps is not None and steps_here >= max_steps:
                state = stop(parts, state, f"step limit of {max_steps} for this process")
                return Outcome("stopped", state, f"stopped after step {state.step} (--max-steps)")
            state, keep_going = run_one_step(parts, state)
            if not keep_going:
                last = state.last_checkpoint
                message = (
                    f"non-finite loss at step {state.step + 1}; the run stopped at the last good checkpoint "
                    f"({last.checkpoint if last else 'none'}, step {last.step if last else 0}). "
                    'Fork it with a changed config (--fork), or set training.on_nonfinite = "skip"'
                )
                state = emit(parts, state, RunStopped(step=state.step, tokens=state.tokens, reason="non-finite loss"))
                parts.log.commit()
                return Outcome("nonfinite", state, message)
            steps_here += 1
            if state.step % parts.config.logging.report_interval == 0:
                # Group commit: step records become durable report_interval at a time. That loses
                # nothing a resume needs (it restarts from the last checkpoint, whose record is
                # committed on the spot) and keeps fsync off the per-step path.
                parts.log.commit()
                if parts.metrics is not None:
                    parts.metrics.flush()
            if progress is not None:
                progress(state)
