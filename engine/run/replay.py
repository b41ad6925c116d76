"""Re-executing a run's steps and comparing them with its log: the proof that a run is reproducible,
or the exact step where it is not.

Replay starts from a checkpoint (or from the run's start: the initial weights are a function of the
seed), walks the *effective* log, and for every StepCommitted runs the same step through the same code
(`loop.execute_step`) and compares the recomputed event field by field (bit for bit on CPU; `rtol` for
GPU runs). At every CheckpointCommitted it also checks the live model and optimizer tensors (and a
rewind 0.1 checkpoint's copy of the reference) against the checkpoint: with rtol == 0 against the file
hashes the event recorded, which works even after retention deleted the files; with rtol > 0 against
the files' values (a hash can only say "not the same bits"), or, once retention deleted them, against
the hashes, a checkpoint whose bits differ then being reported as not compared. The reference itself
is the model of the checkpoint it names. Control events are applied as logged (a reference refresh
takes the replayed weights, a config change rebuilds the schedule and optimizer), so a window may cross
resumes and in-place forks. Nothing is written to the run. Its start point, the config in force there,
where it computes and its last step are decided as every entry's are (rewind.states.entry.decide), and the
live objects built by rewind.engine.run.entry.enter, which reads the log once.

Within a tolerance, a checkpoint matches when each of its tensors does, as a whole: ||live - logged|| <=
rtol * ||logged|| + ATOL * sqrt(numel) (2-norms over the tensor's finite elements; NaN and inf must sit at
the same places; integer tensors compare exactly). Not element by element: Adam turns noise in a gradient
element near zero into an update of about lr whatever the noise's size (m / sqrt(v) is then a ratio of
two noisy near-zeros), so elements of a run computed on another device differ by large relative amounts
while its losses and grad norms agree to rtol; measured on the tiny run with every weight nudged by 1e-7
per step, steps agree within 1e-5 and tensors within 6e-6 by norm, but elementwise they need 1.3e-5 even
with an atol of rtol * the tensor's largest |value|, and 2e-4 with rtol * its mean. ATOL is for a tensor
that is (nearly) zero as a whole, which gives rtol nothing to be relative to: the Adam moments of
parameters that got no gradient yet, exactly 0 on one device and denormal-sized on another. It sits far
below any moment that matters (squared gradients of 1e-8 are 1e-16).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rewind.engine.model.placement import adopt_threads
from rewind.engine.model.tensors import model_tensors
from rewind.engine.run.checkpointing import checkpoint_groups, tensor_hashes
from rewind.engine.run.effects import apply_effect
from rewind.engine.run.entry import Entered
from rewind.engine.run.loop import execute_step
from rewind.engine.run.parts import Parts, RunError
from rewind.engine.step.kinds import KindError, spec_of
from rewind.states.compare import FieldDifference, first_difference
from rewind.states.diffing import ComputeSite, compute_site
from rewind.states.entry import deleted_checkpoints
from rewind.states.events import CheckpointCommitted, RolloutsRecorded, StepCommitted
from rewind.states.fold import apply
from rewind.states.state import State
from rewind.stores.checkpoints import SUFFIX, CheckpointError, CheckpointNotFound


class ReplayError(Exception):
    """The replay cannot be done as asked. exit_code: 2 for a bad request, 1 for the run's state."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


ATOL = 1e-20  # per element (see the module docstring)


@dataclass(frozen=True)
class TensorDifference:
    """The worst tensor of a checkpoint compared within a tolerance: the one furthest outside it."""

    file: str  # "optimizer.safetensors"
    tensor: str  # "state.stacks.0.blocks.0.attn.qkv.weight.exp_avg_sq"
    relative_difference: float  # ||live - logged|| / ||logged||, what rtol bounds (inf: NaNs or ints differ)
    difference_norm: float  # ||live - logged||
    logged_norm: float  # ||logged||
    index: list[int]  # the element that differs most in absolute terms (its values are the mismatch's)
    max_abs_difference: float
    num_different: int  # elements whose values differ at all
    num_elements: int


@dataclass(frozen=True)
class Mismatch:
    step: int  # the StepCommitted's step (or the checkpoint's) where the first difference showed
    seq: int  # the logged record's seq
    event: str  # "StepCommitted" or "CheckpointCommitted"
    difference: FieldDifference
    tensor: TensorDifference | None = None  # a checkpoint compared by value (rtol > 0)


@dataclass
class ReplayReport:
    start_checkpoint: str  # "" = the run's start
    start_step: int
    to_step: int
    num_steps: int = 0  # StepCommitted events recomputed and compared
    checkpoints_matched: list[str] = field(default_factory=list)
    # rtol > 0 only: checkpoints whose files retention deleted and whose hashes differ from the live
    # tensors' (different bits may still be within the tolerance: nothing left to tell).
    checkpoints_not_compared: list[str] = field(default_factory=list)
    # Where the compared steps were computed as the log records it (RunStarted, each RunResumed):
    # ("cpu", 1) unless a run recorded otherwise.
    computed_on: list[ComputeSite] = field(default_factory=list)
    # grpo rollout batches sampled again and compared with their records (rtol 0 only: within a
    # tolerance, another device may draw other tokens, so the records are taken as they are).
    num_rollouts: int = 0
    mismatch: Mismatch | None = None


def replay(
    entered: Entered, *, rtol: float = 0.0, progress: Callable[[int], None] | None = None
) -> ReplayReport:
    """Re-execute the window a replay entered (rewind.engine.run.entry.enter of a states.entry.Replay: its
    start point, the live objects built there as the run computed them, its last step), comparing every
    step and checkpoint with the log; stops at the first mismatch."""
    entry, records, parts = entered.entry, entered.view.records, entered.parts
    point, end_step = entry.point, entry.to_step
    assert point is not None and parts is not None
    state = point.state
    report = ReplayReport(start_checkpoint=point.checkpoint, start_step=point.state.step, to_step=end_step)
    _note_site(report, state)
    deleted = deleted_checkpoints(records)
    for seq, logged in records[point.index :]:
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
        if isinstance(logged, RolloutsRecorded) and rtol == 0:
            # Sampled again from the same weights and keys: the same tokens make the same file name.
            try:
                resampled = spec_of(parts.config.stages[logged.stage]).resampled(parts, state, logged)
            except KindError as exc:
                raise ReplayError(str(exc), exc.exit_code) from None
            report.num_rollouts += 1
            difference = first_difference(logged, resampled)
            if difference is not None:
                report.mismatch = Mismatch(logged.step, seq, "RolloutsRecorded", difference)
                return report
        if isinstance(logged, CheckpointCommitted):
            compared = (
                (_tensor_difference(parts, logged), None)
                if rtol == 0
                else _compare_within(parts, logged, rtol, deleted_on_record=logged.checkpoint in deleted)
            )
            if compared is None:
                report.checkpoints_not_compared.append(logged.checkpoint)
            elif compared[0] is not None:
                report.mismatch = Mismatch(logged.step, seq, "CheckpointCommitted", *compared)
                return report
            else:
                report.checkpoints_matched.append(logged.checkpoint)
        after = apply(state, logged)
        try:  # what the transition did to the live objects the first time (effects.py)
            parts = apply_effect(parts, state, after, logged)
        except RunError as exc:
            raise ReplayError(str(exc), exc.exit_code) from None
        state = after
        _note_site(report, state)  # a RunResumed may go on elsewhere, or in another number of processes
        adopt_threads(state.num_threads)
    return report


def _note_site(report: ReplayReport, state: State) -> None:
    site = compute_site(state.device, state.world_size)
    if site not in report.computed_on:
        report.computed_on.append(site)


def _tensor_difference(parts: Parts, logged: CheckpointCommitted) -> FieldDifference | None:
    recomputed = tensor_hashes(parts, logged.files)
    for name in sorted(logged.files.keys() | recomputed.keys()):
        if logged.files.get(name) != recomputed.get(name):  # a group on one side only shows as None
            return FieldDifference(field=f"files.{name}", a=logged.files.get(name), b=recomputed.get(name))
    return None


# --- checkpoints within a tolerance ---------------------------------------------------------------------


def _compare_within(
    parts: Parts, logged: CheckpointCommitted, rtol: float, *, deleted_on_record: bool
) -> tuple[FieldDifference | None, TensorDifference | None] | None:
    """(difference, worst tensor) of the live tensors against the checkpoint's files by value, both None
    when they are within `rtol`; None when retention deleted the files and the bits differ (not compared)."""
    live = _live_groups(parts, logged.files)  # only groups the checkpoint has: one it lacks shows here
    for file in sorted(logged.files):
        if file.removesuffix(SUFFIX) not in live:  # e.g. adapters the replayed model does not have
            return FieldDifference(field=f"files.{file}", a=logged.files[file], b=None), None
    worst: TensorDifference | None = None
    found: FieldDifference | None = None
    for file in sorted(logged.files):
        group = file.removesuffix(SUFFIX)
        try:
            saved = parts.store.load(logged.checkpoint, logged.files, groups=[group])[group]
        except CheckpointNotFound:
            if not deleted_on_record:
                raise ReplayError(
                    f"checkpoint {logged.checkpoint} is not on disk, yet the log never deleted it: it cannot be "
                    "compared within a tolerance (`rewind verify`; --rtol 0 compares the recorded hashes)",
                    1,
                ) from None
            exact = _tensor_difference(parts, logged) is None  # the same bits are within any tolerance
            return (None, None) if exact else None
        except CheckpointError as exc:
            raise ReplayError(f"cannot read checkpoint {logged.checkpoint} to compare it: {exc}", 1) from None
        difference, tensor = compare_tensors(file, saved, live[group], rtol)
        if difference is not None and tensor is None:
            return difference, None  # names, dtypes or shapes differ: no tolerance applies
        if tensor is not None and (worst is None or _excess(tensor, rtol) > _excess(worst, rtol)):
            worst, found = tensor, difference
    return found, worst


def _live_groups(parts: Parts, files: dict[str, str]) -> dict[str, dict[str, torch.Tensor]]:
    """What a checkpoint of the live objects would hold, for the groups `files` names (tensor_hashes'
    groups, before hashing)."""
    groups, _ = checkpoint_groups(parts)
    if parts.reference is not None and f"reference{SUFFIX}" in files:
        groups["reference"] = model_tensors(parts.reference)  # rewind 0.1 checkpoints hold it
    return {group: tensors for group, tensors in groups.items() if f"{group}{SUFFIX}" in files}


def compare_tensors(
    file: str, logged: dict[str, torch.Tensor], live: dict[str, torch.Tensor], rtol: float
) -> tuple[FieldDifference | None, TensorDifference | None]:
    """The first tensor named on one side only or differing in dtype or shape (difference, None); else
    the tensor furthest outside the tolerance (see the module's docstring), with the values of its most
    different element as the difference; (None, None) when every tensor is within it."""
    for name in sorted(logged.keys() | live.keys()):
        where = f"files.{file}[{name}]"
        if name not in logged or name not in live:
            shown = [_kind(t[name]) if name in t else None for t in (logged, live)]
            return FieldDifference(field=where, a=shown[0], b=shown[1]), None
        if logged[name].dtype != live[name].dtype or logged[name].shape != live[name].shape:
            return FieldDifference(field=where, a=_kind(logged[name]), b=_kind(live[name])), None
    worst: TensorDifference | None = None
    found: FieldDifference | None = None
    for name in sorted(logged):
        outcome = tensor_difference(name, file, logged[name], live[name])
        if outcome is None or _within(outcome, rtol):
            continue
        if worst is None or _excess(outcome, rtol) > _excess(worst, rtol):
            values = [t[tuple(outcome.index)].item() for t in (logged[name], live[name])]
            worst, found = outcome, FieldDifference(field=f"files.{file}[{name}]", a=values[0], b=values[1])
    return found, worst


def _kind(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"


def _within(found: TensorDifference, rtol: float) -> bool:
    return found.difference_norm <= _allowed(found, rtol)


def _excess(found: TensorDifference, rtol: float) -> float:
    """How many times the allowed difference the tensor's difference is: what makes one tensor worse."""
    allowed = _allowed(found, rtol)
    return found.difference_norm / allowed if allowed > 0 else math.inf


def _allowed(found: TensorDifference, rtol: float) -> float:
    return rtol * found.logged_norm + ATOL * math.sqrt(found.num_elements)


def tensor_difference(name: str, file: str, logged: torch.Tensor, live: torch.Tensor) -> TensorDifference | None:
    """How two tensors of one dtype and shape differ; None when their values are equal (NaN equal to NaN).
    Integer and bool tensors (counts, masks) that differ at all are infinitely far apart."""
    if not logged.is_floating_point():
        different = logged != live
        if not different.any():
            return None
        index = [int(i) for i in torch.nonzero(different)[0]] if logged.dim() else []
        return TensorDifference(
            file, name, math.inf, math.inf, 0.0, index, math.inf, int(different.sum()), logged.numel()
        )
    wide = torch.float64  # sums of squares of a large tensor: float32 would lose the small differences
    a, b = logged.to(wide), live.to(wide)
    finite = torch.isfinite(a) & torch.isfinite(b)
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))  # also inf == inf
    different = ~same
    if not different.any():
        return None
    delta = torch.where(finite, (a - b).abs(), 0.0)
    flat = int(torch.where(different & ~finite, math.inf, delta).reshape(-1).argmax())
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)] if a.dim() else []
    logged_norm = float(torch.linalg.vector_norm(torch.where(finite, a, 0.0)))
    difference_norm = float(torch.linalg.vector_norm(delta))
    max_abs_difference = float(delta.max())
    if not bool((finite | same).all()):  # a NaN or inf on one side only: no tolerance covers it
        difference_norm = max_abs_difference = math.inf
    relative = difference_norm / logged_norm if logged_norm > 0 else math.inf
    return TensorDifference(
        file, name, relative, difference_norm, logged_norm, index, max_abs_difference, int(different.sum()), a.numel()
    )
