"""On-policy distillation's loss (`rewind.engine.posttrain.distill_losses.reverse_kl`): the per-token
reverse KL(student || teacher) over the vocabulary, checked against a hand-computed value, against its
float64 reference written one position at a time (values and gradients), and for what the step relies
on: 0 at the teacher, no gradient into the teacher, micro-batches that sum to the whole batch."""

from __future__ import annotations

import math

import pytest
import torch

from rewind.engine.posttrain.distill_losses import reverse_kl, reverse_kl_reference


def _batch(seed: int, rows: int = 4, positions: int = 6, vocab: int = 13):
    """Random student and teacher logits (float32) and a random 0/1 mask with an empty row and a full one."""
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, positions, vocab, generator=generator) * 2
    teacher = torch.randn(rows, positions, vocab, generator=generator) * 2
    mask = (torch.rand(rows, positions, generator=generator) < 0.6).float()
    mask[0], mask[-1] = 0.0, 1.0
    return student, teacher, mask


def test_a_two_token_case_is_the_reverse_kl_by_hand():
    # p = (1/2, 1/2) the student's, q = (3/4, 1/4) the teacher's: KL(p || q) = 1/2 ln(2/3) + 1/2 ln 2,
    # not KL(q || p) = 3/4 ln(3/2) + 1/4 ln(1/2) (the forward KL: another number).
    student = torch.zeros(1, 1, 2)
    teacher = torch.tensor([[[math.log(3.0), 0.0]]])
    mask = torch.ones(1, 1)
    expected = 0.5 * math.log(4 / 3)
    assert abs(expected - (0.75 * math.log(1.5) + 0.25 * math.log(0.5))) > 0.01
    loss, per_token = reverse_kl(student, teacher, mask, 1.0)
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(per_token[0, 0]) == pytest.approx(expected, rel=1e-6)
    assert float(reverse_kl_reference(student, teacher, mask, 1.0)) == pytest.approx(expected, rel=1e-7)  # (log 3 in float32)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("normaliser", ["tokens", 1.0, 7.5])
def test_the_loss_is_its_float64_reference(seed, normaliser):
    student, teacher, mask = _batch(seed)
    divide = float(mask.sum()) if normaliser == "tokens" else normaliser
    loss, per_token = reverse_kl(student, teacher, mask, divide)
    reference = reverse_kl_reference(student, teacher, mask, divide)
    assert loss.dtype == torch.float32 and reference.dtype == torch.float64
    assert float(loss) == pytest.approx(float(reference), rel=2e-6, abs=1e-7)
    assert float(reference) > 0.01  # (random logits: a KL well away from 0, so the tolerance says something)
    assert not per_token.requires_grad and bool((per_token[mask == 0] == 0).all())
    for b, t in mask.nonzero().tolist():  # each position's KL, alone
        one = torch.zeros_like(mask)
        one[b, t] = 1.0
        assert float(per_token[b, t]) == pytest.approx(float(reverse_kl_reference(student, teacher, one, 1.0)), rel=2e-6, abs=1e-7)
    assert float(per_token.sum()) / divide == pytest.approx(float(loss), rel=1e-6)


def test_float64_logits_give_the_float32_loss_within_its_rounding():
    student, teacher, mask = _batch(3)
    loss32, _ = reverse_kl(student, teacher, mask, 5.0)
    loss64, _ = reverse_kl(student.double(), teacher.double(), mask.double(), 5.0)
    assert loss64.dtype == torch.float32  # computed in float32 whatever the logits' dtype
    assert float(loss64) == pytest.approx(float(loss32), rel=1e-6)
    assert float(loss32) == pytest.approx(float(reverse_kl_reference(student, teacher, mask, 5.0)), rel=2e-6)


def test_it_is_zero_at_the_teacher_exactly():
    student, _, mask = _batch(4)
    loss, per_token = reverse_kl(student, student.clone(), mask, float(mask.sum()))
    assert float(loss) == 0.0 and bool((per_token == 0).all())


def test_it_is_never_negative():
    for seed in range(5):
        _, per_token = reverse_kl(*_batch(seed), 1.0)
        assert float(per_token.min()) >= -1e-6  # Gibbs' inequality, up to float32 rounding


@pytest.mark.parametrize("seed", [0, 5])
def test_the_gradient_is_autograd_of_the_reference_and_the_teacher_gets_none(seed):
    student, teacher, mask = _batch(seed)
    student64 = student.double().requires_grad_(True)
    teacher64 = teacher.double().requires_grad_(True)
    reverse_kl_reference(student64, teacher64.detach(), mask, 6.0).backward()
    expected = student64.grad
    leaf = student.clone().requires_grad_(True)
    taught = teacher.clone().requires_grad_(True)  # a teacher that could take a gradient: it must not
    loss, _ = reverse_kl(leaf, taught, mask, 6.0)
    loss.backward()
    assert taught.grad is None
    assert leaf.grad is not None and float(leaf.grad.abs().max()) > 1e-3
    torch.testing.assert_close(leaf.grad.double(), expected, rtol=1e-5, atol=1e-7)
    assert bool((leaf.grad[mask == 0] == 0).all())  # masked positions take no gradient


def test_micro_batches_with_the_whole_normaliser_sum_to_the_whole_batch():
    student, teacher, mask = _batch(6, rows=6)
    normaliser = float(mask.sum())
    whole_leaf = student.clone().requires_grad_(True)
    whole, _ = reverse_kl(whole_leaf, teacher, mask, normaliser)
    whole.backward()
    leaf = student.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 3), slice(3, 6)):
        part, _ = reverse_kl(leaf[rows], teacher[rows], mask[rows], normaliser)
        part.backward()
        total += float(part.detach())
    assert total == pytest.approx(float(whole.detach()), rel=1e-6)
    torch.testing.assert_close(leaf.grad, whole_leaf.grad, rtol=1e-6, atol=1e-9)


def test_shapes_that_disagree_and_a_normaliser_not_positive_are_refused():
    student, teacher, mask = _batch(7)
    with pytest.raises(ValueError, match="must agree"):
        reverse_kl(student, teacher[:, :, :-1], mask, 1.0)
    with pytest.raises(ValueError, match="must agree"):
        reverse_kl(student, teacher, mask[:, :-1], 1.0)
    with pytest.raises(ValueError, match="normaliser must be positive"):
        reverse_kl(student, teacher, mask, 0.0)
