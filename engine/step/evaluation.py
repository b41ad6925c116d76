"""Validation losses and boundary evaluations. Read-only with respect to training: no_grad, eval
mode, no RNG, so running them (or not) can never change the weights a run ends with.

An evaluation scores each task's first `eval_samples` validation rows: the mean masked cross-entropy
(loss, and perplexity = exp(loss)), answer-token accuracy for datasets whose mask marks answers
(`Dataset.has_answers`; on running text it would only be next-token accuracy), and bits per byte, the
summed nats / ln 2 / the UTF-8 bytes the scored targets stand for, which compares models whatever their
tokenizers (given the tokenizer's byte length per token id). `rewind eval` scores on demand the same way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from rewind.engine.data.datasets import Dataset
from rewind.engine.model.layout import evaluating
from rewind.engine.model.placement import model_device
from rewind.kernels.losses import fused_losses
from rewind.states.config import Config
from rewind.stores.metrics import perplexity


def training_datasets(config: Config) -> list[str]:
    """Every dataset any stage trains on, in first-use order."""
    names: list[str] = []
    for stage in config.stages:
        for sampling in stage.datasets:
            if sampling.name not in names:
                names.append(sampling.name)
    return names


def evaluation_tasks(config: Config) -> list[str]:
    """What boundary evaluations score: next-token figures, which only a causal (clm) model predicts; a
    masked objective's run records its boundaries with no scores (config validation refuses naming
    evaluations for one)."""
    if config.objective.kind != "clm":
        return []
    return list(config.training.evaluations) or training_datasets(config)


def rows_per_forward(config: Config) -> int:
    """How many rows an evaluation forward holds: a training micro-batch's."""
    per_device = config.training.per_device_batch_size
    return per_device if per_device > 0 else config.training.batch_size


class DatasetScore(NamedTuple):
    """One dataset's figures over the validation rows scored. `accuracy` is answer-token accuracy (the
    argmax at a masked target is that target), meaningful only where the mask marks answers;
    `bits_per_byte` is None without a token byte table, or when the scored targets stand for no bytes."""

    loss: float  # mean masked cross-entropy, nats per target token
    accuracy: float
    bits_per_byte: float | None
    num_tokens: int  # masked targets scored
    num_bytes: int  # UTF-8 bytes those targets stand for (0 without a byte table)

    @property
    def perplexity(self) -> float:
        return perplexity(self.loss)


@dataclass(frozen=True)
class Evaluation:
    """A boundary evaluation, per dataset, in the shape of the Evaluated event's fields (plus the
    perplexities, exp(loss), which the log does not hold: the metrics projection derives them)."""

    scores: dict[str, float] = field(default_factory=dict)  # answer-token accuracy, datasets with answers
    losses: dict[str, float] = field(default_factory=dict)
    bits_per_byte: dict[str, float] = field(default_factory=dict)  # where targets have a known byte length
    perplexities: dict[str, float] = field(default_factory=dict)


def byte_table(token_num_bytes: np.ndarray | Sequence[int] | None) -> torch.Tensor | None:
    """The tokenizer's UTF-8 bytes per token id as a tensor to index with targets (None stays None)."""
    if token_num_bytes is None:
        return None
    return torch.as_tensor(np.asarray(token_num_bytes, dtype=np.int64))


def _target_bytes(table: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> int:
    """UTF-8 bytes the masked targets stand for; ids past the table stand for none."""
    scored = targets[mask]
    return int(table[scored[scored < len(table)]].sum())


@torch.no_grad()
def score(
    model: nn.Module,
    dataset: Dataset,
    indices: np.ndarray,
    rows: int,
    token_bytes: torch.Tensor | None = None,
) -> DatasetScore:
    """The figures of validation rows `indices`, `rows` at a time. `token_bytes`: see `byte_table`."""
    total_nll = 0.0
    num_correct = num_tokens = num_bytes = 0
    for start in range(0, len(indices), rows):
        tokens, mask = dataset.batch("validation", indices[start : start + rows])
        tokens, mask = tokens.to(model_device(model)), mask.to(model_device(model))
        count = int(mask.sum())
        if count == 0:
            continue
        targets = tokens[:, 1:]
        losses = fused_losses(model(tokens[:, :-1]), targets, mask, count)
        total_nll += float(losses.ce) * count
        num_correct += int(losses.num_correct)
        num_tokens += count
        if token_bytes is not None:
            num_bytes += _target_bytes(token_bytes, targets.cpu(), mask.cpu())
    if num_tokens == 0:
        return DatasetScore(float("nan"), float("nan"), None, 0, num_bytes)
    loss = total_nll / num_tokens
    # Bits per token times tokens per byte: exactly loss / ln 2 when every token is one byte.
    bits = loss / math.log(2) * (num_tokens / num_bytes) if num_bytes else None
    return DatasetScore(loss, num_correct / num_tokens, bits, num_tokens, num_bytes)


def evaluation_indices(dataset: Dataset, num_samples: int) -> np.ndarray:
    """The validation rows an evaluation scores: the first `num_samples` (all there are, if fewer), the
    same at every boundary so the figures are comparable and forgetting shows."""
    return np.arange(min(num_samples, dataset.num_samples("validation")), dtype=np.int64)


def validate(model: nn.Module, datasets: Mapping[str, Dataset], config: Config, step: int) -> dict[str, float]:
    """Validation loss per training dataset. Each round reads the next `validation_steps` batches of
    the validation split (wrapping around), so successive validations are not one frozen batch."""
    rows = rows_per_forward(config)
    count = max(config.training.validation_steps, 1) * rows
    interval = max(config.logging.validation_interval, 1)
    round_index = step // interval
    losses = {}
    with evaluating(model):
        for name in training_datasets(config):
            dataset = datasets[name]
            n = dataset.num_samples("validation")
            indices = (np.arange(count, dtype=np.int64) + round_index * count) % n
            losses[name] = score(model, dataset, indices, rows).loss
    return losses


def evaluate_dataset(
    model: nn.Module,
    dataset: Dataset,
    config: Config,
    num_samples: int,
    token_num_bytes: np.ndarray | Sequence[int] | None = None,
) -> DatasetScore:
    """One dataset's figures on its first `num_samples` validation rows, in eval mode (`rewind eval`)."""
    with evaluating(model):
        indices = evaluation_indices(dataset, num_samples)
        return score(model, dataset, indices, rows_per_forward(config), byte_table(token_num_bytes))


def evaluate(
    model: nn.Module,
    datasets: Mapping[str, Dataset],
    config: Config,
    token_num_bytes: np.ndarray | Sequence[int] | None = None,
) -> Evaluation:
    """Every evaluation task's figures on a fixed set of validation rows (`evaluation_indices`): loss
    and perplexity for all, answer-token accuracy for datasets with answers, bits per byte where
    `token_num_bytes` (the run's tokenizer's `token_num_bytes()`) gives the targets a byte length."""
    result = Evaluation()
    for name in evaluation_tasks(config):
        dataset = datasets[name]
        figures = evaluate_dataset(model, dataset, config, config.training.eval_samples, token_num_bytes)
        result.losses[name] = figures.loss
        result.perplexities[name] = figures.perplexity
        if dataset.has_answers:
            result.scores[name] = figures.accuracy
        if figures.bits_per_byte is not None:
            result.bits_per_byte[name] = figures.bits_per_byte
    return result
