"""Log-probabilities of given tokens under a model's logits: the one code path through which the
post-training losses (`rewind.engine.posttrain.dpo_losses`, `rewind.engine.posttrain.grpo_losses`) read the policy, the old
policy and the reference, so all three are computed alike.

Shapes: logits (B, T, V), targets (B, T) long, loss_mask (B, T) bool; position t scores targets[:, t]
under logits[:, t] (the caller has already shifted: logits at t predict the token at t + 1).

- Computed in float32 whatever the logits' dtype, as log_softmax(logits / temperature) then a gather
  (never softmax then log, which underflows to -inf for unlikely tokens).
- Positions outside the mask are 0 and pass no gradient to the logits (for finite logits); their
  targets may be any id, even a negative ignore index: they are never gathered.
- A row's sum runs along T in order (`cumsum`, which on the CPU accumulates sequentially in float64):
  extra masked-out positions add exact zeros, so padding a row, anywhere, leaves its sum bit for bit the
  same on the CPU (a tree-shaped `sum` regroups its terms when the length changes, and differs in the
  last bits). Elsewhere (CUDA's scan) the sum is equal up to rounding.
"""

from __future__ import annotations

import torch


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """(B, T) float32: log p(targets[b, t]) under softmax(logits[b, t] / temperature) where the mask
    is set, 0 elsewhere."""
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != targets.shape or targets.shape != loss_mask.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)}, targets {tuple(targets.shape)} and loss_mask "
            f"{tuple(loss_mask.shape)} must agree on (B, T)"
        )
    mask = loss_mask.bool()
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    safe_targets = targets.long().masked_fill(~mask, 0)
    gathered = scaled.log_softmax(dim=-1).gather(-1, safe_targets.unsqueeze(-1)).squeeze(-1)
    return gathered.masked_fill(~mask, 0.0)


def masked_row_sums(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(B,): each row's sum of `values` (B, T) over its masked positions, in order along T (see the
    module docstring for why a cumulative sum)."""
    kept = values.masked_fill(~loss_mask.bool(), 0.0)
    if kept.shape[-1] == 0:
        return kept.sum(dim=-1)
    return kept.cumsum(dim=-1)[..., -1]


def sequence_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, loss_mask: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """(B,) float32: each row's sum of log p(target) over its masked positions (a response's
    log-probability given its prompt, when the mask holds the response's targets)."""
    return masked_row_sums(token_logprobs(logits, targets, loss_mask, temperature), loss_mask)


def token_counts(loss_mask: torch.Tensor) -> torch.Tensor:
    """(B,) int64: each row's number of masked positions (the response lengths IPO normalises by)."""
    return loss_mask.bool().sum(dim=-1)
