"""A distill stage in the engine (rewind.engine.step.kinds): on-policy distillation.

Before the first step of each window the student (the run's model) samples group_size completions of
each prompt at the cursors (rewind.engine.posttrain.rollouts), and the batch goes on record exactly as a
grpo stage's does, in the same file format: its "rewards" row is the teacher's mean log-prob of each
completion's tokens (how the teacher rates it; the record's mean_reward is their mean), "old_logprobs"
the student's and "reference_logprobs" the teacher's per-token log-probs of the sampled tokens, and no
advantages (zeros). A resume inside the window reads the batch back and samples nothing.

Each update is the per-token reverse KL(student || teacher) over the vocabulary at every completion
token (rewind.engine.posttrain.distill_losses), token mean over the step's micro-batches and ranks.

The teacher is the run's KL reference (`distill.teacher = "reference"`: the weights a stage at or before
this one refreshed it to, named on record by ReferenceRefreshed), or a directory holding a
`model.safetensors` of the run's architecture as a run starts (`rewind export` writes one), resolved
beside the config first. Its sha256 goes on each RolloutsRecorded (`teacher`); a resume or fork inside
a window under a teacher whose file changed is refused, and one whose tensors do not fit is refused
before anything is recorded.
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
from rewind.engine.posttrain.rolloutreader import off_rows, training_rows
from rewind.engine.posttrain.rollouts import kept, logprobs_of, rank_slices, sample_window
from rewind.engine.step.kinds import KindError, KindSpec
from rewind.engine.step.step import StepResult, apply_update, compute_precision
from rewind.states.events import RolloutsRecorded
from rewind.states.plan import rollout_settings
from rewind.states.stagekinds.distill import REFERENCE_TEACHER
from rewind.stores.rollouts import RolloutError, read_rollouts

if TYPE_CHECKING:
    from rewind.engine.data.registry import DatasetRegistry
    from rewind.engine.run.parts import Parts
    from rewind.states.config import Config
    from rewind.states.schedule import StepPlan
    from rewind.states.stages import DistillStage
    from rewind.states.state import State

TEACHER_FILE = "model.safetensors"


def teacher_file(stage: DistillStage, base_dir: str | None) -> Path:
    """The teacher's weights file: `distill.teacher`/model.safetensors, a relative path beside the config
    first, then in the working directory."""
    given = Path(stage.distill.teacher).expanduser()
    beside = Path(base_dir) / given if base_dir and not given.is_absolute() else None
    directory = beside if beside is not None and beside.exists() else given
    return directory / TEACHER_FILE if directory.is_dir() else directory


def load_teacher(config: Config, path: Path) -> tuple[nn.Module, str]:
    """(the teacher, placed and in eval mode, sha256 of its file), from a safetensors file of the run's
    architecture as a run starts; KindError (one line) when it is missing or does not fit."""
    from safetensors import SafetensorsError
    from safetensors.torch import load

    try:
        data = path.read_bytes()
        tensors = load(data)
    except (OSError, SafetensorsError) as exc:
        raise KindError(f"distill.teacher: cannot read {path}: {exc}", 2) from None
    model = build_model(config, None)
    try:
        load_model_tensors(model, tensors)
    except TensorFitError as exc:
        raise KindError(f"distill.teacher: {path} is not a model of this run's architecture: {exc}", 2) from None
    return eval_mode(place(model, config)), hashlib.sha256(data).hexdigest()


def teacher_of(parts: Parts, stage: DistillStage) -> tuple[nn.Module, str]:
    """The stage's teacher and its identity on record ("" for the run's reference), loaded once a process."""
    if stage.distill.teacher == REFERENCE_TEACHER:
        assert parts.reference is not None  # the config rule: a refresh at or before the stage
        return parts.reference, ""
    path = teacher_file(stage, parts.datasets.home.base_dir)
    held = parts.kind_state.get("teacher")
    if held is None or held[0] != path:
        held = (path, *load_teacher(parts.config, path))
        parts.kind_state["teacher"] = held
    return held[1], held[2]


class DistillSpec(KindSpec):
    def check(self, stage: DistillStage, datasets: DatasetRegistry, base_dir: str | None) -> None:
        super().check(stage, datasets, base_dir)
        if stage.distill.teacher != REFERENCE_TEACHER:  # its file reads and fits, before anything is recorded
            load_teacher(datasets.config, teacher_file(stage, base_dir))

    def check_held(self, parts: Parts, state: State) -> None:
        held, stage = state.rollouts, parts.config.stages[state.stage]
        if held is None or held.stage != state.stage:
            return
        _, teacher = teacher_of(parts, stage)
        if teacher != held.teacher:
            raise KindError(
                f"{parts.run_dir}: distill.teacher {stage.distill.teacher!r} is not the teacher that scored the "
                f"batch of step {held.step} (sha256 {held.teacher[:12] or 'the reference'}, now "
                f"{teacher[:12] or 'the reference'}): restore it, or fork from before the window",
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
        lengths = tensors["completion_lengths"].clamp(min=1).to(torch.float32)
        tensors["rewards"] = (tensors["reference_logprobs"].sum(dim=1) / lengths).unsqueeze(0)
        metadata = {"reward_functions": "teacher", "group_size": str(group), "policy_step": str(state.step)}
        path, sha256 = kept(parts, tensors, metadata, keep)
        return RolloutsRecorded(
            step=state.step, tokens=state.tokens, stage=stage_index, path=path, sha256=sha256,
            num_prompts=sampled.num_prompts, group_size=group, cursors=sampled.cursors,
            mean_reward=float(tensors["rewards"].mean()), settings=rollout_settings(config, stage_index),
            teacher=identity,
        )  # fmt: skip

    def train(self, parts: Parts, state: State, plan: StepPlan, lr: float) -> tuple[StepResult, dict[str, int]]:
        stage, record = parts.config.stages[plan.stage], state.rollouts
        if record is None:  # the plan samples before any step of a window: unreachable in a run
            raise RuntimeError(f"step {state.step} of a distill stage has no rollout batch on record")
        held = parts.kind_state.get("rollouts")
        if held is None or held[0] != record.sha256:
            tensors, _ = read_rollouts(parts.run_dir, record.path, record.sha256)
            held = (record.sha256, _rows(tensors, parts.config, parts.datasets.examples))
            parts.kind_state["rollouts"] = held
        teacher, _ = teacher_of(parts, stage)
        result = distill_train_step(parts.model, parts.optimizer, teacher, held[1].tokens, held[1].mask, parts.config, lr)
        return result, state.cursors  # the prompts moved the cursors when the batch was sampled


def _rows(tensors: dict[str, torch.Tensor], config: Config, examples):
    """The batch's training rows (prompt + completion, the completion tokens masked in); RolloutError for
    a batch no run of this config writes (a token outside the vocabulary, a row past the context)."""
    vocab = config.architecture.vocab_size
    if any(t.numel() and not 0 <= int(t.min()) <= int(t.max()) < vocab for t in (tensors["prompts"], tensors["completions"])):
        raise RolloutError(f"a rollout batch holds a token outside the vocabulary [0, {vocab})")
    try:
        return training_rows(
            tensors, end_id=examples.end_id, pad_id=examples.pad_id, block_size=config.architecture.block_size,
            drop_truncated=False,
        )  # fmt: skip
    except ValueError as exc:
        raise RolloutError(f"a rollout batch no run writes: {exc}") from None


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
