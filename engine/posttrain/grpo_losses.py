"""Group relative policy optimisation: rewards -> advantages -> the clipped token-level loss, with an
optional KL penalty to a reference. Pure tensor functions: nothing here knows the config or the model.

Rewards. Each reward function gives a float or None (not applicable) per completion, as an (F, N)
tensor with NaN for None. `weighted_rewards` sums w_f * r_f over the functions that scored a
completion, skipping the Nones; a completion no function scored stays NaN. `group_advantages` leaves
NaN rewards out of their group's mean and std and gives them advantage 0: nobody could judge them, so
they are neither pushed up nor down (their tokens still count in the normaliser and in the KL term:
they are samples of the policy all the same).

Advantages, per group of G completions of one prompt, with the group's scored rewards r:
    A = (r - mean(r)) / (std + eps)
- scale_rewards = "group": std = the group's unbiased standard deviation (divisor n - 1, as torch.std);
- "batch": std = the unbiased standard deviation of every scored reward in the batch, about the batch's
  mean (the centring stays per group);
- "none": A = r - mean(r), no division.
A group with a single scored completion has r - mean(r) = 0, so advantage 0 (its std, 0/0, is taken
as 0); a group whose rewards are all equal has advantage 0 too. Computed in float64.

Token loss, with ratio = exp(logp - old_logp) (exactly 1.0 where logp == old_logp, as on the first
update of a rollout batch), A the sequence's advantage, d = logp - ref_logp:
    L = -min(ratio * A, clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * A) + kl_beta * ratio * k
    k1 = d,   k2 = d ** 2 / 2,   k3 = exp(-d) - 1 + d   (= ref/pi - 1 - log(ref/pi))
The KL term is weighted by the importance ratio, gradient included: tokens were sampled from the old
policy, and E_old[ratio * k] = E_pi[k] as a function of the parameters, so the term's gradient in
expectation is the gradient of E_pi[k]. Hence k1 and k3, whose expectation under pi is KL(pi || ref),
are unbiased for the KL's value AND its gradient, on- and off-policy. k2 is biased for both (E_pi[k2]
is KL's second-order approximation; it is >= 0 per token). On-policy (ratio = 1), each sample's k3
gradient here is d * grad(logp), the low-variance form. The KL a step logs is the same estimate:
sum(ratio * k) over the step's masked tokens / their count (`kl_sum`; on a window's first update, ratio
exactly 1, the plain mean of k), whatever kl_beta. A run started before that figure
(rewind.states.features: scored_reward_figures) logs the plain mean of k (`plain_kl_sum`), as it did.

Aggregation, with m the completion mask and N the step's normaliser (`grpo_normaliser`):
- "grpo":    sum over sequences of (sum_t L * m / n_tokens(sequence)) / N, N = the step's sequence count
- "bnpo":    sum_t L * m / N, N = the masked tokens of the rollout batch
- "dapo":    sum_t L * m / N, N = the masked tokens of the optimizer step
- "dr_grpo": sum_t L * m / N, N = the step's sequence count * max_completion_length
Every N is counted once per optimizer step over every micro-batch and every rank, and `grpo_loss`
returns a micro-batch's share already divided by it: the shares of the micro-batches (and ranks) sum to
the whole batch's loss, so with gradients summed over micro-batches and ranks (as the engine reduces
them, never averaged) neither gradient accumulation nor the world size changes the gradient. (When
one rollout batch makes one optimizer step, bnpo and dapo are the same number; neither is the
per-micro-batch count, which would change with gradient accumulation.) A sequence whose mask is empty
(a truncated completion masked out) adds 0 but still counts as a sequence for grpo and dr_grpo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rewind.engine.posttrain.response_logprobs import masked_row_sums

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
KL_ESTIMATORS = ("k1", "k2", "k3")


def weighted_rewards(per_function: torch.Tensor, weights: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """(N,): sum over functions f of weights[f] * per_function[f], skipping NaN (None) entries; NaN
    where every function gave None. per_function is (F, N)."""
    weights = torch.as_tensor(weights, dtype=per_function.dtype, device=per_function.device)
    if per_function.dim() != 2 or weights.shape != per_function.shape[:1]:
        raise ValueError(
            f"per_function {tuple(per_function.shape)} must be (F, N) with one weight per function, "
            f"got weights {tuple(weights.shape)}"
        )
    scored = ~torch.isnan(per_function)
    total = (torch.where(scored, per_function, 0.0) * weights.unsqueeze(1)).sum(dim=0)
    return torch.where(scored.any(dim=0), total, torch.nan)


def reward_figures(rewards: torch.Tensor, *, scored_figures: bool = True) -> tuple[float, int]:
    """(mean, unscored) of a batch's (N,) weighted rewards (NaN: no function scored the completion): the
    mean over the scored completions, computed in float64, and how many were not scored. Every completion
    unscored: (0.0, N). The figures a rollout record and every step of its window carry. `scored_figures`
    False (a run started before rewind.states.features' scored_reward_figures): the figures it has always
    had, the float32 mean with the unscored counted as 0, and no count (0)."""
    if not scored_figures:
        return float(rewards.nan_to_num().mean()), 0
    scored = ~torch.isnan(rewards)
    unscored = int((~scored).sum())
    return (float(rewards[scored].double().mean()) if bool(scored.any()) else 0.0), unscored


def group_advantages(
    rewards: torch.Tensor, *, scale_rewards: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """(P, G) advantages of (P, G) rewards (P prompts, G completions each, NaN = unscored), as the
    module docstring says; same dtype as the rewards."""
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(
            f"unknown scale_rewards {scale_rewards!r} (expected one of {', '.join(SCALE_REWARDS)})"
        )
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (num_prompts, group_size), got {tuple(rewards.shape)}")
    r = rewards.double()
    scored = ~torch.isnan(r)
    count = scored.sum(dim=1, keepdim=True)
    mean = torch.where(scored, r, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)
    centred = torch.where(scored, r - mean, 0.0)
    if scale_rewards == "none":
        return centred.to(rewards.dtype)
    if scale_rewards == "group":
        std = _unbiased_std(centred, count)
    else:
        everything = torch.where(scored, r, 0.0)
        total = scored.sum()
        batch_centred = torch.where(scored, everything - everything.sum() / total.clamp(min=1), 0.0)
        std = _unbiased_std(batch_centred.reshape(1, -1), total.reshape(1, 1))
    return (centred / (std + eps)).to(rewards.dtype)


def _unbiased_std(centred: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """sqrt(sum(centred ** 2) / (count - 1)) per row; 0 for a row of fewer than two values."""
    return ((centred**2).sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()


def mask_truncated(mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """The completion mask (B, T) with the rows of truncated completions ((B,) bool: no end of text
    within the length limit) cleared, for `mask_truncated_completions`."""
    return mask.bool() & ~truncated.bool().unsqueeze(1)


def grpo_normaliser(masks: Sequence[torch.Tensor], loss_type: str, max_completion_length: int) -> float:
    """The N of `loss_type` (module docstring) counted over `masks`, the (B_i, T_i) completion masks
    of every micro-batch this process computes in the step (for bnpo: of the rollout batch). Every N is
    a count that adds over ranks: the caller sums it over the ranks before passing it to `grpo_loss`."""
    _check_loss_type(loss_type)
    num_sequences = sum(int(mask.shape[0]) for mask in masks)
    if loss_type == "grpo":
        return float(num_sequences)
    if loss_type == "dr_grpo":
        longest = max((int(mask.shape[-1]) for mask in masks), default=0)
        if longest > max_completion_length:
            raise ValueError(
                f"a completion mask is {longest} long, past max_completion_length {max_completion_length}"
            )
        return float(num_sequences * max_completion_length)
    return float(sum(int(mask.bool().sum()) for mask in masks))


def kl_estimate(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per token: the estimator of KL(pi || ref) named (module docstring) at the sampled tokens."""
    _check_estimator(estimator)
    d = logprobs - reference_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    return torch.exp(-d) - 1.0 + d


def importance_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """exp(logp - old_logp) per token, the old policy's log-probs detached: exactly 1.0 where the two
    are equal (x - x == 0 and exp(0) == 1 in floating point), with gradient ratio * grad(logp)."""
    return torch.exp(logprobs - old_logprobs.detach())


@dataclass(frozen=True)
class GrpoOutput:
    loss: torch.Tensor  # () this micro-batch's share of the step's loss (divided by N), differentiable
    kl_sum: torch.Tensor  # () ratio * k summed over the masked tokens (no beta; 0 without a reference)
    plain_kl_sum: torch.Tensor  # () k summed over them, without the ratio: what older runs log (module doc)
    clipped_low: torch.Tensor  # () masked tokens with A < 0 and ratio < 1 - epsilon_low (no gradient)
    clipped_high: torch.Tensor  # () masked tokens with A > 0 and ratio > 1 + epsilon_high (no gradient)
    num_tokens: torch.Tensor  # () masked tokens in this micro-batch


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str,
    epsilon_low: float,
    epsilon_high: float,
    normaliser: float,
    kl_beta: float = 0.0,
    kl_estimator: str = "k3",
) -> GrpoOutput:
    """A micro-batch's share of the step's loss (module docstring). logprobs, old_logprobs and
    reference_logprobs are (B, T) per-token log-probs of the completions (the policy's with gradient;
    the others are detached here; reference_logprobs may be None when kl_beta is 0), advantages (B,),
    mask (B, T) bool. Positions outside the mask contribute nothing and pass no gradient, whatever
    they hold."""
    _check_loss_type(loss_type)
    _check_estimator(kl_estimator)
    if not (0.0 <= epsilon_low <= 1.0 and epsilon_high >= 0.0):
        raise ValueError(
            f"need 0 <= epsilon_low <= 1 and epsilon_high >= 0, got {epsilon_low}, {epsilon_high}"
        )
    if normaliser < 0:
        raise ValueError(f"normaliser must be >= 0, got {normaliser}")
    mask = mask.bool()
    logprobs = logprobs.masked_fill(~mask, 0.0)
    ratio = importance_ratio(logprobs, old_logprobs.masked_fill(~mask, 0.0))
    advantage = advantages.detach().to(ratio.dtype).unsqueeze(1)
    clipped = ratio.clamp(1.0 - epsilon_low, 1.0 + epsilon_high)
    token_loss = -torch.minimum(ratio * advantage, clipped * advantage)
    kl = plain_kl = ratio.new_zeros(())
    if reference_logprobs is not None:
        estimate = kl_estimate(logprobs, reference_logprobs.detach().masked_fill(~mask, 0.0), kl_estimator)
        kl = (ratio.detach() * estimate.detach()).masked_fill(~mask, 0.0).sum()
        plain_kl = estimate.detach().masked_fill(~mask, 0.0).sum()
        if kl_beta != 0.0:
            token_loss = token_loss + kl_beta * ratio * estimate
    elif kl_beta != 0.0:
        raise ValueError("kl_beta != 0 needs reference_logprobs")
    row_sums = masked_row_sums(token_loss, mask)
    if loss_type == "grpo":
        row_sums = row_sums / mask.sum(dim=1).clamp(min=1).to(row_sums.dtype)
    # A step with nothing to count (every row masked) has every share 0: divide by 1, not 0.
    loss = row_sums.sum() / max(float(normaliser), 1.0)
    with torch.no_grad():
        clipped_low = (mask & (advantage < 0) & (ratio < 1.0 - epsilon_low)).sum()
        clipped_high = (mask & (advantage > 0) & (ratio > 1.0 + epsilon_high)).sum()
    return GrpoOutput(
        loss=loss, kl_sum=kl, plain_kl_sum=plain_kl, clipped_low=clipped_low, clipped_high=clipped_high,
        num_tokens=mask.sum(),
    )


def _check_loss_type(loss_type: str) -> None:
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r} (expected one of {', '.join(LOSS_TYPES)})")


def _check_estimator(estimator: str) -> None:
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r} (expected one of {', '.join(KL_ESTIMATORS)})")
