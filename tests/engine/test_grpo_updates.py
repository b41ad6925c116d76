"""GRPO's updates of one rollout batch (`rewind.engine.posttrain.grpo_losses`): the ratio exactly 1 with the plain
policy gradient on the first update, the clip stopping the gradient on the second (num_iterations = 2),
and the KL estimators' claims checked by exact enumeration over a 5-action categorical policy."""

from __future__ import annotations

import pytest
import torch

from rewind.engine.posttrain.grpo_losses import grpo_loss, grpo_normaliser, importance_ratio
from rewind.engine.posttrain.response_logprobs import token_logprobs

# --- ratio 1 on the first update, the clip on the second --------------------------------------------


def _per_token_policy(seed: int, rows: int, length: int, vocab: int):
    """Logits that are parameters per (row, position): each token moves by its own gradient only."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, length, vocab, generator=generator)
    targets = torch.randint(vocab, (rows, length), generator=generator)
    mask = torch.ones(rows, length, dtype=torch.bool)
    return logits, targets, mask


def test_the_first_update_has_ratio_exactly_one_and_the_policy_gradient_of_the_advantage():
    logits, targets, mask = _per_token_policy(30, 4, 6, 7)
    mask[2, 3:] = False
    params = logits.clone().requires_grad_(True)
    logp = token_logprobs(params, targets, mask, temperature=0.9)
    with torch.no_grad():  # the old policy: the same weights through the same code
        old = token_logprobs(logits, targets, mask, temperature=0.9)
    assert torch.equal(importance_ratio(logp, old), torch.ones_like(old))
    adv = torch.tensor([1.5, -0.5, 0.25, -2.0])
    normaliser = grpo_normaliser([mask], "bnpo", 6)
    out = grpo_loss(
        logp, old, None, adv, mask, loss_type="bnpo", epsilon_low=0.0, epsilon_high=0.0, normaliser=normaliser
    )
    assert out.clipped_low.item() == 0 and out.clipped_high.item() == 0
    (grad,) = torch.autograd.grad(out.loss, params, retain_graph=True)
    (want,) = torch.autograd.grad(-(adv[:, None] * logp).sum() / normaliser, params)
    assert torch.allclose(grad, want, rtol=1e-6, atol=1e-9)
    assert torch.count_nonzero(want) > 0


def test_with_two_iterations_the_clip_stops_the_gradient_on_the_second_update():
    logits, targets, mask = _per_token_policy(31, 4, 5, 6)
    # Large advantages push their tokens out of the band in one step; small ones stay inside it.
    adv = torch.tensor([3.0, -3.0, 0.02, -0.02])
    settings = {"loss_type": "grpo", "epsilon_low": 0.2, "epsilon_high": 0.2, "normaliser": 4.0}
    params = logits.clone().requires_grad_(True)
    with torch.no_grad():
        old = token_logprobs(logits, targets, mask)  # sampled by the rollout's policy
    first = grpo_loss(token_logprobs(params, targets, mask), old, None, adv, mask, **settings)
    (grad,) = torch.autograd.grad(first.loss, params)
    assert first.clipped_low.item() == 0 and first.clipped_high.item() == 0
    params = (params.detach() - 20.0 * grad).requires_grad_(True)  # one optimizer step (SGD)
    logp = token_logprobs(params, targets, mask)
    second = grpo_loss(logp, old, None, adv, mask, **settings)
    (grad_logp,) = torch.autograd.grad(second.loss, logp)
    ratio = torch.exp(logp.detach() - old)
    assert bool((ratio[0] > 1.2).all()) and bool((ratio[1] < 0.8).all())
    assert bool(((ratio[2:] > 0.8) & (ratio[2:] < 1.2)).all())
    assert second.clipped_high.item() == 5 and second.clipped_low.item() == 5
    assert torch.count_nonzero(grad_logp[:2]) == 0  # clipped: no gradient
    assert torch.count_nonzero(grad_logp[2:]) == 10  # inside the band: the full policy gradient


# --- the KL estimators by exact enumeration ---------------------------------------------------------


def _expected_over_actions(theta, old_logits, ref_logits, estimator):
    """E_{a ~ old}[loss_a] and its gradient, summing grpo_loss's KL term over all 5 actions."""
    old_logp = old_logits.log_softmax(-1)
    ref_logp = ref_logits.log_softmax(-1)
    value = torch.zeros((), dtype=torch.float64)
    for action in range(5):
        logp = theta.log_softmax(-1)[action].reshape(1, 1)
        out = grpo_loss(
            logp,
            old_logp[action].reshape(1, 1),
            ref_logp[action].reshape(1, 1),
            torch.zeros(1, dtype=torch.float64),
            torch.ones(1, 1, dtype=torch.bool),
            loss_type="bnpo",
            epsilon_low=0.2,
            epsilon_high=0.2,
            normaliser=1.0,
            kl_beta=1.0,
            kl_estimator=estimator,
        )
        value = value + old_logp[action].exp() * out.loss
    (grad,) = torch.autograd.grad(value, theta)
    return value.item(), grad


def _true(theta, ref_logits, what):
    logp = theta.log_softmax(-1)
    d = logp - ref_logits.log_softmax(-1)
    value = (logp.exp() * (d if what == "kl" else 0.5 * d**2)).sum()
    (grad,) = torch.autograd.grad(value, theta)
    return value.item(), grad


@pytest.mark.parametrize("on_policy", [True, False])
def test_k1_and_k3_are_unbiased_for_the_kl_and_its_gradient_and_k2_for_neither(on_policy):
    generator = torch.Generator().manual_seed(40)
    theta = torch.randn(5, generator=generator, dtype=torch.float64).requires_grad_(True)
    ref_logits = torch.randn(5, generator=generator, dtype=torch.float64)
    old_logits = (
        theta.detach().clone() if on_policy else torch.randn(5, generator=generator, dtype=torch.float64)
    )
    kl, kl_grad = _true(theta, ref_logits, "kl")
    for estimator in ("k1", "k3"):
        value, grad = _expected_over_actions(theta, old_logits, ref_logits, estimator)
        assert value == pytest.approx(kl, rel=1e-12)
        assert torch.allclose(grad, kl_grad, rtol=1e-10, atol=1e-13)
    value, grad = _expected_over_actions(theta, old_logits, ref_logits, "k2")
    half_square, half_square_grad = _true(theta, ref_logits, "half_square")
    assert value == pytest.approx(half_square, rel=1e-12)  # what k2 is unbiased for
    assert torch.allclose(grad, half_square_grad, rtol=1e-10, atol=1e-13)
    assert abs(value - kl) > 1e-3 * kl
    assert (grad - kl_grad).abs().max() > 1e-3 * kl_grad.abs().max()
