"""Re-executing a run's steps and comparing them with its log: the proof that a run is reproducible,
or the exact step where it is not.

Replay starts from a checkpoint (or from the run's start: the initial weights are a function of the
seed), walks the *effective* log, and for every StepCommitted runs the same step through the same code
(`loop.execute_step`) and compares the recomputed event field by field (bit for bit on CPU; `rtol` for
GPU runs). At every CheckpointCommitted it also checks the live model and optimizer tensors (and a
rewind 0.1 checkpoint's copy of the reference) against the file hashes the event recorded, which works
even after retention deleted the files; the reference itself is the model of the checkpoint it names. Control events are applied as logged (a reference refresh takes the replayed weights, a config
change rebuilds the schedule and optimizer), so a window may cross resumes and in-place forks.
Nothing is written to the run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rewind.engine.checkpointing import tensor_hashes
from rewind.engine.effects import apply_effect
from rewind.engine.loop import execute_step
from rewind.engine.parts import Parts, RunError, build_parts, open_datasets
from rewind.engine.rundata import (
    DATA_ERRORS,
    DataChanged,
    check_data,
    place_of,
)
from rewind.states.compare import FieldDifference, first_difference
from rewind.states.events import CheckpointCommitted, CheckpointDeleted, RunStarted, StepCommitted
from rewind.states.fold import apply, fold
from rewind.states.history import RestorePoint, SeqEvent, config_in_force, effective, restore_points
from rewind.stores.checkpoints import CheckpointError


class ReplayError(Exception):
    """The replay cannot be done as asked. exit_code: 2 for a bad request, 1 for the run's state."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Mismatch:
    step: int  # the StepCommitted's step (or the checkpoint's) where the first difference showed
    seq: int  # the logged record's seq
    event: str  # "StepCommitted" or "CheckpointCommitted"
    difference: FieldDifference


@dataclass
class ReplayReport:
    start_checkpoint: str  # "" = the run's start
    start_step: int
    to_step: int
    num_steps: int = 0  # StepCommitted events recomputed and compared
    checkpoints_matched: list[str] = field(default_factory=list)
    mismatch: Mismatch | None = None


def choose_window(records: Sequence[SeqEvent], checkpoint: str | None) -> RestorePoint:
    """The restore point named by `checkpoint` (a name, or the step of one), or the earliest whose files
    still exist (retention deletes old ones; the run's start needs none). The run's start counts only
    when its first weights came from the seed (not for a fork, whose first weights are a checkpoint)."""
    parent = records[0][1].parent if isinstance(records[0][1], RunStarted) else None
    from_seed = parent is None or not parent.checkpoint
    has_steps = any(isinstance(e, StepCommitted) for _, e in records)
    windows: list[RestorePoint] = []
    for point in restore_points(records):
        seen = any(w.checkpoint == point.checkpoint for w in windows)
        if not seen and (point.checkpoint or (from_seed and has_steps and point.state.step == 0)):
            windows.append(point)
    deleted_names = {e.checkpoint: e.step for _, e in records if isinstance(e, CheckpointDeleted)}
    usable = [w for w in windows if w.checkpoint not in deleted_names]
    if not usable:
        raise ReplayError("the run has no steps to replay yet, or no checkpoint to start from", 1)
    if checkpoint is None:
        return usable[0]
    if checkpoint in ("start", "0") and windows[0].checkpoint == "":
        return windows[0]
    for window in windows:
        by_step = checkpoint.isdigit() and window.checkpoint and window.state.step == int(checkpoint)
        if window.checkpoint == checkpoint or by_step:
            if window.checkpoint in deleted_names:
                raise ReplayError(
                    f"checkpoint {window.checkpoint} was deleted by the retention policy at step "
                    f"{deleted_names[window.checkpoint]}; start from one of: {_names(usable)}",
                    1,
                )
            return window
    raise ReplayError(f"--from-checkpoint {checkpoint}: no checkpoint of that name or step (known: {_names(usable)})")


def _names(windows: list[RestorePoint]) -> str:
    return ", ".join(w.checkpoint or "the start (step 0)" for w in windows)


def replay(
    run_dir: str,
    records: Sequence[SeqEvent],
    *,
    from_checkpoint: str | None = None,
    to_step: int | None = None,
    rtol: float = 0.0,
    progress: Callable[[int], None] | None = None,
) -> ReplayReport:
    """Re-execute the run in `run_dir`, whose log holds `records`, from a checkpoint up to `to_step`
    (inclusive); stops at the first mismatch."""
    records = effective(records)
    window = choose_window(records, from_checkpoint)
    last_step = fold(e for _, e in records).step
    end_step = last_step if to_step is None else to_step
    if not window.state.step < end_step <= last_step:
        raise ReplayError(
            f"--to-step {end_step}: must be after the start (step {window.state.step}) and at most the last step "
            f"logged ({last_step})"
        )
    state = window.state
    config = config_in_force(records[: window.index])
    try:
        place = place_of(run_dir, state)
        changes = check_data(config, state, place)
        if changes:
            raise DataChanged(changes)
        datasets = open_datasets(config, place)
    except DataChanged as exc:
        raise ReplayError(f"{exc}; the run's data changed since it recorded it (`rewind verify --data`)", 1) from None
    except DATA_ERRORS as exc:
        raise ReplayError(str(exc), 2) from None
    try:
        parts = build_parts(config, run_dir, state, datasets)  # from the window's checkpoint, or the run's start
    except CheckpointError as exc:  # missing or damaged files: say which, never a traceback
        raise ReplayError(f"cannot load checkpoint {window.checkpoint}: {exc}", 1) from None
    report = ReplayReport(start_checkpoint=window.checkpoint, start_step=window.state.step, to_step=end_step)
    for seq, logged in records[window.index :]:
        if logged.step > end_step:
            break
        if isinstance(logged, StepCommitted):
            recomputed = execute_step(parts, state)
            report.num_steps += 1
            difference = first_difference(logged, recomputed, rtol=rtol)
            if difference is not None:
                report.mismatch = Mismatch(logged.step, seq, "StepCommitted", difference)
                return report
            state = apply(state, recomputed)
            if progress is not None:
                progress(logged.step)
            continue
        if isinstance(logged, CheckpointCommitted):
            difference = _tensor_difference(parts, logged)
            if difference is not None:
                report.mismatch = Mismatch(logged.step, seq, "CheckpointCommitted", difference)
                return report
            report.checkpoints_matched.append(logged.checkpoint)
        try:  # what the transition did to the live objects the first time (effects.py)
            parts = apply_effect(parts, state, logged)
        except RunError as exc:
            raise ReplayError(str(exc), exc.exit_code) from None
        state = apply(state, logged)
    return report


def _tensor_difference(parts: Parts, logged: CheckpointCommitted) -> FieldDifference | None:
    recomputed = tensor_hashes(parts, logged.files)
    for name in sorted(logged.files.keys() | recomputed.keys()):
        if logged.files.get(name) != recomputed.get(name):  # a group on one side only shows as None
            return FieldDifference(field=f"files.{name}", a=logged.files.get(name), b=recomputed.get(name))
    return None
