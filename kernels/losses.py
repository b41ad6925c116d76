"""Training losses: masked next-token cross-entropy plus a KL penalty to a frozen reference.

Two implementations with one contract:
- `reference_losses`: plain torch, written for clarity; the ground truth in tests.
- `fused_losses`: one log-softmax per row chunk shared by the cross-entropy and the KL, so the
  (tokens x vocab) float32 intermediates of a whole batch never exist at once. On CUDA this is where a
  Triton kernel would slot in; on CPU the chunked torch version is what runs.

Both normalise by `num_target_tokens`, the number of masked tokens in the *global* batch, so the sum of
micro-batch losses is the global mean and gradient accumulation does not change the objective.

KL kinds:
- `token_kl`: sum_v p(v) (log p(v) - log q(v)) per masked position, p = policy, q = reference. Its
  gradient pulls the policy's whole distribution towards the reference.
- `nll_difference`: NLL_policy - stop_grad(NLL_reference), as in the original ABCD trainer. Its gradient is
  exactly the task gradient again (so `loss + beta * kl` only rescales the task gradient by 1 + beta):
  the reference never shapes training. Kept for comparison with that trainer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KL_KINDS = ("token_kl", "nll_difference")


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits are reduced in float32; float64 (tests) stays float64."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class KernelUnavailable(RuntimeError):
    """The chosen loss implementation cannot run here (triton is not installed, or cannot run on this
    device): one line, said when a run starts. Both implementations of `linear_losses` raise it."""


@dataclass(frozen=True)
class Losses:
    objective: torch.Tensor  # what backward() is called on: ce + beta * kl (scaled to the global batch)
    ce: torch.Tensor  # detached, this micro-batch's share of the global mean task loss
    kl: torch.Tensor  # detached, likewise for the KL term (0 when no reference)
    num_correct: torch.Tensor  # detached: argmax predictions equal to the target on masked positions


def reference_losses(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    num_target_tokens: int,
    reference_logits: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_kind: str = "token_kl",
) -> Losses:
    denom = float(max(num_target_tokens, 1))
    logp = F.log_softmax(_upcast(logits), dim=-1)
    nll = -logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    weights = mask.float()
    ce = (nll * weights).sum() / denom
    kl = torch.zeros((), dtype=logp.dtype, device=logits.device)
    if reference_logits is not None and beta != 0.0:
        ref_logp = F.log_softmax(_upcast(reference_logits), dim=-1)
        if kl_kind == "token_kl":
            per_token = (logp.exp() * (logp - ref_logp)).sum(-1)
        elif kl_kind == "nll_difference":
            ref_nll = -ref_logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            per_token = nll - ref_nll.detach()
        else:
            raise ValueError(f"unknown KL kind {kl_kind!r}")
        kl = (per_token * weights).sum() / denom
    correct = ((logits.argmax(-1) == targets) & mask).sum()
    return Losses(objective=ce + beta * kl, ce=ce.detach(), kl=kl.detach(), num_correct=correct.detach())


def fused_losses(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    num_target_tokens: int,
    reference_logits: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_kind: str = "token_kl",
    chunk_rows: int = 4096,
) -> Losses:
    """Same contract as `reference_losses`, computed over chunks of flattened positions."""
    if kl_kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kl_kind!r}")
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)
    flat_targets = targets.reshape(-1)
    flat_mask = mask.reshape(-1)
    # Only masked positions contribute: dropping the rest first saves work for answer-only tasks.
    keep = flat_mask.nonzero().squeeze(-1)
    use_kl = reference_logits is not None and beta != 0.0
    flat_ref = reference_logits.reshape(-1, vocab).index_select(0, keep) if use_kl else None
    flat_logits = flat_logits.index_select(0, keep)
    flat_targets = flat_targets.index_select(0, keep)
    denom = float(max(num_target_tokens, 1))

    ce_parts, kl_parts, correct = [], [], torch.zeros((), dtype=torch.long, device=logits.device)
    for start in range(0, flat_logits.shape[0], chunk_rows):
        chunk = _upcast(flat_logits[start : start + chunk_rows])
        tgt = flat_targets[start : start + chunk_rows]
        logp = F.log_softmax(chunk, dim=-1)
        nll = -logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
        ce_parts.append(nll.sum())
        correct = correct + (chunk.detach().argmax(-1) == tgt).sum()
        if use_kl:
            ref_logp = F.log_softmax(_upcast(flat_ref[start : start + chunk_rows]), dim=-1)
            if kl_kind == "token_kl":
                kl_parts.append((logp.exp() * (logp - ref_logp)).sum())
            else:
                ref_nll = -ref_logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
                kl_parts.append((nll - ref_nll.detach()).sum())
    # No position masked: a zero that keeps the graph connected (the only case that upcasts it all).
    ce = torch.stack(ce_parts).sum() / denom if ce_parts else _upcast(logits).sum() * 0.0 / denom
    kl = (torch.stack(kl_parts).sum() / denom) if kl_parts else torch.zeros((), dtype=ce.dtype, device=ce.device)
    objective = ce + beta * kl if kl_parts else ce
    return Losses(objective=objective, ce=ce.detach(), kl=kl.detach(), num_correct=correct.detach())
