"""The fused losses against the plain torch reference: values and gradients, every KL kind."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.kernels.losses import fused_losses, reference_losses


def _inputs(seed: int, batch: int, seq: int, vocab: int, mask_p: float):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, seq, vocab, generator=g, dtype=torch.float64) * 3
    ref = torch.randn(batch, seq, vocab, generator=g, dtype=torch.float64) * 3
    targets = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.rand(batch, seq, generator=g) < mask_p
    return logits, ref, targets, mask


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 3),
    seq=st.integers(1, 9),
    vocab=st.integers(2, 40),
    mask_p=st.sampled_from([0.0, 0.3, 1.0]),
    beta=st.sampled_from([0.0, 0.5]),
    kind=st.sampled_from(["token_kl", "nll_difference"]),
    chunk=st.integers(1, 8),
)
def test_fused_matches_reference_values_and_gradients(seed, batch, seq, vocab, mask_p, beta, kind, chunk):
    logits, ref, targets, mask = _inputs(seed, batch, seq, vocab, mask_p)
    num = int(mask.sum()) + 3  # a global denominator larger than this micro-batch's share
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    want = reference_losses(a, targets, mask, num, ref, beta, kind)
    got = fused_losses(b, targets, mask, num, ref, beta, kind, chunk_rows=chunk)
    torch.testing.assert_close(got.ce, want.ce)
    torch.testing.assert_close(got.kl, want.kl)
    torch.testing.assert_close(got.objective, want.objective)
    assert int(got.num_correct) == int(want.num_correct)
    want.objective.backward()
    got.objective.backward()
    torch.testing.assert_close(b.grad, a.grad)


def test_token_kl_is_zero_against_itself_and_positive_otherwise():
    logits, ref, targets, mask = _inputs(0, 2, 5, 11, 1.0)
    same = fused_losses(logits, targets, mask, int(mask.sum()), logits.clone(), 1.0)
    assert abs(float(same.kl)) < 1e-12
    other = fused_losses(logits, targets, mask, int(mask.sum()), ref, 1.0)
    assert float(other.kl) > 0.1


def test_nll_difference_gradient_is_a_rescaled_task_gradient():
    # The documented flaw of the original ABCD penalty: the reference does not shape the gradient.
    logits, ref, targets, mask = _inputs(1, 2, 4, 7, 1.0)
    beta = 0.7
    a = logits.clone().requires_grad_(True)
    fused_losses(a, targets, mask, int(mask.sum()), ref, beta, "nll_difference").objective.backward()
    b = logits.clone().requires_grad_(True)
    fused_losses(b, targets, mask, int(mask.sum())).objective.backward()
    torch.testing.assert_close(a.grad, (1 + beta) * b.grad)


def test_token_kl_gradient_depends_on_the_reference():
    logits, ref, targets, mask = _inputs(2, 2, 4, 7, 1.0)
    grads = []
    for reference in (ref, -ref):
        x = logits.clone().requires_grad_(True)
        fused_losses(x, targets, mask, int(mask.sum()), reference, 0.5).objective.backward()
        grads.append(x.grad)
    assert not torch.allclose(grads[0], grads[1])


def test_micro_batch_losses_sum_to_the_global_mean():
    logits, _, targets, mask = _inputs(3, 4, 6, 9, 0.5)
    num = int(mask.sum())
    whole = fused_losses(logits, targets, mask, num)
    parts = [fused_losses(logits[i : i + 2], targets[i : i + 2], mask[i : i + 2], num) for i in (0, 2)]
    torch.testing.assert_close(parts[0].ce + parts[1].ce, whole.ce)


def test_unknown_kind_is_rejected():
    logits, ref, targets, mask = _inputs(4, 1, 2, 3, 1.0)
    with pytest.raises(ValueError, match="unknown KL kind"):
        fused_losses(logits, targets, mask, 2, ref, 0.1, "bogus")
