"""One optimizer step: micro-batches, losses, gradient clipping, AdamW, at the schedule's LR.

Nothing here decides anything: the rows, LR and KL weight come from the schedule's `StepPlan`, the
batch from the data cursors. What comes back is measured (losses, grad norm) and goes into the
StepCommitted event.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from rewind.engine.model.optimizer import AdamW
from rewind.engine.model.placement import full_tensor, in_sharded_run, is_sharded, placement_for
from rewind.engine.model.ranks import sum_over_ranks
from rewind.engine.model.rng import derive_seed
from rewind.engine.step.objectives import objective_batch
from rewind.kernels.linear_losses import linear_losses
from rewind.kernels.losses import Losses, fused_losses
from rewind.states.config import Config


@dataclass(frozen=True)
class StepResult:
    loss: float  # task cross-entropy, mean over the batch's target tokens
    kl: float  # KL term, same normalisation (0 when beta is 0)
    grad_norm: float  # before clipping
    num_correct: int
    num_target_tokens: int
    finite: bool
    # The strategy's own figures of the step (a dpo step's rewards, margin, accuracy), means over its rows.
    metrics: dict[str, float] = field(default_factory=dict)


def nonfinite_quantity(loss: float, kl: float, grad_norm: float) -> str:
    """"loss", "kl" or "grad_norm": the first not finite, in the order a step computes them (the task
    loss and the KL term in the forward pass, the gradient norm after backward), or "" if all are.
    The first is the one to look at: a NaN loss makes the gradients NaN too, never the reverse."""
    for name, value in (("loss", loss), ("kl", kl), ("grad_norm", grad_norm)):
        if not math.isfinite(value):
            return name
    return ""


def build_optimizer(model: nn.Module, config: Config) -> AdamW:
    opt = config.optimization
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        # Norm gains and biases are not weight-decayed: decaying them only fights the normalisation.
        (no_decay if parameter.ndim < 2 or name.endswith(".bias") else decay).append(parameter)
    groups = [
        {"params": decay, "weight_decay": opt.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # torch's single-tensor AdamW arithmetic (the same on every run and every resume), without torch's
    # Optimizer base and the torch._dynamo import it costs a restart (rewind.engine.model.optimizer).
    return AdamW(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)


def apply_hyperparameters(optimizer: AdamW, config: Config) -> None:
    """Set what the config decides about the optimizer's groups (betas, eps, weight decay; the LR is set
    before every step). Called after restoring a checkpoint's optimizer state too: the checkpoint
    gives the moments, the config in force gives the settings, so a run forked with another weight
    decay trains with it (under an unchanged config this changes nothing)."""
    opt = config.optimization
    for group, weight_decay in zip(optimizer.param_groups, (opt.weight_decay, 0.0), strict=True):
        group.update(betas=(opt.beta1, opt.beta2), eps=opt.eps, weight_decay=weight_decay)


def dropout_seed(config: Config, step: int, micro_batch: int) -> int:
    """The seed of the dropout masks of micro-batch `micro_batch` of step `step`, numbered over the whole
    step's batch (not per rank, so a run that changes its world size keeps its masks): the one place it
    is derived, so the activation cache computes the trunk with exactly the masks the step uses. (The
    0 is where a rank once went: kept, so the seeds of every existing run stay what they were.)"""
    return derive_seed(config.run.seed, "dropout", step, 0, micro_batch)


def _micro_batch_losses(
    model: nn.Module,
    reference: nn.Module | None,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_mask: torch.Tensor,
    num_target_tokens: int,
    *,
    levels: torch.Tensor | None,
    documents: torch.Tensor | None,
    trunk: torch.Tensor | None,
    seed: int,
    beta: float,
    config: Config,
) -> Losses:
    """One micro-batch's losses, by the config's loss kernel: from the model's logits ("logits"), or
    with the loss owning the head matmul ("chunked", "triton": the model hands the loss its final
    hidden states and head weight inside its own forward, so a sharded head is whole there)."""
    kind, kernel = config.optimization.kl.kind, config.compute.loss_kernel
    # What the model's forward (and the reference's) is given besides the tokens, only when there is any,
    # so a run without it calls the forward exactly as before.
    conditioning: dict[str, torch.Tensor] = {} if levels is None else {"levels": levels}
    if documents is not None:
        conditioning["documents"] = documents
    if kernel == "logits":
        if trunk is not None:
            logits = model.forward_from_trunk(trunk, dropout_seed=seed)
        else:
            logits = model(inputs, dropout_seed=seed, **conditioning)
        reference_logits = None
        if reference is not None:
            with torch.no_grad():  # no reference forward at all when beta is 0
                reference_logits = reference(inputs, **conditioning)
        return fused_losses(logits, targets, loss_mask, num_target_tokens, reference_logits, beta, kind)
    reference_hidden = reference_weight = None
    if reference is not None:
        with torch.no_grad():
            reference_hidden, reference_weight = reference(inputs, head_fn=_hidden_and_head, **conditioning)

    def head_fn(hidden: torch.Tensor, weight: torch.Tensor) -> Losses:
        return linear_losses(
            hidden, weight, targets, loss_mask, num_target_tokens, reference_hidden, reference_weight, beta, kind,
            implementation=kernel,
        )

    if trunk is not None:
        return model.forward_from_trunk(trunk, dropout_seed=seed, head_fn=head_fn)
    return model(inputs, dropout_seed=seed, head_fn=head_fn, **conditioning)


def _hidden_and_head(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's final hidden states and head weight. A sharded head is whole only inside the
    forward: copied out then (the loss reads it after), otherwise handed on as it is."""
    return hidden, weight.detach().clone() if in_sharded_run() else weight.detach()


def compute_precision(config: Config, device: torch.device):
    """bf16-autocast: matmuls in bf16 under torch.autocast (weights, optimizer and the loss stay fp32)."""
    if config.compute.precision == "bf16-autocast":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def apply_update(
    model: nn.Module, optimizer: AdamW, config: Config, lr: float, figures: tuple[float, ...]
) -> tuple[float, bool]:
    """After the last backward of a step: clip, and one AdamW update at `lr` when the step's `figures`
    (its losses, over every rank) and the gradient norm are finite. (grad norm before clipping, finite)."""
    parameters = [p for p in model.parameters() if p.grad is not None]
    grad_norm = _global_norm(parameters, config.optimization.grad_clip, is_sharded(model))
    finite = all(math.isfinite(value) for value in (*figures, grad_norm))
    if finite:
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, finite


def micro_batches(num_rows: int, per_device: int) -> list[slice]:
    size = num_rows if per_device <= 0 else per_device
    return [slice(i, min(i + size, num_rows)) for i in range(0, num_rows, size)]


def _global_norm(parameters: list[torch.Tensor], clip: float, sharded: bool) -> float:
    """The gradients' global L2 norm before clipping (and the clip, if `clip` > 0). Sharded gradients
    are DTensors: torch sums their shards' squares over the ranks, and the norm is made whole."""
    if clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(parameters, clip, foreach=False)
    elif not parameters:
        return 0.0
    elif sharded:
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters], foreach=False)
    else:
        norm = torch.norm(torch.stack([p.grad.detach().norm() for p in parameters]))
    return float(full_tensor(norm))


def train_step(
    model: nn.Module,
    optimizer: AdamW,
    tokens: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    config: Config,
    lr: float,
    beta: float,
    reference: nn.Module | None,
    step: int,
    trunk_rows: torch.Tensor | None = None,
    stack_index: int = 0,
    num_stacks: int = 1,
    documents: torch.Tensor | None = None,
) -> StepResult:
    """Forward/backward over micro-batches, clip, and (if the loss is finite) one AdamW update.

    `trunk_rows`: the frozen trunk's outputs for these rows, from the activation cache: only the last
    stack, the final norm and the head run (the same bits as the whole forward pass).
    The objective (config.objective) turns the rows into inputs, targets and the positions the loss
    counts; masked diffusion with time as depth trains stack `stack_index` of `num_stacks`. `documents`
    (B, block_size), for rows packed with several examples: each attends to itself alone (the model's
    forward), the reference's too."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    batch = objective_batch(
        config.objective,
        config.architecture.vocab_size,
        tokens,
        loss_mask,
        seed=config.run.seed,
        step=step,
        stack_index=stack_index,
        num_stacks=num_stacks,
    )
    num_target_tokens = int(batch.loss_mask.sum())  # over the whole step's batch: every rank's share
    placement = placement_for(config)
    # This process's rows of the step's batch (all of them in one process), on its device.
    mine = placement.row_range(tokens.shape[0])
    rows_here = slice(mine.start, mine.stop)
    device = placement.device
    inputs, targets, loss_mask = (t[rows_here].to(device) for t in (batch.inputs, batch.targets, batch.loss_mask))
    levels = None if batch.levels is None else batch.levels[rows_here].to(device)
    documents_here = None if documents is None else documents[rows_here].to(device)
    trunk_here = None if trunk_rows is None else trunk_rows[rows_here].to(device)
    use_kl = reference is not None and beta > 0.0
    sharded = is_sharded(model)
    slices = micro_batches(len(mine), config.training.per_device_batch_size)
    first_micro_batch = mine.start // max(slices[0].stop - slices[0].start, 1) if slices else 0
    total_ce = total_kl = 0.0
    num_correct = 0
    for index, rows in enumerate(slices):
        if sharded:  # gradients are reduced over the ranks once, after the last micro-batch
            model.set_requires_gradient_sync(index == len(slices) - 1)  # type: ignore[operator]
        seed = dropout_seed(config, step, first_micro_batch + index)
        with compute_precision(config, device):
            losses = _micro_batch_losses(
                model,
                reference if use_kl else None,
                inputs[rows],
                targets[rows],
                loss_mask[rows],
                num_target_tokens,
                levels=None if levels is None else levels[rows],
                documents=None if documents_here is None else documents_here[rows],
                trunk=None if trunk_here is None else trunk_here[rows],
                seed=seed,
                beta=beta,
                config=config,
            )
        losses.objective.backward()
        total_ce += float(losses.ce)
        total_kl += float(losses.kl)
        num_correct += int(losses.num_correct)
    # Measured over every rank before the event that carries them is built: all ranks fold the same.
    total_ce, total_kl, summed_correct = sum_over_ranks([total_ce, total_kl, float(num_correct)])
    num_correct = int(summed_correct)
    grad_norm, finite = apply_update(model, optimizer, config, lr, (total_ce, total_kl))
    return StepResult(
        loss=total_ce,
        kl=total_kl,
        grad_norm=grad_norm,
        num_correct=num_correct,
        num_target_tokens=num_target_tokens,
        finite=finite,
    )
