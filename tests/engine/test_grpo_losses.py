"""GRPO (`rewind.engine.posttrain.grpo_losses`): rewards and advantages against plain Python, the clipped loss
against a plain loop over rows and tokens (values and gradients, every loss type and KL estimator), and
the step's normaliser: neither micro-batches nor ranks change the gradient. The updates of a rollout
batch and the KL estimators' claims are in test_grpo_updates.py."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.engine.posttrain.grpo_losses import (
    LOSS_TYPES,
    group_advantages,
    grpo_loss,
    grpo_normaliser,
    mask_truncated,
    reward_figures,
    weighted_rewards,
)
from rewind.engine.posttrain.response_logprobs import token_logprobs

NAN = float("nan")


# --- rewards and advantages -------------------------------------------------------------------------


def test_weighted_rewards_skip_none_and_stay_nan_when_nothing_scored():
    table = [[1.0, None, 0.5, None], [2.0, 3.0, None, None], [None, -1.0, 4.0, None]]
    weights = [0.5, 2.0, 1.5]
    out = weighted_rewards(torch.tensor([[NAN if v is None else v for v in row] for row in table]), weights)
    for n in range(4):
        scored = [weights[f] * table[f][n] for f in range(3) if table[f][n] is not None]
        if scored:
            assert out[n].item() == pytest.approx(math.fsum(scored), rel=1e-6)
        else:
            assert math.isnan(out[n].item())


def _plain_advantages(rewards: list[list[float]], scale: str, eps: float) -> list[list[float]]:
    everything = [r for group in rewards for r in group if not math.isnan(r)]
    batch_std = statistics.stdev(everything) if len(everything) > 1 else 0.0
    out = []
    for group in rewards:
        scored = [r for r in group if not math.isnan(r)]
        mean = statistics.fmean(scored) if scored else 0.0
        std = {"group": statistics.stdev(scored) if len(scored) > 1 else 0.0, "batch": batch_std}.get(scale)
        row = []
        for r in group:
            if math.isnan(r):
                row.append(0.0)
            else:
                row.append((r - mean) if std is None else (r - mean) / (std + eps))
        out.append(row)
    return out


@given(
    seed=st.integers(0, 2**31 - 1),
    prompts=st.integers(1, 5),
    group=st.integers(1, 6),
    scale=st.sampled_from(["group", "batch", "none"]),
    nan_rate=st.sampled_from([0.0, 0.3]),
    discrete=st.booleans(),
)
def test_group_advantages_match_plain_statistics(seed, prompts, group, scale, nan_rate, discrete):
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(prompts, group, generator=generator, dtype=torch.float64)
    if discrete:  # exact-match rewards: ties and all-equal groups
        rewards = (rewards > 0).double()
    rewards[torch.rand(prompts, group, generator=generator) < nan_rate] = NAN
    out = group_advantages(rewards, scale_rewards=scale, eps=1e-4)
    want = _plain_advantages(rewards.tolist(), scale, 1e-4)
    assert not torch.isnan(out).any()
    assert torch.allclose(out, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_group_std_is_torch_std_unbiased_and_single_completions_get_zero():
    generator = torch.Generator().manual_seed(3)
    rewards = torch.randn(4, 5, generator=generator)
    out = group_advantages(rewards, eps=1e-4)
    want = (rewards - rewards.mean(dim=1, keepdim=True)) / (rewards.std(dim=1, keepdim=True) + 1e-4)
    assert out.dtype == torch.float32
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(group_advantages(torch.randn(6, 1, generator=generator))) == 0
    lone = torch.tensor([[0.7, NAN, NAN], [1.0, 1.0, 1.0]])
    assert torch.count_nonzero(group_advantages(lone)) == 0  # one scored completion; all equal


# --- the clipped loss against a plain loop ----------------------------------------------------------


def _plain_grpo(logp, old, ref, adv, mask, loss_type, eps_low, eps_high, beta, estimator, max_len):
    """The loss written out token by token; normalised over this whole batch."""
    rows, length = mask.shape
    num_tokens = sum(int(mask[b, t]) for b in range(rows) for t in range(length))
    normaliser = {"grpo": rows, "bnpo": num_tokens, "dapo": num_tokens, "dr_grpo": rows * max_len}[loss_type]
    total = torch.zeros((), dtype=torch.float64)
    for b in range(rows):
        row, count = torch.zeros((), dtype=torch.float64), 0
        for t in range(length):
            if not mask[b, t]:
                continue
            count += 1
            ratio = torch.exp(logp[b, t] - float(old[b, t]))
            a = float(adv[b])
            unclipped = ratio * a
            clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a
            term = -(unclipped if unclipped.item() <= clipped.item() else clipped)
            if beta:
                log_ref_over_pi = float(ref[b, t]) - logp[b, t]
                if estimator == "k1":
                    k = -log_ref_over_pi
                elif estimator == "k2":
                    k = 0.5 * log_ref_over_pi**2
                else:
                    k = torch.exp(log_ref_over_pi) - 1 - log_ref_over_pi
                term = term + beta * ratio * k
            row = row + term
        total = total + (row / max(count, 1) if loss_type == "grpo" else row)
    return total / normaliser


def _rollout(seed: int, rows: int = 4, length: int = 9):
    generator = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(rows, length, generator=generator, dtype=torch.float64) * 4).requires_grad_(True)
    # Old log-probs within +-0.5 of the new: ratios on both sides of the clip band.
    old = logp.detach() + (torch.rand(rows, length, generator=generator, dtype=torch.float64) - 0.5)
    ref = logp.detach() + torch.randn(rows, length, generator=generator, dtype=torch.float64) * 0.5
    adv = torch.randn(rows, generator=generator, dtype=torch.float64)
    mask = torch.rand(rows, length, generator=generator) < 0.75
    mask[0] = False  # a masked-out (truncated) completion
    mask[1, -3:] = False
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(("beta", "estimator"), [(0.0, "k3"), (0.2, "k1"), (0.2, "k2"), (0.2, "k3")])
def test_the_loss_matches_a_plain_loop_with_its_gradient(loss_type, beta, estimator):
    logp, old, ref, adv, mask = _rollout(20)
    settings = {"eps_low": 0.2, "eps_high": 0.28, "beta": beta, "estimator": estimator, "max_len": 12}
    out = grpo_loss(
        logp,
        old,
        ref,
        adv,
        mask,
        loss_type=loss_type,
        epsilon_low=0.2,
        epsilon_high=0.28,
        normaliser=grpo_normaliser([mask], loss_type, 12),
        kl_beta=beta,
        kl_estimator=estimator,
    )
    plain = _plain_grpo(logp, old, ref, adv, mask, loss_type, **settings)
    assert out.loss.item() == pytest.approx(plain.item(), rel=1e-12)
    (grad,) = torch.autograd.grad(out.loss, logp)
    (want,) = torch.autograd.grad(plain, logp)
    assert torch.allclose(grad, want, rtol=1e-10, atol=1e-14)
    assert out.clipped_low + out.clipped_high > 0  # the band matters in this example
    ratio = torch.exp(logp.detach() - old)
    assert out.clipped_high.item() == int((mask & (adv[:, None] > 0) & (ratio > 1.28)).sum())
    assert out.num_tokens.item() == int(mask.sum())
    plain_k = {
        "k1": lambda log_ratio: log_ratio,
        "k2": lambda log_ratio: log_ratio**2 / 2,
        "k3": lambda log_ratio: math.exp(-log_ratio) - 1 + log_ratio,
    }[estimator]
    # the importance-weighted sum the loss's KL term weighs, not the plain one
    want_kl = math.fsum(
        math.exp(float(logp[b, t].detach() - old[b, t])) * plain_k(float(logp[b, t].detach() - ref[b, t]))
        for b, t in mask.nonzero().tolist()
    )
    assert out.kl_sum.item() == pytest.approx(want_kl, rel=1e-12)
    # and the plain sum, what a run started before scored_reward_figures logs
    want_plain = math.fsum(plain_k(float(logp[b, t].detach() - ref[b, t])) for b, t in mask.nonzero().tolist())
    assert out.plain_kl_sum.item() == pytest.approx(want_plain, rel=1e-12)
    assert abs(want_plain - want_kl) > 1e-6 * abs(want_plain)  # the ratios are not 1 here: they differ


def test_padding_holds_anything_without_reaching_the_loss_or_gradient():
    logp, old, ref, adv, mask = _rollout(21)
    kwargs = {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.2, "normaliser": 7.0, "kl_beta": 0.1}
    clean = grpo_loss(logp, old, ref, adv, mask, **kwargs)
    junk = logp.detach().masked_fill(~mask, -math.inf).requires_grad_(True)
    dirty = grpo_loss(
        junk, old.masked_fill(~mask, math.nan), ref.masked_fill(~mask, math.inf), adv, mask, **kwargs
    )
    assert dirty.loss.item() == clean.loss.item()
    (grad,) = torch.autograd.grad(dirty.loss, junk)
    (want,) = torch.autograd.grad(clean.loss, logp)
    assert torch.equal(grad, want)


# --- the normaliser and micro-batch invariance ------------------------------------------------------


def test_the_normaliser_counts_what_each_loss_type_names_and_adds_over_ranks():
    masks = [
        torch.tensor([[True, True, False], [True, False, False]]),
        torch.tensor([[True, True, True, True]]),
    ]
    assert grpo_normaliser(masks, "grpo", 8) == 3.0
    assert grpo_normaliser(masks, "bnpo", 8) == 7.0
    assert grpo_normaliser(masks, "dapo", 8) == 7.0
    assert grpo_normaliser(masks, "dr_grpo", 8) == 24.0
    for loss_type in LOSS_TYPES:  # two ranks' counts add up to the count over both
        assert grpo_normaliser(masks[:1], loss_type, 8) + grpo_normaliser(masks[1:], loss_type, 8) == (
            grpo_normaliser(masks, loss_type, 8)
        )
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_normaliser(masks, "dr_grpo", 3)
    with pytest.raises(ValueError, match="unknown loss_type"):
        grpo_normaliser(masks, "ppo", 8)


def test_mask_truncated_clears_the_rows_of_truncated_completions():
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    out = mask_truncated(mask, torch.tensor([False, True, False]))
    assert out.tolist() == [[True, True], [False, False], [True, True]]


def _micro_batch_gradient(splits, loss_type, kl_beta, rank_cut=None):
    """The loss and gradient of a step over 4 completions cut into micro-batches of `splits` rows, each
    trimmed to its own longest completion (so padding differs between the cuts). With `rank_cut`, the
    first rank_cut micro-batches are one rank's and the rest another's: each counts its normaliser and
    the counts are summed, as the caller's sum over ranks would (the gradients are summed too)."""
    generator = torch.Generator().manual_seed(50)
    rows, length, vocab = 4, 8, 6
    base = torch.randn(length, vocab, generator=generator)
    offsets = torch.randn(rows, length, vocab, generator=generator)
    targets = torch.randint(vocab, (rows, length), generator=generator)
    lengths = [8, 3, 6, 1]
    mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    old = token_logprobs(
        base + offsets + 0.3 * torch.randn(rows, length, vocab, generator=generator), targets, mask
    )
    ref = token_logprobs(
        base + offsets + 0.3 * torch.randn(rows, length, vocab, generator=generator), targets, mask
    )
    adv = torch.randn(rows, generator=generator)
    theta = base.clone().requires_grad_(True)
    starts = [sum(splits[:i]) for i in range(len(splits))]
    cuts = [slice(start, start + size) for start, size in zip(starts, splits, strict=True)]
    trimmed = [max(lengths[cut]) for cut in cuts]
    masks = [mask[cut, :end] for cut, end in zip(cuts, trimmed, strict=True)]
    ranks = [masks] if rank_cut is None else [masks[:rank_cut], masks[rank_cut:]]
    normaliser = sum(grpo_normaliser(rank_masks, loss_type, 10) for rank_masks in ranks)
    total = torch.zeros(())
    for cut, end in zip(cuts, trimmed, strict=True):
        logp = token_logprobs(theta[:end] + offsets[cut, :end], targets[cut, :end], mask[cut, :end])
        out = grpo_loss(
            logp,
            old[cut, :end],
            ref[cut, :end],
            adv[cut],
            mask[cut, :end],
            loss_type=loss_type,
            epsilon_low=0.2,
            epsilon_high=0.28,
            normaliser=normaliser,
            kl_beta=kl_beta,
            kl_estimator="k3",
        )
        out.loss.backward()
        total = total + out.loss.detach()
    return total, theta.grad


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_micro_batches_do_not_change_the_gradient(loss_type, kl_beta):
    whole_loss, whole = _micro_batch_gradient([4], loss_type, kl_beta)
    assert torch.count_nonzero(whole) > 0
    for splits in ([1, 1, 1, 1], [3, 1], [2, 2]):
        loss, grad = _micro_batch_gradient(splits, loss_type, kl_beta)
        assert torch.allclose(loss, whole_loss, rtol=1e-6, atol=1e-7)
        assert torch.allclose(grad, whole, rtol=1e-5, atol=1e-7)


@settings(max_examples=30)
@given(
    loss_type=st.sampled_from(LOSS_TYPES),
    splits=st.sampled_from([[4], [1, 3], [3, 1], [2, 2], [1, 1, 2], [2, 1, 1], [1, 2, 1], [1, 1, 1, 1]]),
    data=st.data(),
)
def test_neither_micro_batches_nor_ranks_change_the_gradient(loss_type, splits, data):
    rank_cut = data.draw(st.integers(0, len(splits)))
    whole_loss, whole = _micro_batch_gradient([4], loss_type, 0.1)
    loss, grad = _micro_batch_gradient(splits, loss_type, 0.1, rank_cut)
    assert torch.allclose(loss, whole_loss, rtol=1e-6, atol=1e-7)
    assert torch.allclose(grad, whole, rtol=1e-5, atol=1e-7)


def test_bad_settings_are_refused():
    logp, old, ref, adv, mask = _rollout(60)
    kwargs = {"loss_type": "dapo", "epsilon_low": 0.2, "epsilon_high": 0.2, "normaliser": 5.0}
    with pytest.raises(ValueError, match="unknown loss_type"):
        grpo_loss(logp, old, ref, adv, mask, **{**kwargs, "loss_type": "ppo"})
    with pytest.raises(ValueError, match="unknown KL estimator"):
        grpo_loss(logp, old, ref, adv, mask, **kwargs, kl_estimator="k4")
    with pytest.raises(ValueError, match="needs reference_logprobs"):
        grpo_loss(logp, old, None, adv, mask, **kwargs, kl_beta=0.1)
    with pytest.raises(ValueError, match="epsilon_low"):
        grpo_loss(logp, old, ref, adv, mask, **{**kwargs, "epsilon_low": -0.1})
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.zeros(2, 2), scale_rewards="max")


def test_the_reward_figures_are_over_the_scored_completions():
    assert reward_figures(torch.tensor([1.0, NAN, 0.5, NAN])) == (0.75, 2)
    assert reward_figures(torch.tensor([0.25, 1.0])) == (0.625, 0)
    assert reward_figures(torch.tensor([NAN, NAN, NAN])) == (0.0, 3)


def test_a_run_started_before_scored_figures_counts_the_unscored_as_0_and_not_apart():
    """Its records and steps carry the figures they always had: the float32 mean of every completion's
    reward, an unscored one's as 0, and no unscored count."""
    rewards = torch.tensor([1.0, NAN, 0.5, NAN, 0.1])
    assert reward_figures(rewards, scored_figures=False) == (float(torch.tensor([1.0, 0.0, 0.5, 0.0, 0.1]).mean()), 0)
    assert reward_figures(rewards, scored_figures=False)[0] != reward_figures(rewards)[0]
    assert reward_figures(torch.tensor([NAN, NAN]), scored_figures=False) == (0.0, 0)
