"""One step of a `dpo` stage: `batch_size` prompt/chosen/rejected examples, the policy's and the reference's
summed log-probabilities of each response, the stage's DPO loss (rewind.engine.posttrain.dpo_losses), one update.

The examples are read as an sft stage's are: each dataset of the mixture its share (split_rows) at its
cursor, through the keyed permutation, so a resume reads the same pairs. Both forwards run without
dropout (a dropout mask would make the log-ratios noise at initialisation: policy = reference must give
exactly 0), through the same code path (`sequence_logprobs` of the model's logits, the "logits" path
whatever compute.loss_kernel says: the loss needs each response's log-probabilities). Micro-batches are
slices of pairs (chosen and rejected together); each divides its sum by the step's pair count, and the
SFT term by the step's chosen token count, so accumulation changes no figure. Under torchrun each rank
takes its share of the pairs (the batch is read whole on every rank) and the figures are summed over the
ranks before the record is built.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from rewind.engine.data.example_batches import RowBatch, preference_batch
from rewind.engine.data.example_sources import ExampleSources, mixture_rows
from rewind.engine.model.layout import eval_mode
from rewind.engine.model.optimizer import AdamW
from rewind.engine.model.placement import is_sharded, placement_for
from rewind.engine.model.ranks import sum_over_ranks
from rewind.engine.posttrain.dpo_losses import dpo_loss
from rewind.engine.posttrain.response_logprobs import sequence_logprobs, token_counts
from rewind.engine.step.kinds import KindSpec
from rewind.engine.step.step import StepResult, apply_update, compute_precision, micro_batches
from rewind.states.config import Config, Stage

if TYPE_CHECKING:
    from rewind.engine.step.live import Parts
    from rewind.states.schedule import StepPlan
    from rewind.states.state import State

# The figures a dpo step records (StepCommitted.metrics), means over the step's pairs.
METRICS = ("chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards", "margin", "accuracy", "sft_loss")


def preference_rows(
    config: Config, stage: Stage, pairs: int, cursors: Mapping[str, int], examples: ExampleSources
) -> tuple[RowBatch, dict[str, int]]:
    """The step's pairs as [chosen rows; rejected rows] (2 * pairs rows) and the cursors after them."""
    read, after = mixture_rows(config.run.seed, stage, pairs, cursors, examples, "preference")
    rows = [row for _, _, row in read]
    return preference_batch(rows, config.architecture.block_size, examples.end_id, examples.pad_id), after


def dpo_train_step(
    model: nn.Module,
    optimizer: AdamW,
    batch: RowBatch,
    *,
    config: Config,
    stage: Stage,
    lr: float,
    reference: nn.Module | None,
) -> StepResult:
    """Forward/backward over micro-batches of pairs, clip, and (if finite) one update (module doc)."""
    if reference is None:  # the config rule (a refresh at or before a dpo stage) makes this unreachable
        raise RuntimeError("a dpo step needs the KL reference, and the run has none")
    settings, placement = stage.dpo, placement_for(config)
    device = placement.device
    num_pairs = batch.tokens.shape[0] // 2
    inputs, targets = batch.tokens[:, :-1].to(device), batch.tokens[:, 1:].to(device)
    mask = batch.loss_mask.to(device)
    chosen_tokens = int(mask[:num_pairs].sum())
    eval_mode(model)  # no dropout (module doc); gradients flow as in training
    optimizer.zero_grad(set_to_none=True)
    sums = dict.fromkeys(METRICS, 0.0)
    total_loss = 0.0
    mine = placement.row_range(num_pairs)  # this process's pairs (all of them in one process)
    slices = micro_batches(len(mine), config.training.per_device_batch_size)
    sharded = is_sharded(model)
    for index, part in enumerate(slices):
        if sharded:  # gradients are reduced over the ranks once, after the last micro-batch
            model.set_requires_gradient_sync(index == len(slices) - 1)  # type: ignore[operator]
        pairs = range(mine.start + part.start, mine.start + part.stop)
        rows = torch.cat([torch.arange(pairs.start, pairs.stop), torch.arange(pairs.start, pairs.stop) + num_pairs])
        with compute_precision(config, device):
            policy = sequence_logprobs(model(inputs[rows]), targets[rows], mask[rows])
            with torch.no_grad():
                ref = sequence_logprobs(reference(inputs[rows]), targets[rows], mask[rows])
        lengths = token_counts(mask[rows])
        m = pairs.stop - pairs.start
        out = dpo_loss(
            policy[:m], policy[m:], ref[:m], ref[m:],
            beta=settings.beta, variant=settings.loss, label_smoothing=settings.label_smoothing,
            chosen_lengths=lengths[:m], rejected_lengths=lengths[m:],
            sft_weight=settings.sft_weight, sft_normaliser=float(max(chosen_tokens, 1)),
        )
        (out.losses.sum() / num_pairs + out.sft_loss).backward()
        total_loss += float(out.losses.detach().sum()) / num_pairs
        sums["sft_loss"] += float(out.sft_loss.detach())
        for name in ("chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards"):
            sums[name] += float(getattr(out, name).sum()) / num_pairs
        sums["margin"] += float((out.chosen_rewards - out.rejected_rewards).sum()) / num_pairs
        sums["accuracy"] += float((out.chosen_rewards > out.rejected_rewards).sum()) / num_pairs
    model.train()
    # Every rank's share, summed before the record is built: all ranks record the same figures.
    total_loss, *summed = sum_over_ranks([total_loss, *sums.values()])
    sums = dict(zip(sums, summed, strict=True))
    grad_norm, finite = apply_update(model, optimizer, config, lr, (total_loss, sums["sft_loss"]))
    return StepResult(
        loss=total_loss,
        kl=0.0,
        grad_norm=grad_norm,
        num_correct=0,
        num_target_tokens=int(mask.sum()),
        finite=finite,
        metrics=sums,
    )


class DpoSpec(KindSpec):
    """A dpo stage in the engine (rewind.engine.step.kinds): its pairs at the cursors, one DPO update."""

    def train(self, parts: Parts, state: State, plan: StepPlan, lr: float) -> tuple[StepResult, dict[str, int]]:
        config, stage = parts.config, parts.config.stages[plan.stage]
        pairs, cursors = preference_rows(config, stage, plan.rows[plan.stage], state.cursors, parts.datasets.examples)
        result = dpo_train_step(
            parts.model, parts.optimizer, pairs, config=config, stage=stage, lr=lr, reference=parts.reference
        )
        return result, cursors


SPEC = DpoSpec()
