"""Re-executing a run's steps and comparing them with its log: the proof that a run is reproducible,
or the exact step where it is not.

Replay starts from a checkpoint (or from the run's start: the initial weights are a function of the
seed), walks the *effective* log, and for every StepCommitted runs the same step through the same code
(`loop.execute_step`) and compares the recomputed event field by field (bit for bit on CPU; `rtol` for
GPU runs). At every CheckpointCommitted it also checks the live model, optimizer and reference
tensors against the file hashes the event recorded, which works even after retention deleted the
files. Control events are applied as logged (a reference refresh takes the replayed weights, a config
change rebuilds the schedule and optimizer), so a window may cross resumes and in-place forks.
Nothing is written to the run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rewind.engine import snapshot
from rewind.engine.loop import (
    Parts,
    build_model,
    checkpoint_groups,
    execute_step,
    frozen_copy,
    load_checkpoint,
)
from rewind.engine.session import make_parts, open_datasets
from rewind.states.compare import FieldDifference, first_difference
from rewind.states.config import Config
from rewind.states.events import (
    CheckpointCommitted,
    CheckpointDeleted,
    ConfigChanged,
    ReferenceRefreshed,
    RunResumed,
    RunStarted,
    StackAppended,
    StepCommitted,
)
from rewind.states.fold import apply, fold
from rewind.states.history import SeqEvent, anchor_end, config_in_force, effective
from rewind.stores.checkpoints import group_file


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


@dataclass(frozen=True)
class Window:
    """Where a replay starts (index into the effective records, just after the anchor and the records
    that belong to it) and the checkpoint it loads ("" = fresh weights from the seed)."""

    begin: int
    checkpoint: str
    step: int


def checkpoint_anchors(records: Sequence[SeqEvent]) -> list[Window]:
    """Every point of the effective history a replay can start from, in order. The run's start is one
    when its first weights came from the seed (not for a fork, whose first weights are a checkpoint)."""
    parent = records[0][1].parent if isinstance(records[0][1], RunStarted) else None
    from_seed = parent is None or not parent.checkpoint
    windows = [Window(1, "", 0)] if from_seed and any(isinstance(e, StepCommitted) for _, e in records) else []
    for i, (_, event) in enumerate(records):
        anchors = isinstance(event, CheckpointCommitted | RunResumed) and event.checkpoint
        if anchors and not any(w.checkpoint == event.checkpoint for w in windows):
            windows.append(Window(anchor_end(records, i), event.checkpoint, event.step))
    return windows


def choose_window(records: Sequence[SeqEvent], checkpoint: str | None) -> Window:
    """The anchor named by `checkpoint` (a name, or the step of one), or the earliest whose checkpoint
    files still exist (retention deletes old ones; the run's start needs none)."""
    deleted_names = {e.checkpoint: e.step for _, e in records if isinstance(e, CheckpointDeleted)}
    windows = checkpoint_anchors(records)
    usable = [w for w in windows if w.checkpoint not in deleted_names]
    if not usable:
        raise ReplayError("the run has no steps to replay yet, or no checkpoint to start from", 1)
    if checkpoint is None:
        return usable[0]
    if checkpoint in ("start", "0") and windows[0].checkpoint == "":
        return windows[0]
    for window in windows:
        by_step = checkpoint.isdigit() and window.checkpoint and window.step == int(checkpoint)
        if window.checkpoint == checkpoint or by_step:
            if window.checkpoint in deleted_names:
                raise ReplayError(
                    f"checkpoint {window.checkpoint} was deleted by the retention policy at step "
                    f"{deleted_names[window.checkpoint]}; start from one of: {_names(usable)}",
                    1,
                )
            return window
    raise ReplayError(f"--from-checkpoint {checkpoint}: no checkpoint of that name or step (known: {_names(usable)})")


def _names(windows: list[Window]) -> str:
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
    if not window.step < end_step <= last_step:
        raise ReplayError(
            f"--to-step {end_step}: must be after the start (step {window.step}) and at most the last step logged "
            f"({last_step})"
        )
    state = fold(e for _, e in records[: window.begin])
    parts = _parts(run_dir, config_in_force(records[: window.begin]))
    if window.checkpoint:
        try:
            load_checkpoint(parts, state)
        except Exception as exc:  # missing or damaged files: say which, never a traceback
            raise ReplayError(f"cannot load checkpoint {window.checkpoint}: {exc}", 1) from None
    report = ReplayReport(start_checkpoint=window.checkpoint, start_step=window.step, to_step=end_step)
    fresh = not window.checkpoint  # weights straight from the seed: no step has touched them yet
    for seq, logged in records[window.begin :]:
        if logged.step > end_step:
            break
        if isinstance(logged, StepCommitted):
            fresh = False
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
        elif isinstance(logged, ReferenceRefreshed):
            parts.reference = frozen_copy(parts.model)
        elif isinstance(logged, RunResumed) and not logged.checkpoint:
            fresh = True  # a restart from scratch: the seed's weights again
            parts = _rebuild(run_dir, parts, parts.config, fresh=True)
        elif isinstance(logged, ConfigChanged):
            parts = _rebuild(run_dir, parts, logged.config, fresh=fresh)
        elif isinstance(logged, StackAppended):
            raise ReplayError(f"step {logged.step}: replaying model growth (StackAppended) is not supported yet", 1)
        state = apply(state, logged)
    return report


def _parts(run_dir: str, config: Config) -> Parts:
    # No log and no metrics: replay never writes to the run.
    return make_parts(config, run_dir, None, False, open_datasets(config))  # type: ignore[arg-type]


def _rebuild(run_dir: str, parts: Parts, config: Config, *, fresh: bool) -> Parts:
    """What a resume does: model, optimizer and reference built for `config` (dropout, seed and the
    optimizer's settings come from it), then loaded with the tensors the run had unless it restarts
    from scratch. The tensors are the checkpoint's: the replay checked them against its hashes."""
    rebuilt = _parts(run_dir, config)
    if fresh:
        return rebuilt
    snapshot.load_model_tensors(rebuilt.model, snapshot.model_tensors(parts.model))
    moments, layout = snapshot.optimizer_tensors(parts.optimizer, parts.param_names)
    snapshot.load_optimizer_tensors(rebuilt.optimizer, rebuilt.param_names, moments, layout)
    if parts.reference is not None:
        reference = build_model(config)
        snapshot.load_model_tensors(reference, snapshot.model_tensors(parts.reference))
        rebuilt.reference = frozen_copy(reference)
    return rebuilt


def _tensor_difference(parts: Parts, logged: CheckpointCommitted) -> FieldDifference | None:
    groups, _ = checkpoint_groups(parts)
    recomputed = dict(group_file(group, tensors) for group, tensors in groups.items())
    for name in sorted(logged.files.keys() | recomputed.keys()):
        if logged.files.get(name) != recomputed.get(name):  # a group on one side only shows as None
            return FieldDifference(field=f"files.{name}", a=logged.files.get(name), b=recomputed.get(name))
    return None


