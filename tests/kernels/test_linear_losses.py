"""linear_losses (the chunked torch path) against reference_losses on materialised logits: values and
gradients wrt the hidden states and the head, masks, normalisers, KL kinds, dtypes, determinism, memory."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from rewind.kernels.linear_losses import KernelUnavailable, default_chunk_rows, linear_losses
from rewind.kernels.losses import reference_losses

KINDS = ["token_kl", "nll_difference"]


def problem(seed, lead=(2, 7), width=8, vocab=13, mask_p=0.6, dtype=torch.float32, scale=3.0):
    """hidden (lead..., D), head (V, D), the reference's, targets, mask."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, width, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=g, dtype=torch.float64) * scale / width**0.5
    ref_hidden = torch.randn(*lead, width, generator=g, dtype=torch.float64)
    ref_weight = torch.randn(vocab, width, generator=g, dtype=torch.float64) * scale / width**0.5
    targets = torch.randint(0, vocab, lead, generator=g)
    mask = torch.rand(lead, generator=g) < mask_p
    return (*(t.to(dtype) for t in (hidden, weight, ref_hidden, ref_weight)), targets, mask)


def run(
    fn,
    hidden,
    weight,
    targets,
    mask,
    num,
    ref_hidden=None,
    ref_weight=None,
    beta=0.0,
    kind="token_kl",
    train_weight=True,
    **kwargs,
):
    """fn's Losses and the gradients of its objective wrt fresh leaf copies of hidden and weight."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(train_weight)
    if fn == "reference":
        ref_logits = None if ref_hidden is None else ref_hidden @ ref_weight.T
        losses = reference_losses(h @ w.T, targets, mask, num, ref_logits, beta, kind)
    else:
        losses = linear_losses(h, w, targets, mask, num, ref_hidden, ref_weight, beta, kind, **kwargs)
    losses.objective.backward()
    return losses, h.grad, w.grad


def assert_matches(got, want, rtol=1e-5, atol=1e-6, grad_rtol=None):
    (g, gh, gw), (r, rh, rw) = got, want
    for name in ("objective", "ce", "kl"):
        torch.testing.assert_close(getattr(g, name), getattr(r, name), rtol=rtol, atol=atol, msg=name)
    assert int(g.num_correct) == int(r.num_correct)
    grad_rtol = rtol if grad_rtol is None else grad_rtol
    for mine, theirs in ((gh, rh), (gw, rw)):
        if theirs is None:
            assert mine is None
            continue
        assert mine.dtype == theirs.dtype
        scale = float(theirs.abs().max()) if theirs.numel() else 0.0
        torch.testing.assert_close(mine, theirs, rtol=grad_rtol, atol=max(atol, grad_rtol * scale))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    batch=st.integers(1, 3),
    seq=st.integers(1, 9),
    width=st.integers(1, 12),
    vocab=st.integers(2, 40),
    mask_p=st.sampled_from([0.0, 0.3, 1.0]),
    beta=st.sampled_from([0.0, 0.5, -0.2]),
    kind=st.sampled_from(KINDS),
    chunk=st.integers(1, 8),
)
def test_matches_reference_in_float64(seed, batch, seq, width, vocab, mask_p, beta, kind, chunk):
    # float64 end to end: the formulas (gradients computed in the forward pass) must agree to rounding.
    h, w, rh, rw, t, m = problem(seed, (batch, seq), width, vocab, mask_p, torch.float64)
    num = int(m.sum()) + 3  # a global denominator larger than this micro-batch's share
    want = run("reference", h, w, t, m, num, rh, rw, beta, kind)
    got = run("linear", h, w, t, m, num, rh, rw, beta, kind, chunk_rows=chunk)
    assert_matches(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lead", [(3, 17), (41,)])
def test_matches_reference_in_float32_with_odd_shapes(kind, lead):
    # (B, T, D) and (N, D) inputs; an odd vocabulary, chunks that do not divide the rows.
    h, w, rh, rw, t, m = problem(1, lead, width=24, vocab=1013, mask_p=0.7)
    num = int(m.sum())
    want = run("reference", h, w, t, m, num, rh, rw, 0.3, kind)
    got = run("linear", h, w, t, m, num, rh, rw, 0.3, kind, chunk_rows=5)
    assert_matches(got, want)
    assert float(got[0].kl) != 0.0


def test_all_positions_masked_in_one_chunk_or_many():
    h, w, rh, rw, t, m = problem(2, (2, 9), mask_p=2.0)
    assert bool(m.all())
    want = run("reference", h, w, t, m, 18, rh, rw, 0.5)
    for chunk in (1, 4, 18, 1000):
        assert_matches(run("linear", h, w, t, m, 18, rh, rw, 0.5, chunk_rows=chunk), want)


def test_no_masked_position_gives_a_connected_zero_with_zero_gradients():
    h, w, rh, rw, t, _ = problem(3, (2, 5))
    m = torch.zeros(2, 5, dtype=torch.bool)
    losses, gh, gw = run("linear", h, w, t, m, 7, rh, rw, 0.5)
    assert losses.objective.requires_grad and float(losses.objective.detach()) == 0.0
    assert float(losses.ce) == float(losses.kl) == 0.0 and int(losses.num_correct) == 0
    assert torch.equal(gh, torch.zeros_like(h)) and torch.equal(gw, torch.zeros_like(w))


def test_unmasked_rows_get_no_gradient_and_do_not_count():
    h, w, rh, rw, t, m = problem(4, (3, 8), mask_p=0.4)
    _, gh, _ = run("linear", h, w, t, m, int(m.sum()), rh, rw, 0.5)
    assert torch.equal(gh[~m], torch.zeros_like(gh[~m]))
    assert bool((gh[m].abs().sum(-1) > 0).all())


@pytest.mark.parametrize("kind", KINDS)
def test_micro_batches_with_the_global_normaliser_sum_to_the_whole(kind):
    h, w, rh, rw, t, m = problem(5, (4, 6), mask_p=0.5)
    num = int(m.sum())
    whole, whole_gh, whole_gw = run("linear", h, w, t, m, num, rh, rw, 0.4, kind)
    parts = [
        run("linear", h[i : i + 2], w, t[i : i + 2], m[i : i + 2], num, rh[i : i + 2], rw, 0.4, kind)
        for i in (0, 2)
    ]
    for name in ("objective", "ce", "kl"):
        torch.testing.assert_close(
            getattr(parts[0][0], name) + getattr(parts[1][0], name), getattr(whole, name)
        )
    assert int(parts[0][0].num_correct) + int(parts[1][0].num_correct) == int(whole.num_correct)
    torch.testing.assert_close(torch.cat([parts[0][1], parts[1][1]]), whole_gh)
    torch.testing.assert_close(parts[0][2] + parts[1][2], whole_gw)


def test_beta_zero_or_no_reference_is_the_plain_cross_entropy():
    h, w, rh, rw, t, m = problem(6, (2, 6))
    plain = run("linear", h, w, t, m, int(m.sum()))
    assert_matches(plain, run("reference", h, w, t, m, int(m.sum())))
    for extra in ((rh, rw, 0.0), (None, None, 0.5)):
        other = run("linear", h, w, t, m, int(m.sum()), *extra)
        assert float(other[0].kl) == 0.0
        assert torch.equal(other[0].objective, plain[0].objective) and torch.equal(other[1], plain[1])


def test_token_kl_is_zero_against_itself_and_pulls_towards_the_reference():
    h, w, rh, rw, t, m = problem(7, (2, 6), mask_p=2.0)
    same = linear_losses(h, w, t, m, 12, h.clone(), w.clone(), 1.0)
    assert abs(float(same.kl)) < 1e-6
    assert float(linear_losses(h, w, t, m, 12, rh, rw, 1.0).kl) > 0.01


def test_frozen_weight_gets_no_gradient_and_no_gradient_matmul():
    h, w, rh, rw, t, m = problem(8, (2, 6), mask_p=2.0)
    want = run("reference", h, w, t, m, 12, rh, rw, 0.5, train_weight=False)
    with CountMatmuls() as frozen:
        got = run("linear", h, w, t, m, 12, rh, rw, 0.5, train_weight=False, chunk_rows=4)
    assert_matches(got, want)
    with CountMatmuls() as trained:
        run("linear", h, w, t, m, 12, rh, rw, 0.5, chunk_rows=4)
    # Three chunks: policy logits, reference logits and grad_h each; grad_W only when the head trains.
    assert frozen.count == 9 and trained.count == 12


def test_without_grad_mode_no_gradient_is_computed():
    h, w, rh, rw, t, m = problem(9, (2, 6), mask_p=2.0)
    h.requires_grad_(True)
    w.requires_grad_(True)
    with torch.no_grad(), CountMatmuls() as counted:
        losses = linear_losses(h, w, t, m, 12, rh, rw, 0.5, chunk_rows=4)
    assert counted.count == 6 and not losses.objective.requires_grad
    want = reference_losses((h @ w.T).detach(), t, m, 12, rh @ rw.T, 0.5)
    torch.testing.assert_close(losses.objective, want.objective)


def test_backward_scales_the_stored_gradients_by_grad_output():
    h, w, rh, rw, t, m = problem(10, (2, 6))
    _, gh, gw = run("linear", h, w, t, m, 9, rh, rw, 0.5)
    a, b = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (linear_losses(a, b, t, m, 9, rh, rw, 0.5).objective * 2.5).backward()
    torch.testing.assert_close(a.grad, 2.5 * gh)
    torch.testing.assert_close(b.grad, 2.5 * gw)


@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_inputs_match_the_bfloat16_reference(kind):
    h, w, rh, rw, t, m = problem(11, (3, 40), width=32, vocab=301, dtype=torch.bfloat16)
    num = int(m.sum())
    want = run("reference", h, w, t, m, num, rh, rw, 0.5, kind)
    got = run("linear", h, w, t, m, num, rh, rw, 0.5, kind, chunk_rows=16)
    assert got[0].objective.dtype == torch.float32  # reduced in float32, as the reference does
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    assert_matches(got, want, rtol=1e-2, atol=1e-3, grad_rtol=2e-2)


def test_autocast_runs_the_matmuls_in_its_dtype_and_returns_float32_gradients():
    h, w, rh, rw, t, m = problem(12, (2, 20), width=16, vocab=97)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = run("reference", h, w, t, m, 30, rh, rw, 0.5)
        got = run("linear", h, w, t, m, 30, rh, rw, 0.5, chunk_rows=8)
    assert got[1].dtype == got[2].dtype == torch.float32
    assert_matches(got, want, rtol=1e-2, atol=1e-3, grad_rtol=2e-2)


def test_the_same_inputs_give_the_same_bits():
    h, w, rh, rw, t, m = problem(13, (3, 33), width=16, vocab=257)
    first = run("linear", h, w, t, m, 50, rh, rw, 0.5, chunk_rows=7)
    second = run("linear", h, w, t, m, 50, rh, rw, 0.5, chunk_rows=7)
    for a, b in zip(
        (first[0].objective, first[0].kl, *first[1:]),
        (second[0].objective, second[0].kl, *second[1:]),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_chunk_size_changes_nothing_beyond_rounding():
    h, w, rh, rw, t, m = problem(14, (3, 33), width=16, vocab=257)
    results = [run("linear", h, w, t, m, 50, rh, rw, 0.5, chunk_rows=c) for c in (1, 7, 64, None)]
    for other in results[1:]:
        assert_matches(other, results[0])


def test_memory_stays_within_one_chunk_of_logits():
    # Every tensor the call creates (forward and backward), counted by element: none is as large as all
    # positions' logits; the largest is one chunk's. Deterministic, unlike a measured peak.
    rows, width, vocab, chunk = 512, 16, 1000, 32
    h, w, rh, rw, t, m = problem(15, (rows,), width, vocab, mask_p=2.0)
    with LargestTensor() as largest:
        run("linear", h, w, t, m, rows, rh, rw, 0.5, chunk_rows=chunk)
    assert largest.numel == chunk * vocab < rows * vocab
    with LargestTensor() as eager:
        run("reference", h, w, t, m, rows, rh, rw, 0.5)
    assert eager.numel == rows * vocab


def test_default_chunk_holds_a_few_mebibytes_of_float32_logits():
    assert default_chunk_rows(32_768, "cpu") * 32_768 * 4 == 16 * 2**20
    assert default_chunk_rows(32_768, "cuda") * 32_768 * 4 == 64 * 2**20
    assert default_chunk_rows(50_257, "cpu") % 8 == 0
    assert default_chunk_rows(10**8, "cpu") == 1


def test_bad_arguments_are_one_line_errors():
    h, w, rh, _, t, m = problem(16, (2, 3))
    cases = [
        ({"kl_kind": "bogus"}, "unknown KL kind"),
        ({"implementation": "cuda-magic"}, "unknown loss implementation"),
        ({"chunk_rows": 0}, "chunk_rows must be positive"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            linear_losses(h, w, t, m, 3, **kwargs)
    with pytest.raises(ValueError, match=r"head weight is torch\.float64"):
        linear_losses(h, w.double(), t, m, 3)
    with pytest.raises(ValueError, match="reference head weight"):
        linear_losses(h, w, t, m, 3, rh, None, 0.5)
    with pytest.raises(ValueError, match="width"):
        linear_losses(h[..., :5], w, t, m, 3)


def test_triton_missing_is_one_clear_error(monkeypatch):
    import rewind.kernels

    # What a missing triton looks like, also after another test imported the kernel module.
    monkeypatch.setitem(sys.modules, "rewind.kernels.triton_losses", None)
    monkeypatch.delattr(rewind.kernels, "triton_losses", raising=False)
    h, w, _, _, t, m = problem(17, (2, 3))
    with pytest.raises(KernelUnavailable, match="needs triton") as info:
        linear_losses(h, w, t, m, 3, implementation="triton")
    assert "\n" not in str(info.value)


class CountMatmuls(TorchDispatchMode):
    """Counts the matrix products run inside the block."""

    OPS = ("aten.mm", "aten.addmm", "aten.addmm_", "aten.bmm")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(str(func).startswith(op + ".") for op in self.OPS):
            self.count += 1
        return func(*args, **(kwargs or {}))


class LargestTensor(TorchDispatchMode):
    """The largest tensor (in elements) any op inside the block returns."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out
