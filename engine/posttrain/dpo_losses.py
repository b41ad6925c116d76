"""Direct preference optimisation: the loss of a batch of (chosen, rejected) pairs from the sequence
log-probabilities of the policy and the reference (`rewind.engine.posttrain.response_logprobs.sequence_logprobs`,
summed over each response's tokens). Pure tensor functions: nothing here knows the config or the model.

With, per pair, pi_c, pi_r the policy's and ref_c, ref_r the reference's summed log-probs of the
chosen and rejected responses, beta > 0, ls = label_smoothing in [0, 0.5), x = beta * h:
- "sigmoid" (Rafailov et al. 2023; with ls > 0 the conservative DPO of Mitchell 2023):
      h = (pi_c - ref_c) - (pi_r - ref_r),   loss = -(1 - ls) * logsigmoid(x) - ls * logsigmoid(-x)
- "robust" (the unbiased robust DPO of Chowdhury et al. 2024, preferences flipped with probability ls):
      h as sigmoid,   loss = ((1 - ls) * -logsigmoid(x) - ls * -logsigmoid(-x)) / (1 - 2 * ls)
- "ipo" (Azar et al. 2023), length-normalised: with n_c, n_r the responses' token counts,
      h = (pi_c - ref_c) / n_c - (pi_r - ref_r) / n_r,   loss = (h - 1 / (2 * beta)) ** 2
- "hinge" (SLiC, Zhao et al. 2023):   h as sigmoid,   loss = relu(1 - x)
Label smoothing belongs to sigmoid and robust; ipo and hinge refuse ls != 0 rather than ignore it.

Metrics, the same for every variant, from the summed log-probs: the implicit rewards
beta * (pi_c - ref_c) and beta * (pi_r - ref_r), the margin (chosen reward - rejected reward) and the
accuracy (the fraction of pairs whose chosen reward is strictly greater: a tie, as at initialisation,
counts as wrong).

The optional SFT term is sft_weight * the chosen responses' negative log-likelihood per token:
-sum(pi_c) / N, N = sft_normaliser (the chosen token count of the whole step, over every micro-batch
and rank) or, when not given, this batch's sum(n_c). It is returned apart from the preference loss
(the caller adds it).

Per-pair losses are returned as well as their mean, so a step split into micro-batches divides every
micro-batch's sum by the step's pair count and gets the whole batch's mean; with sft_normaliser the
micro-batches' SFT terms likewise sum to the whole batch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

DPO_VARIANTS = ("sigmoid", "robust", "ipo", "hinge")


@dataclass(frozen=True)
class DpoOutput:
    losses: torch.Tensor  # (B,) per pair, differentiable
    sft_loss: torch.Tensor  # () sft_weight * chosen NLL per token (0 when sft_weight is 0), differentiable
    chosen_logps: torch.Tensor  # (B,) policy's summed log-probs of the chosen responses, detached
    rejected_logps: torch.Tensor  # (B,) same for the rejected responses
    chosen_rewards: torch.Tensor  # (B,) beta * (pi_c - ref_c), detached
    rejected_rewards: torch.Tensor  # (B,) beta * (pi_r - ref_r), detached

    @property
    def loss(self) -> torch.Tensor:
        """() the mean preference loss over the pairs."""
        return self.losses.mean()

    def metrics(self) -> dict[str, torch.Tensor]:
        """The batch's means, as 0-dim tensors (no device sync here)."""
        return {
            "chosen_logps": self.chosen_logps.mean(),
            "rejected_logps": self.rejected_logps.mean(),
            "chosen_rewards": self.chosen_rewards.mean(),
            "rejected_rewards": self.rejected_rewards.mean(),
            "margin": (self.chosen_rewards - self.rejected_rewards).mean(),
            "accuracy": (self.chosen_rewards > self.rejected_rewards).to(self.chosen_rewards.dtype).mean(),
        }


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    *,
    beta: float,
    variant: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    sft_weight: float = 0.0,
    sft_normaliser: float | None = None,
) -> DpoOutput:
    """The loss of each pair (module docstring), from (B,) summed log-probs. The reference's need no
    gradient (they are detached here). Lengths are (B,) token counts, needed by ipo and the SFT term."""
    _check(beta, variant, label_smoothing)
    reference_chosen, reference_rejected = reference_chosen.detach(), reference_rejected.detach()
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    if variant == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("the ipo variant needs chosen_lengths and rejected_lengths")
        h = chosen_ratio / chosen_lengths.to(chosen_ratio.dtype) - rejected_ratio / rejected_lengths.to(
            rejected_ratio.dtype
        )
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        x = beta * (chosen_ratio - rejected_ratio)
        ls = label_smoothing
        if variant == "sigmoid":
            losses = -(1.0 - ls) * F.logsigmoid(x) - ls * F.logsigmoid(-x)
        elif variant == "robust":
            losses = (-(1.0 - ls) * F.logsigmoid(x) + ls * F.logsigmoid(-x)) / (1.0 - 2.0 * ls)
        else:  # hinge
            losses = torch.relu(1.0 - x)
    return DpoOutput(
        losses=losses,
        sft_loss=_sft_loss(policy_chosen, chosen_lengths, sft_weight, sft_normaliser),
        chosen_logps=policy_chosen.detach(),
        rejected_logps=policy_rejected.detach(),
        chosen_rewards=beta * chosen_ratio.detach(),
        rejected_rewards=beta * rejected_ratio.detach(),
    )


def _sft_loss(
    policy_chosen: torch.Tensor,
    chosen_lengths: torch.Tensor | None,
    weight: float,
    normaliser: float | None,
) -> torch.Tensor:
    if weight == 0.0:
        return policy_chosen.new_zeros(())
    if weight < 0.0:
        raise ValueError(f"sft_weight must be >= 0, got {weight}")
    if normaliser is None:
        if chosen_lengths is None:
            raise ValueError("the SFT term needs chosen_lengths or sft_normaliser")
        return weight * (-policy_chosen.sum() / chosen_lengths.sum().to(policy_chosen.dtype))
    if not normaliser > 0:
        raise ValueError(f"sft_normaliser must be > 0, got {normaliser}")
    return weight * (-policy_chosen.sum() / normaliser)


def _check(beta: float, variant: str, label_smoothing: float) -> None:
    if variant not in DPO_VARIANTS:
        raise ValueError(f"unknown DPO variant {variant!r} (expected one of {', '.join(DPO_VARIANTS)})")
    if not beta > 0.0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    if label_smoothing != 0.0 and variant in ("ipo", "hinge"):
        raise ValueError(f"label_smoothing applies to the sigmoid and robust variants, not {variant}")
