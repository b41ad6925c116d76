"""Per-token and per-sequence log-probs (`rewind.engine.posttrain.response_logprobs`) against a plain
implementation (math, loops over rows and tokens), values and gradients; float32 from any logits'
dtype; padding invariance, bit for bit on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rewind.engine.posttrain.response_logprobs import sequence_logprobs, token_counts, token_logprobs


def _inputs(seed: int, rows: int, length: int, vocab: int, scale: float = 3.0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, length, vocab, generator=generator) * scale
    targets = torch.randint(vocab, (rows, length), generator=generator)
    mask = torch.rand(rows, length, generator=generator) < 0.7
    return logits, targets, mask


def _plain_logprob(row_logits: list[float], target: int, temperature: float) -> float:
    scaled = [z / temperature for z in row_logits]
    top = max(scaled)
    return scaled[target] - top - math.log(math.fsum(math.exp(z - top) for z in scaled))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.3])
def test_sequence_logprobs_match_a_plain_sum_with_their_gradient(temperature):
    logits, targets, mask = _inputs(0, 3, 7, 11)
    logits.requires_grad_(True)
    sums = sequence_logprobs(logits, targets, mask, temperature)
    weights = torch.tensor([0.5, -1.0, 2.0])
    (grad,) = torch.autograd.grad((sums * weights).sum(), logits)
    assert sums.dtype == torch.float32
    rows, length, vocab = logits.shape
    for b in range(rows):
        expected = math.fsum(
            _plain_logprob(logits[b, t].tolist(), int(targets[b, t]), temperature)
            for t in range(length)
            if mask[b, t]
        )
        assert sums[b].item() == pytest.approx(expected, rel=1e-5, abs=1e-5)
        for t in range(length):
            scaled = [z / temperature for z in logits[b, t].tolist()]
            normaliser = math.fsum(math.exp(z) for z in scaled)
            for v in range(vocab):
                # d log p(target) / d z_v = (1[v == target] - p_v) / temperature, on masked positions only
                want = (
                    weights[b].item()
                    * (float(v == int(targets[b, t])) - math.exp(scaled[v]) / normaliser)
                    / temperature
                    if mask[b, t]
                    else 0.0
                )
                assert grad[b, t, v].item() == pytest.approx(want, abs=1e-6)


def test_token_logprobs_are_zero_with_exactly_zero_gradient_off_the_mask():
    logits, targets, mask = _inputs(1, 2, 6, 5)
    targets = targets.masked_fill(~mask, -100)  # an ignore index where nothing is scored: never gathered
    logits.requires_grad_(True)
    values = token_logprobs(logits, targets, mask)
    (grad,) = torch.autograd.grad(values.sum(), logits)
    assert torch.equal(values[~mask], torch.zeros(int((~mask).sum())))
    assert torch.count_nonzero(grad[~mask]) == 0
    assert torch.count_nonzero(grad[mask]) > 0


def test_low_precision_logits_are_read_in_float32():
    logits, targets, mask = _inputs(2, 2, 5, 7)
    half = logits.to(torch.bfloat16)
    values = token_logprobs(half, targets, mask, 0.9)
    assert values.dtype == torch.float32
    assert torch.equal(values, token_logprobs(half.float(), targets, mask, 0.9))


def test_unlikely_tokens_keep_a_finite_log_prob():
    # softmax then log would underflow to log(0) = -inf here; log_softmax keeps -200.
    logits = torch.zeros(1, 1, 3)
    logits[0, 0, 0] = 200.0
    value = token_logprobs(logits, torch.tensor([[1]]), torch.tensor([[True]]))
    assert value.item() == pytest.approx(-200.0)


def test_token_counts_count_the_masked_positions():
    mask = torch.tensor([[True, False, True], [False, False, False]])
    assert token_counts(mask).tolist() == [2, 0]
    assert token_counts(mask).dtype == torch.int64


@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 4),
    length=st.integers(1, 40),
    extra=st.integers(1, 30),
)
def test_padding_anywhere_leaves_sequence_logprobs_bit_for_bit_the_same(seed, rows, length, extra):
    logits, targets, mask = _inputs(seed, rows, length, 9, scale=5.0)
    generator = torch.Generator().manual_seed(seed + 1)
    # Extra masked-out positions, with any logits and any target ids, interleaved at random places.
    pad_logits = torch.randn(rows, extra, 9, generator=generator) * 50
    pad_targets = torch.randint(-100, 9, (rows, extra), generator=generator)
    order = torch.sort(
        torch.cat([torch.arange(length).double(), torch.rand(extra, generator=generator) * length])
    ).indices
    padded_logits = torch.cat([logits, pad_logits], dim=1)[:, order]
    padded_targets = torch.cat([targets, pad_targets], dim=1)[:, order]
    padded_mask = torch.cat([mask, torch.zeros(rows, extra, dtype=torch.bool)], dim=1)[:, order]
    assert torch.equal(
        sequence_logprobs(padded_logits, padded_targets, padded_mask, 0.8),
        sequence_logprobs(logits, targets, mask, 0.8),
    )
    assert torch.equal(token_counts(padded_mask), token_counts(mask))


def test_bad_shapes_and_temperatures_are_refused():
    logits, targets, mask = _inputs(3, 2, 4, 5)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, mask, 0.0)
    with pytest.raises(ValueError, match="must agree"):
        token_logprobs(logits, targets[:, :3], mask)
