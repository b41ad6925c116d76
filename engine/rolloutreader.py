"""A grpo stage's rollout batch as its updates read it: from the file the state's RolloutsRecorded names
(checked against its sha256 by rewind.stores.rollouts), once per window, turned into training rows.

The file keeps what was sampled in the completions' own coordinates (rewind.stores.rollouts: completion
n's tokens and per-token values in row n, its first completion_lengths[n]); the updates compute on
training rows, prompt + completion (rewind.engine.row_batches.completion_batch), whose completion mask
covers exactly those tokens in the same order. `on_rows` and `off_rows` move per-token values between
the two, exactly (a copy, no arithmetic), so old log-probs computed on training rows and kept in the file
come back bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rewind.engine.grpo_losses import mask_truncated
from rewind.engine.row_batches import completion_batch
from rewind.states.state import State
from rewind.stores.rollouts import read_rollouts


@dataclass(frozen=True)
class TrainingRows:
    """tokens (N, block + 1); mask (N, block) over the completion tokens the loss counts; the per-token
    tensors laid on the mask (0 elsewhere); advantages (N,); rewards (F, N)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    reference_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    rewards: torch.Tensor


def completions_of(tensors: dict[str, torch.Tensor]) -> tuple[list[list[int]], list[list[int]]]:
    """(each completion's prompt, each completion): the token lists of a rollout batch's rows."""
    group = tensors["completions"].shape[0] // tensors["prompts"].shape[0]
    prompts = [row[:n].tolist() for row, n in zip(tensors["prompts"], tensors["prompt_lengths"], strict=True)]
    completions = [
        row[:n].tolist() for row, n in zip(tensors["completions"], tensors["completion_lengths"], strict=True)
    ]
    return [prompts[i // group] for i in range(len(completions))], completions


def training_rows(
    tensors: dict[str, torch.Tensor], *, end_id: int, pad_id: int, block_size: int, drop_truncated: bool
) -> TrainingRows:
    """The updates' rows of a rollout batch (its old and reference log-probs when it has them)."""
    prompts, completions = completions_of(tensors)
    batch = completion_batch(prompts, completions, end_id, pad_id, block_size)
    mask = mask_truncated(batch.completion_mask, batch.truncated) if drop_truncated else batch.completion_mask
    lengths = tensors["completion_lengths"]

    def laid(name: str) -> torch.Tensor | None:
        values = tensors.get(name)
        return None if values is None else on_rows(values, lengths, batch.completion_mask).masked_fill(~mask, 0.0)

    return TrainingRows(
        batch.tokens, mask, laid("old_logprobs"), laid("reference_logprobs"), tensors["advantages"], tensors["rewards"]
    )


def on_rows(values: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, Lc) per-completion-token values -> (N, block) on the training rows' completion positions."""
    out = torch.zeros(mask.shape, dtype=values.dtype)
    within = torch.arange(values.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    out[mask] = values[within]
    return out


def off_rows(values: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """(N, block) values on the completion positions -> (N, width) in the completions' coordinates."""
    out = torch.zeros((mask.shape[0], width), dtype=values.dtype)
    lengths = mask.sum(dim=1)
    within = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    out[within] = values[mask]
    return out


class RolloutReader:
    """The training rows of the rollout batch the state names, read once per window (a live object like
    the trunk reader: built from what the state records, never written to)."""

    def __init__(self) -> None:
        self._held: tuple[str, TrainingRows] | None = None

    def rows(self, run_dir: str, state: State, **layout) -> TrainingRows:
        """`layout`: training_rows' keywords (the run's end and pad ids, block size, drop_truncated)."""
        record = state.rollouts
        if record is None:  # the plan samples before any step of a window: unreachable in a run
            raise RuntimeError(f"step {state.step} of a grpo stage has no rollout batch on record")
        if self._held is None or self._held[0] != record.sha256:
            tensors, _ = read_rollouts(run_dir, record.path, record.sha256)
            self._held = (record.sha256, training_rows(tensors, **layout))
        return self._held[1]
