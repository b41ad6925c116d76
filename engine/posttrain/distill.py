"""A distill stage in the engine (rewind.engine.step.kinds): on-policy distillation.

Before the first step of each window the student (the run's model) samples group_size completions of
each prompt at the cursors (rewind.engine.posttrain.rollouts), and the batch goes on record exactly as a
grpo stage's does, in the same file format: its "rewards" row is the teacher's mean log-prob of each
completion's tokens (how the teacher rates it; the record's mean_reward is their mean), "old_logprobs"
the student's and "reference_logprobs" the teacher's per-token log-probs of the sampled tokens, and no
advantages (zeros). A resume inside the window reads the batch back and samples nothing.

A file's hash only says it is the one its record names; `rollout_problems` says it is a distill batch a
run could have written: its shape the record's and the stage's, token ids within the vocabulary, prompts
within the context, completions ended by their first end token or cut at max_new_tokens, log-probs 0 past
each completion, no advantages, the rewards row and the record's mean exactly what the teacher's log-probs
make of them (`teacher_rewards`), the record's teacher of the stage's kind. The window's steps read the
batch through it, so a resume checks it before it records anything, as `rewind verify` does
(`batch_problem`). The log-probs themselves need the models' forwards: the file's sha256 vouches for them.

Each update is the per-token reverse KL(student || teacher) over the vocabulary at every completion
token (rewind.engine.posttrain.distill_losses), token mean over the step's micro-batches and ranks.

The teacher is the run's KL reference (`distill.teacher = "reference"`: the weights a stage at or before
this one refreshed it to, named on record by ReferenceRefreshed), or a directory holding a
`model.safetensors` of the run's architecture as a run starts (`rewind export` writes one), resolved
beside the config first, then in the working directory. Its sha256 goes on each RolloutsRecorded
(`teacher`); once the stage holds a batch, a resume, fork or replay under a teacher whose file changed is
refused in one line (a config that names another teacher samples the window's batch again instead), and
a teacher that is missing or does not fit is refused before anything is recorded.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from rewind.engine.model.layout import build_model, eval_mode
from rewind.engine.model.placement import is_sharded, place, placement_for
from rewind.engine.model.ranks import sum_over_ranks
from rewind.engine.model.tensors import TensorFitError, load_model_tensors
from rewind.engine.posttrain.distill_losses import reverse_kl
from rewind.engine.posttrain.rolloutreader import (
    TrainingRows,
    content_problems,
    first_problem,
    off_rows,
    run_end_id,
    same_float,
    shape_problems,
    training_rows,
)
from rewind.engine.posttrain.rollouts import kept, logprobs_of, rank_slices, sample_window
from rewind.engine.step.kinds import KindError, KindSpec
from rewind.engine.step.step import StepResult, apply_update, compute_precision
from rewind.states.events import RolloutsRecorded
from rewind.states.plan import rollout_settings, rollouts_due
from rewind.states.stagekinds.distill import REFERENCE_TEACHER
from rewind.states.stages import DistillStage
from rewind.stores.rollouts import RolloutError, read_rollouts

if TYPE_CHECKING:
    from rewind.engine.data.registry import DatasetRegistry
    from rewind.engine.step.live import Parts
    from rewind.states.config import Config
    from rewind.states.features import Features
    from rewind.states.schedule import StepPlan
    from rewind.states.state import State

TEACHER_FILE = "model.safetensors"
TEACHER_ROW = "teacher"  # the batch's one row of "rewards" (its metadata's reward_functions)


def teacher_file(stage: DistillStage, base_dir: str | None) -> Path:
    """The teacher's weights file: `distill.teacher`/model.safetensors, a relative path beside the config
    first, then in the working directory."""
    try:
        given = Path(stage.distill.teacher).expanduser()
        places = [Path(base_dir) / given] if base_dir and not given.is_absolute() else []
        places.append(given)
        directory = next((place for place in places if place.exists()), places[0])  # none: the first looked in
        return directory / TEACHER_FILE if directory.is_dir() else directory
    except (RuntimeError, ValueError, OSError) as exc:  # "~nosuchuser/...", a NUL, a name too long
        raise KindError(f"distill.teacher: {stage.distill.teacher!r} names no file this machine has: {exc}", 2) from None


def teacher_weights(config: Config, path: Path) -> tuple[nn.Module, str]:
    """(the teacher on the CPU, sha256 of its file), from a safetensors file of the run's architecture as a
    run starts, hashed from the very bytes loaded; KindError (one line) when it is missing or does not fit."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        data = path.read_bytes()
        tensors = load(data)
    except (OSError, ValueError) as exc:  # (ValueError: a name no file can have, a NUL in it)
        raise KindError(
            f"distill.teacher: cannot read {path}: {getattr(exc, 'strerror', None) or exc} (a directory holding {TEACHER_FILE}, "
            "beside the config or in the working directory)",
            2,
        ) from None
    except SafetensorError as exc:
        raise KindError(f"distill.teacher: {path} is not a safetensors file: {exc}", 2) from None
    model = build_model(config, None)
    try:
        load_model_tensors(model, tensors)
    except TensorFitError as exc:
        raise KindError(f"distill.teacher: {path} is not a model of this run's architecture: {exc}", 2) from None
    return model.requires_grad_(False), hashlib.sha256(data).hexdigest()


def teacher_of(parts: Parts, stage: DistillStage) -> tuple[nn.Module, str]:
    """The stage's teacher, placed and in eval mode, and its identity on record ("" for the run's
    reference), loaded once a process."""
    if stage.distill.teacher == REFERENCE_TEACHER:
        assert parts.reference is not None  # the config rule: a refresh at or before the stage
        return parts.reference, ""
    path = teacher_file(stage, parts.datasets.home.base_dir)
    held = parts.kind_state.get("teacher")
    if held is None or held[0] != path:
        model, sha256 = teacher_weights(parts.config, path)
        held = (path, eval_mode(place(model, parts.config)), sha256)
        parts.kind_state["teacher"] = held
    return held[1], held[2]


def teacher_rewards(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The batch's (1, N) "rewards" row: each completion's mean teacher log-prob over its tokens."""
    lengths = tensors["completion_lengths"].clamp(min=1).to(torch.float32)
    return (tensors["reference_logprobs"].sum(dim=1) / lengths).unsqueeze(0)


def _teacher_name(identity: str) -> str:
    return f"the file of sha256 {identity[:12]}" if identity else "the run's KL reference"


class DistillSpec(KindSpec):
    def check(self, stage: DistillStage, datasets: DatasetRegistry, base_dir: str | None) -> None:
        super().check(stage, datasets, base_dir)
        if stage.distill.teacher != REFERENCE_TEACHER:  # its file reads and fits, before anything is recorded
            teacher_weights(datasets.config, teacher_file(stage, base_dir))

    def check_held(self, parts: Parts, state: State) -> None:
        held, stage = state.rollouts, parts.config.stages[state.stage]
        if held is None or held.stage != state.stage:
            return
        if not rollouts_due(state, parts.schedule, state.step):  # the batch the next steps read, checked now:
            window_rows(parts, state)  # before a resume records anything
        if held.settings not in ("", rollout_settings(parts.config, state.stage)):
            return  # shaped otherwise now (a fork in place): sampled again at once, by the teacher named now
        _, teacher = teacher_of(parts, stage)
        if teacher != held.teacher:
            named = teacher_file(stage, parts.datasets.home.base_dir) if teacher else REFERENCE_TEACHER
            entry = parts.schedule.stage_entry_step(held.stage)  # before its first batch: no batch of the stage
            raise KindError(
                f"{parts.run_dir}: distill.teacher {str(named)!r} is {_teacher_name(teacher)}, not "
                f"{_teacher_name(held.teacher)}, which scored the batch of step {held.step}: restore that teacher, "
                f"or go on under this one in a fork from the stage's start, `rewind fork {parts.run_dir} --at-step "
                f"{entry} NEW_RUN`",
                1,
            )

    def sample(self, parts: Parts, state: State, stage_index: int, *, keep: bool = True) -> RolloutsRecorded:
        config, examples = parts.config, parts.datasets.examples
        stage = config.stages[stage_index]
        settings, group = stage.distill, stage.distill.group_size
        sampled = sample_window(
            parts, state, stage_index, group=group, max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
        )  # fmt: skip
        count = len(sampled.completions)
        tensors = {**sampled.tensors, "advantages": torch.zeros(count), "rewards": torch.zeros(1, count)}
        rows = _rows(tensors, config, examples)
        teacher, identity = teacher_of(parts, stage)
        width = settings.max_new_tokens
        for name, model in (("old_logprobs", parts.model), ("reference_logprobs", teacher)):
            tensors[name] = off_rows(logprobs_of(model, rows.tokens, rows.mask, config, 1.0), rows.mask, width)
        tensors["rewards"] = teacher_rewards(tensors)
        metadata = {"reward_functions": TEACHER_ROW, "group_size": str(group), "policy_step": str(state.step)}
        path, sha256 = kept(parts, tensors, metadata, keep)
        return RolloutsRecorded(
            step=state.step, tokens=state.tokens, stage=stage_index, path=path, sha256=sha256,
            num_prompts=sampled.num_prompts, group_size=group, cursors=sampled.cursors,
            mean_reward=float(tensors["rewards"].mean()), settings=rollout_settings(config, stage_index),
            teacher=identity,
        )  # fmt: skip

    def resampled(self, parts: Parts, state: State, logged: RolloutsRecorded) -> RolloutsRecorded:
        # Scored by another teacher, a batch differs from its record: say why rather than where.
        _, teacher = teacher_of(parts, parts.config.stages[logged.stage])
        if teacher != logged.teacher:
            raise KindError(
                f"distill.teacher is {_teacher_name(teacher)}, not {_teacher_name(logged.teacher)}, which scored "
                f"the batch of step {logged.step}; replay scores it again with the teacher here, which cannot "
                "reproduce the run: restore that teacher to replay it",
                1,
            )
        return self.sample(parts, state, logged.stage, keep=False)

    def train(self, parts: Parts, state: State, plan: StepPlan, lr: float) -> tuple[StepResult, dict[str, int]]:
        rows, (teacher, _) = window_rows(parts, state), teacher_of(parts, parts.config.stages[plan.stage])
        result = distill_train_step(parts.model, parts.optimizer, teacher, rows.tokens, rows.mask, parts.config, lr)
        return result, state.cursors  # the prompts moved the cursors when the batch was sampled

    def batch_problem(
        self, run_dir: str, record: RolloutsRecorded, config: Config, end_id: int | None, features: Features | None
    ) -> str:
        return batch_problem(run_dir, record, config, end_id, features)


def window_rows(parts: Parts, state: State) -> TrainingRows:
    """The training rows of the batch the state's window updates on, read once per window and checked
    first (`rollout_problems`): RolloutError, one line with the way forward."""
    record, run_dir = state.rollouts, parts.run_dir
    if record is None:  # the plan samples before any step of a window: unreachable in a run
        raise RuntimeError(f"step {state.step} of a distill stage has no rollout batch on record")
    held = parts.kind_state.get("distill batch")
    if held is None or held[0] != record.sha256:
        tensors, metadata = read_rollouts(run_dir, record.path, record.sha256)
        config, examples = parts.config, parts.datasets.examples
        if problems := rollout_problems(tensors, metadata, record, config, examples.end_id):
            raise RolloutError(
                f"{run_dir}: {record.path}: not a batch a run writes: {first_problem(problems)}; nothing trains on it: "
                f"go on in a fork from before its window, `rewind fork {run_dir} --at-step {record.step} NEW_RUN`"
            )
        held = (record.sha256, _rows(tensors, config, examples))
        parts.kind_state["distill batch"] = held
    return held[1]


def rollout_problems(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], record: RolloutsRecorded, config: Config, end_id: int | None
) -> list[str]:
    """Every rule of the module doc the batch (tensors and metadata as rewind.stores.rollouts read them, its
    format checked) breaks, given its record and the config in force when it was recorded ([] if none).
    `end_id`: the run's end token (None: the rules about it are not checked)."""
    stages = config.stages
    if not 0 <= record.stage < len(stages) or not isinstance(stages[record.stage], DistillStage):
        return [f"its record names stage {record.stage}, not a distill stage of the run's config"]
    settings = stages[record.stage].distill
    problems = shape_problems(tensors, metadata, record, config, settings.group_size, settings.max_new_tokens, TEACHER_ROW)
    if "reference_logprobs" not in tensors:
        problems.append("no reference_logprobs: a distill batch holds the teacher's log-probs")
    if (settings.teacher == REFERENCE_TEACHER) != (not record.teacher):
        problems.append(
            f"its record's teacher is {_teacher_name(record.teacher)}, but the stage's distill.teacher is "
            f"{settings.teacher!r}"
        )
    if problems:
        return problems  # the rules below read the batch as the stage shapes it
    problems += content_problems(tensors, config, settings.max_new_tokens, end_id)
    lengths = tensors["completion_lengths"]
    past = torch.arange(settings.max_new_tokens).unsqueeze(0) >= lengths.unsqueeze(1)
    for name in ("old_logprobs", "reference_logprobs"):
        if bool((tensors[name][past] != 0).any()):
            problems.append(f"its {name} hold a value past a completion's end (0 there)")
    rewards, stored = teacher_rewards(tensors), tensors["rewards"]
    same = rewards.shape == stored.shape and bool(
        ((rewards.view(torch.int32) == stored.view(torch.int32)) | (rewards.isnan() & stored.isnan())).all()
    )
    if not same:
        problems.append("its rewards are not each completion's mean teacher log-prob (reference_logprobs)")
    elif not same_float(float(rewards.mean()), record.mean_reward) or record.unscored:
        problems.append(
            f"its record's mean_reward {record.mean_reward!r} ({record.unscored} unscored) is not its rewards' "
            f"{float(rewards.mean())!r} (none unscored)"
        )
    if bool((tensors["advantages"].view(torch.int32) != 0).any()):
        problems.append("it holds advantages: a distill batch's are 0")
    return problems


def batch_problem(
    run_dir: str, record: RolloutsRecorded, config: Config, end_id: int | None = None, features: Features | None = None
) -> str:
    """Why the rollout file a distill stage's `record` names is not a batch a run writes ("" if it is):
    missing, damaged or not in the format (rewind.stores.rollouts), or a rule of `rollout_problems` broken;
    what a resume checks (`window_rows`), for `rewind verify` and `rewind rollouts`. `end_id`: the run's end
    token (None: `run_end_id`); `features`: the run's behaviours (no figure of a distill batch depends on
    them: the signature of rewind.engine.posttrain.rolloutreader.batch_problem)."""
    try:
        tensors, metadata = read_rollouts(run_dir, record.path, record.sha256)
    except RolloutError as exc:
        return str(exc)
    end = run_end_id(run_dir) if end_id is None else end_id
    if problems := rollout_problems(tensors, metadata, record, config, end):
        return f"{record.path}: not a batch a run writes: {first_problem(problems)}"
    return ""


def _rows(tensors: dict[str, torch.Tensor], config: Config, examples) -> TrainingRows:
    """The batch's training rows (prompt + completion, the completion tokens masked in; a batch
    `rollout_problems` passed, or one just sampled)."""
    return training_rows(
        tensors, end_id=examples.end_id, pad_id=examples.pad_id, block_size=config.architecture.block_size,
        drop_truncated=False,
    )  # fmt: skip


def distill_train_step(
    model: nn.Module, optimizer, teacher: nn.Module, tokens: torch.Tensor, mask: torch.Tensor, config: Config, lr: float
) -> StepResult:
    """Forward/backward of the reverse KL over this process's micro-batches, clip, and (if finite) one
    update; the normaliser is the step's completion tokens over every rank."""
    device = next(model.parameters()).device
    inputs, mask = tokens[:, :-1].to(device), mask.to(device)
    slices = rank_slices(tokens.shape[0], config)[placement_for(config).rank]
    (normaliser,) = sum_over_ranks([float(sum(mask[rows].sum() for rows in slices))])
    eval_mode(model)  # no dropout: the KL compares two distributions, not a noisy one
    optimizer.zero_grad(set_to_none=True)
    total = counted = 0.0
    sharded = is_sharded(model)
    for index, rows in enumerate(slices):
        if sharded:  # gradients are reduced over the ranks once, after the last micro-batch
            model.set_requires_gradient_sync(index == len(slices) - 1)  # type: ignore[operator]
        with compute_precision(config, device):
            student = model(inputs[rows])
            with torch.no_grad():
                taught = teacher(inputs[rows])
        loss, _ = reverse_kl(student, taught, mask[rows], max(normaliser, 1.0))
        loss.backward()
        total += float(loss.detach())
        counted += float(mask[rows].sum())
    model.train()
    total, counted = sum_over_ranks([total, counted])  # the same on every rank
    grad_norm, finite = apply_update(model, optimizer, config, lr, (total,))
    metrics = {"completion_tokens": counted / tokens.shape[0]}
    return StepResult(
        loss=total, kl=total, grad_norm=grad_norm, num_correct=0, num_target_tokens=int(counted), finite=finite,
        metrics=metrics,
    )  # fmt: skip


SPEC = DistillSpec()
