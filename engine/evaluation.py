"""Validation losses and boundary evaluations. Read-only with respect to training: no_grad, eval
mode, no RNG, so running them (or not) can never change the weights a run ends with."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from rewind.engine.datasets import Dataset
from rewind.engine.layout import eval_mode
from rewind.kernels.losses import fused_losses
from rewind.states.config import Config


def training_datasets(config: Config) -> list[str]:
    """Every dataset any stage trains on, in first-use order."""
    names: list[str] = []
    for mixture in config.training.datasets:
        for sampling in mixture:
            if sampling.name not in names:
                names.append(sampling.name)
    return names


def evaluation_tasks(config: Config) -> list[str]:
    """What boundary evaluations score: next-token answer accuracy, which only a causal (clm) model
    predicts; a masked objective's run records its boundaries with no scores (config validation refuses
    naming evaluations for one)."""
    if config.objective.kind != "clm":
        return []
    return list(config.training.evaluations) or training_datasets(config)


def _rows_per_batch(config: Config) -> int:
    per_device = config.training.per_device_batch_size
    return per_device if per_device > 0 else config.training.batch_size


@torch.no_grad()
def _score(model: nn.Module, dataset: Dataset, indices: np.ndarray, rows: int) -> tuple[float, float]:
    """(mean masked cross-entropy, answer-token accuracy) over validation rows `indices`."""
    total_nll = 0.0
    num_correct = num_tokens = 0
    for start in range(0, len(indices), rows):
        tokens, mask = dataset.batch("validation", indices[start : start + rows])
        count = int(mask.sum())
        if count == 0:
            continue
        losses = fused_losses(model(tokens[:, :-1]), tokens[:, 1:], mask, count)
        total_nll += float(losses.ce) * count
        num_correct += int(losses.num_correct)
        num_tokens += count
    if num_tokens == 0:
        return float("nan"), float("nan")
    return total_nll / num_tokens, num_correct / num_tokens


def validate(model: nn.Module, datasets: Mapping[str, Dataset], config: Config, step: int) -> dict[str, float]:
    """Validation loss per training dataset. Each round reads the next `validation_steps` batches of
    the validation split (wrapping around), so successive validations are not one frozen batch."""
    rows = _rows_per_batch(config)
    count = max(config.training.validation_steps, 1) * rows
    interval = max(config.logging.validation_interval, 1)
    round_index = step // interval
    was_training = model.training
    eval_mode(model)
    losses = {}
    try:
        for name in training_datasets(config):
            dataset = datasets[name]
            n = dataset.num_samples("validation")
            indices = (np.arange(count, dtype=np.int64) + round_index * count) % n
            losses[name], _ = _score(model, dataset, indices, rows)
    finally:
        model.train(was_training)
    return losses


def evaluate(
    model: nn.Module, datasets: Mapping[str, Dataset], config: Config
) -> tuple[dict[str, float], dict[str, float]]:
    """(answer-token accuracy, loss) per evaluation task on a fixed set of validation rows, the same at
    every boundary so the scores are comparable and forgetting shows."""
    rows = _rows_per_batch(config)
    was_training = model.training
    eval_mode(model)
    scores, losses = {}, {}
    try:
        for name in evaluation_tasks(config):
            dataset = datasets[name]
            n = min(config.training.eval_samples, dataset.num_samples("validation"))
            losses[name], scores[name] = _score(model, dataset, np.arange(n, dtype=np.int64), rows)
    finally:
        model.train(was_training)
    return scores, losses
