"""DPO (`rewind.engine.posttrain.dpo_losses`) against a plain implementation, values (math) and gradients
(torch scalars in loops), every variant; at initialisation (policy = reference through the same code)
log-ratios exactly 0, loss ln 2, accuracy 0."""

from __future__ import annotations

import math

import pytest
import torch

from rewind.engine.posttrain.dpo_losses import DPO_VARIANTS, dpo_loss
from rewind.engine.posttrain.response_logprobs import sequence_logprobs, token_counts

BETA = 0.3


def _pairs(seed: int, rows: int = 6):
    """Summed log-probs (float64 leaves for the policy) and token counts of `rows` random pairs."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 20, (2, rows), generator=generator)
    policy = (-torch.rand(2, rows, generator=generator, dtype=torch.float64) * lengths * 2).requires_grad_(
        True
    )
    reference = policy.detach() + torch.randn(2, rows, generator=generator, dtype=torch.float64) * 3
    return policy, reference, lengths


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _plain_value(variant, pc, pr, rc, rr, nc, nr, ls):
    if variant == "ipo":
        h = (pc - rc) / nc - (pr - rr) / nr
        return (h - 1 / (2 * BETA)) ** 2
    x = BETA * ((pc - rc) - (pr - rr))
    if variant == "sigmoid":
        return -(1 - ls) * _log_sigmoid(x) - ls * _log_sigmoid(-x)
    if variant == "robust":
        return ((1 - ls) * -_log_sigmoid(x) - ls * -_log_sigmoid(-x)) / (1 - 2 * ls)
    return max(0.0, 1 - x)


def _plain_torch_mean(variant, policy, reference, lengths, ls):
    """The same formulas on torch scalars, one pair at a time, for autograd."""
    total = torch.zeros((), dtype=torch.float64)
    rows = policy.shape[1]
    for i in range(rows):
        pc, pr, rc, rr = policy[0, i], policy[1, i], float(reference[0, i]), float(reference[1, i])
        if variant == "ipo":
            h = (pc - rc) / int(lengths[0, i]) - (pr - rr) / int(lengths[1, i])
            total = total + (h - 1 / (2 * BETA)) ** 2
            continue
        x = BETA * ((pc - rc) - (pr - rr))
        log_sig, log_sig_neg = -torch.log1p(torch.exp(-x)), -torch.log1p(torch.exp(x))
        if variant == "sigmoid":
            total = total - (1 - ls) * log_sig - ls * log_sig_neg
        elif variant == "robust":
            total = total + ((1 - ls) * -log_sig - ls * -log_sig_neg) / (1 - 2 * ls)
        else:
            total = total + (1 - x if (1 - x).detach().item() > 0 else 0 * x)
    return total / rows


@pytest.mark.parametrize(
    ("variant", "ls"),
    [("sigmoid", 0.0), ("sigmoid", 0.2), ("robust", 0.0), ("robust", 0.2), ("ipo", 0.0), ("hinge", 0.0)],
)
def test_each_variant_matches_a_plain_implementation_with_its_gradient(variant, ls):
    policy, reference, lengths = _pairs(7)
    out = dpo_loss(
        policy[0],
        policy[1],
        reference[0],
        reference[1],
        beta=BETA,
        variant=variant,
        label_smoothing=ls,
        chosen_lengths=lengths[0],
        rejected_lengths=lengths[1],
    )
    p, r = policy.tolist(), reference.tolist()
    for i in range(policy.shape[1]):
        want = _plain_value(
            variant, p[0][i], p[1][i], r[0][i], r[1][i], int(lengths[0, i]), int(lengths[1, i]), ls
        )
        assert out.losses[i].item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    plain = _plain_torch_mean(variant, policy, reference, lengths, ls)
    assert out.loss.item() == pytest.approx(plain.item(), rel=1e-12)
    (grad,) = torch.autograd.grad(out.loss, policy)
    (want_grad,) = torch.autograd.grad(plain, policy)
    assert torch.count_nonzero(want_grad) > 0
    assert torch.allclose(grad, want_grad, rtol=1e-10, atol=1e-12)


def test_metrics_are_the_implicit_rewards_with_a_strict_accuracy():
    policy, reference, _ = _pairs(8, rows=5)
    policy_rejected = policy[1].detach().clone()
    reference_rejected = reference[1].clone()
    # Pair 0: chosen and rejected rewards tie exactly, which counts as wrong.
    policy_rejected[0] = reference_rejected[0] + (policy[0, 0].item() - reference[0, 0].item())
    out = dpo_loss(policy[0], policy_rejected, reference[0], reference_rejected, beta=BETA)
    metrics = out.metrics()
    p, r = policy.tolist(), reference.tolist()
    chosen = [BETA * (p[0][i] - r[0][i]) for i in range(5)]
    rejected = [BETA * (policy_rejected[i].item() - reference_rejected[i].item()) for i in range(5)]
    assert chosen[0] == rejected[0]
    assert metrics["chosen_rewards"].item() == pytest.approx(math.fsum(chosen) / 5, rel=1e-12)
    assert metrics["rejected_rewards"].item() == pytest.approx(math.fsum(rejected) / 5, rel=1e-12)
    assert metrics["margin"].item() == pytest.approx(
        math.fsum(c - j for c, j in zip(chosen, rejected, strict=True)) / 5
    )
    assert metrics["accuracy"].item() == sum(c > j for c, j in zip(chosen, rejected, strict=True)) / 5
    assert metrics["chosen_logps"].item() == pytest.approx(math.fsum(p[0]) / 5, rel=1e-12)
    assert metrics["rejected_logps"].item() == pytest.approx(policy_rejected.mean().item(), rel=1e-12)
    assert not out.chosen_rewards.requires_grad


def test_the_sft_term_is_the_chosen_nll_per_token_with_its_gradient():
    policy, reference, lengths = _pairs(9)
    out = dpo_loss(
        policy[0], policy[1], reference[0], reference[1], beta=BETA, chosen_lengths=lengths[0], sft_weight=0.4
    )
    plain = torch.zeros((), dtype=torch.float64)
    for i in range(policy.shape[1]):
        plain = plain - policy[0, i]
    plain = 0.4 * plain / sum(int(n) for n in lengths[0])
    assert out.sft_loss.item() == pytest.approx(plain.item(), rel=1e-12)
    (grad,) = torch.autograd.grad(out.sft_loss, policy)
    (want,) = torch.autograd.grad(plain, policy)
    assert torch.allclose(grad, want, rtol=1e-12)
    without = dpo_loss(policy[0], policy[1], reference[0], reference[1], beta=BETA)
    assert without.sft_loss.item() == 0.0


def test_micro_batches_share_the_step_normalisers():
    policy, reference, lengths = _pairs(12)
    whole = dpo_loss(
        policy[0], policy[1], reference[0], reference[1], beta=BETA, chosen_lengths=lengths[0], sft_weight=0.4
    )
    whole_grad = torch.autograd.grad(whole.loss + whole.sft_loss, policy)[0]
    step_tokens, step_pairs = float(lengths[0].sum()), policy.shape[1]
    loss, sft = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):
        part = dpo_loss(
            policy[0, rows],
            policy[1, rows],
            reference[0, rows],
            reference[1, rows],
            beta=BETA,
            sft_weight=0.4,
            sft_normaliser=step_tokens,
        )
        loss, sft = loss + part.losses.sum() / step_pairs, sft + part.sft_loss
    assert loss.item() == pytest.approx(whole.loss.item(), rel=1e-12)
    assert sft.item() == pytest.approx(whole.sft_loss.item(), rel=1e-12)
    assert torch.allclose(torch.autograd.grad(loss + sft, policy)[0], whole_grad, rtol=1e-12)


@pytest.mark.parametrize("variant", DPO_VARIANTS)
def test_at_initialisation_log_ratios_are_exactly_zero(variant):
    generator = torch.Generator().manual_seed(10)
    logits = torch.randn(2, 4, 12, 17, generator=generator)  # (chosen/rejected, B, T, V)
    targets = torch.randint(17, (2, 4, 12), generator=generator)
    mask = torch.rand(2, 4, 12, generator=generator) < 0.6
    mask[..., 0] = True
    policy_logits = logits.clone().requires_grad_(True)
    policy = [sequence_logprobs(policy_logits[i], targets[i], mask[i]) for i in range(2)]
    with torch.no_grad():
        reference = [sequence_logprobs(logits[i], targets[i], mask[i]) for i in range(2)]
    ls = 0.1 if variant in ("sigmoid", "robust") else 0.0
    out = dpo_loss(
        *policy,
        *reference,
        beta=BETA,
        variant=variant,
        label_smoothing=ls,
        chosen_lengths=token_counts(mask[0]),
        rejected_lengths=token_counts(mask[1]),
    )
    metrics = out.metrics()
    assert torch.count_nonzero(out.chosen_rewards) == 0 and torch.count_nonzero(out.rejected_rewards) == 0
    assert metrics["margin"].item() == 0.0
    assert metrics["accuracy"].item() == 0.0
    expected = {"sigmoid": math.log(2), "robust": math.log(2), "ipo": (1 / (2 * BETA)) ** 2, "hinge": 1.0}
    assert torch.allclose(out.loss, torch.tensor(expected[variant]), rtol=1e-7, atol=0)
    assert all(value.item() == pytest.approx(expected[variant], rel=1e-7) for value in out.losses)


def test_bad_settings_are_refused():
    policy, reference, _ = _pairs(11)
    args = (policy[0], policy[1], reference[0], reference[1])
    with pytest.raises(ValueError, match="unknown DPO variant"):
        dpo_loss(*args, beta=BETA, variant="kto")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(*args, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*args, beta=BETA, label_smoothing=0.5)
    with pytest.raises(ValueError, match="not hinge"):
        dpo_loss(*args, beta=BETA, variant="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="ipo variant needs"):
        dpo_loss(*args, beta=BETA, variant="ipo")
    with pytest.raises(ValueError, match="sft_normaliser must be > 0"):
        dpo_loss(*args, beta=BETA, sft_weight=1.0, sft_normaliser=0.0)
    with pytest.raises(ValueError, match="SFT term needs"):
        dpo_loss(*args, beta=BETA, sft_weight=1.0)
