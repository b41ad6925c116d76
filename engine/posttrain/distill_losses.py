"""On-policy distillation's loss: the per-token reverse KL from the student to the teacher.

At every completion token t of a row the student sampled, over the whole vocabulary V:

    KL_t = sum_v p_s(v | x_<t) * (log p_s(v | x_<t) - log p_t(v | x_<t))

with p_s the student's and p_t the teacher's next-token distributions (untempered: the sampling
temperature shapes which prefixes are visited, not the distributions compared). The loss is the token
mean over the step: sum over its rows of mask * KL_t divided by `normaliser`, the step's completion
tokens over every micro-batch and rank, so accumulating micro-batches changes no figure. The teacher's
logits carry no gradient. Reverse KL is mode-seeking: the student is pulled to put its mass where the
teacher does on the prefixes the student itself visits (what makes the distillation on-policy).
`reverse_kl_reference` is the same sum written position by position, for the tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reverse_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, normaliser: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-token KL (B, T) with the mask applied, detached) for logits (B, T, V) and a (B, T) mask
    of the completion tokens; float32 whatever the logits' dtype."""
    if student_logits.shape != teacher_logits.shape or student_logits.shape[:-1] != mask.shape:
        raise ValueError(
            f"student {tuple(student_logits.shape)}, teacher {tuple(teacher_logits.shape)} and mask "
            f"{tuple(mask.shape)} must agree on (B, T, V) and (B, T)"
        )
    if not normaliser > 0:
        raise ValueError(f"normaliser must be positive, got {normaliser}")
    student = F.log_softmax(student_logits.float(), dim=-1)
    teacher = F.log_softmax(teacher_logits.detach().float(), dim=-1)
    per_token = (student.exp() * (student - teacher)).sum(dim=-1) * mask.to(student.dtype)
    return per_token.sum() / normaliser, per_token.detach()


def reverse_kl_reference(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, normaliser: float
) -> torch.Tensor:
    """The loss of `reverse_kl`, one masked position at a time in float64 (a straightforward reference)."""
    total = torch.zeros((), dtype=torch.float64)
    for b, t in mask.nonzero().tolist():
        p = torch.softmax(student_logits[b, t].double(), dim=-1)
        q = torch.softmax(teacher_logits[b, t].double(), dim=-1)
        total = total + (p * (p.log() - q.log())).sum()
    return total / normaliser
