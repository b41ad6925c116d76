"""One step of a grpo stage: an update on the rollout batch of its window (rewind.engine.posttrain.grpo_rollouts).

The batch is read from the file the state's RolloutsRecorded names (rewind.engine.posttrain.rolloutreader, kept
while the window lasts), so a step is a function of the folded state and the weights, as any other step is: a
resume inside a window reads the same batch and samples nothing. The policy's per-token log-probs come
through the path the old ones did (the same micro-batches, no dropout, the sampling temperature); the
loss is `rewind.engine.posttrain.grpo_losses.grpo_loss` with its normaliser counted once over the step's every
micro-batch, so accumulation changes no figure. Metrics on record (docs/posttraining.md, "Figures"): the
batch's mean reward over its scored completions and the count of unscored ones, the importance-weighted
KL estimate per completion token (with a reference), the shares of tokens the clip held at each side and
the completion tokens per row. A run started before those reward and KL figures (the feature
scored_reward_figures, rewind.states.features) logs the ones it always has: the mean reward with the
unscored counted as 0, no count, and the plain mean of the KL estimate (`WindowRows.scored_figures`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from rewind.engine.model.layout import eval_mode
from rewind.engine.model.optimizer import AdamW
from rewind.engine.model.placement import is_sharded, placement_for
from rewind.engine.model.ranks import sum_over_ranks
from rewind.engine.posttrain.grpo_losses import grpo_loss, grpo_normaliser, reward_figures, weighted_rewards
from rewind.engine.posttrain.rolloutreader import RolloutReader, TrainingRows
from rewind.engine.posttrain.rollouts import rank_slices, slice_logprobs
from rewind.engine.step.step import StepResult, apply_update
from rewind.states.config import Config, Stage
from rewind.states.state import State

if TYPE_CHECKING:
    from rewind.engine.step.live import Parts


@dataclass(frozen=True)
class WindowRows(TrainingRows):
    """A window's training rows, and which figures its run logs: `scored_figures` is the run's feature
    scored_reward_figures (False: a run started before it; rows built elsewhere are figured as today)."""

    scored_figures: bool = True


def window_rows(parts: Parts, state: State) -> WindowRows:
    """The training rows of the rollout batch the state's grpo window updates on (read once per window)."""
    config, examples = parts.config, parts.datasets.examples
    reader = parts.kind_state.setdefault("grpo batch", RolloutReader())
    rows = reader.rows(
        parts.run_dir, state, config, end_id=examples.end_id, pad_id=examples.pad_id,
        block_size=config.architecture.block_size,
        drop_truncated=config.stages[state.stage].grpo.mask_truncated_completions,
    )  # fmt: skip
    held = {field.name: getattr(rows, field.name) for field in dataclasses.fields(rows)}
    return WindowRows(**held, scored_figures=state.behaviours.scored_reward_figures)


def grpo_train_step(
    model: nn.Module, optimizer: AdamW, batch: TrainingRows, *, config: Config, stage: Stage, lr: float
) -> StepResult:
    """Forward/backward over micro-batches of the rollout batch's rows, clip, and (if finite) one update.
    The figures are the run's (module doc): today's unless `batch` is a WindowRows that says otherwise."""
    settings = stage.grpo
    scored = batch.scored_figures if isinstance(batch, WindowRows) else True
    device = next(model.parameters()).device
    inputs, targets = batch.tokens[:, :-1].to(device), batch.tokens[:, 1:].to(device)
    mask, advantages = batch.mask.to(device), batch.advantages.to(device)
    assert batch.old_logprobs is not None  # written with every rollout batch
    old = batch.old_logprobs.to(device)
    reference = None if batch.reference_logprobs is None else batch.reference_logprobs.to(device)
    slices = rank_slices(batch.tokens.shape[0], config)[placement_for(config).rank]  # this process's rows
    # Completion-aligned masks (each row's completion tokens first) for the normaliser: its dr_grpo form
    # counts max_new_tokens a row, the others count the masked tokens; counted here, summed over the ranks.
    aligned = torch.arange(settings.max_new_tokens, device=device) < mask.sum(dim=1)[:, None]
    here = grpo_normaliser([aligned[rows] for rows in slices], settings.loss_type, settings.max_new_tokens)
    (normaliser,) = sum_over_ranks([here])
    eval_mode(model)  # no dropout: the old log-probs were computed without it (module doc)
    optimizer.zero_grad(set_to_none=True)
    total = kl = low = high = counted = 0.0
    sharded = is_sharded(model)
    for index, rows in enumerate(slices):
        if sharded:  # gradients are reduced over the ranks once, after the last micro-batch
            model.set_requires_gradient_sync(index == len(slices) - 1)  # type: ignore[operator]
        logprobs = slice_logprobs(model, inputs, targets, mask, rows, config, settings.temperature)
        out = grpo_loss(
            logprobs, old[rows], None if reference is None else reference[rows], advantages[rows], mask[rows],
            loss_type=settings.loss_type, epsilon_low=settings.epsilon_low, epsilon_high=settings.epsilon_high,
            normaliser=normaliser, kl_beta=settings.kl_beta, kl_estimator=settings.kl_estimator,
        )  # fmt: skip
        out.loss.backward()
        total += float(out.loss.detach())
        kl += float(out.kl_sum if scored else out.plain_kl_sum)
        low, high = low + float(out.clipped_low), high + float(out.clipped_high)
        counted += float(out.num_tokens)
    model.train()
    total, kl, low, high, counted = sum_over_ranks([total, kl, low, high, counted])  # the same on every rank
    grad_norm, finite = apply_update(model, optimizer, config, lr, (total, kl))
    per_token = max(counted, 1.0)
    rewards = weighted_rewards(batch.rewards, [r.weight for r in settings.rewards])
    reward, unscored = reward_figures(rewards, scored_figures=scored)
    metrics = {"reward": reward, **({"unscored": float(unscored)} if scored else {})}
    metrics |= {
        "kl": kl / per_token,
        "clipped_low": low / per_token,
        "clipped_high": high / per_token,
        "completion_tokens": counted / batch.tokens.shape[0],
    }
    return StepResult(
        loss=total, kl=kl / per_token, grad_norm=grad_norm, num_correct=0,
        num_target_tokens=int(counted), finite=finite, metrics=metrics,
    )  # fmt: skip
