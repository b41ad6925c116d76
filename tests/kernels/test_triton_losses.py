"""linear_losses(implementation="triton") against reference_losses: through Triton's interpreter on CPU
tensors here, compiled on a GPU under the `gpu` marker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# Imported before anything else imports triton: this module switches on the interpreter where there is
# no CUDA, which triton reads when it is first imported.
triton_losses = pytest.importorskip("rewind.kernels.triton_losses", reason="triton is not importable")

from rewind.kernels.linear_losses import linear_losses  # noqa: E402
from rewind.kernels.losses import reference_losses  # noqa: E402
from tests.kernels.test_linear_losses import KINDS, assert_matches, problem, run  # noqa: E402

# The interpreter pays per program and per tile: whole small rows in a few big tiles.
BIG_TILES = (64, 1024)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(dtype, kind):
    h, w, rh, rw, t, m = problem(0, (3, 100), width=32, vocab=1000, mask_p=0.7, dtype=dtype)
    num = int(m.sum()) + 4
    want = run("reference", h, w, t, m, num, rh, rw, 0.5, kind)
    got = run("linear", h, w, t, m, num, rh, rw, 0.5, kind, implementation="triton", triton_blocks=BIG_TILES)
    assert got[1].dtype == got[2].dtype == dtype
    if dtype == torch.float32:
        assert_matches(got, want)
    else:
        assert_matches(got, want, rtol=1e-2, atol=1e-3, grad_rtol=2e-2)


def test_small_tiles_and_chunks_cross_every_boundary():
    # Several vocabulary tiles per row (the online softmax rescales, the argmax compares across tiles), a
    # ragged last tile and row block, several chunks.
    h, w, rh, rw, t, m = problem(1, (150,), width=16, vocab=1000, mask_p=0.8)
    num = int(m.sum())
    want = run("reference", h, w, t, m, num, rh, rw, 0.5)
    got = run(
        "linear",
        h,
        w,
        t,
        m,
        num,
        rh,
        rw,
        0.5,
        implementation="triton",
        chunk_rows=53,
        triton_blocks=(16, 256),
    )
    assert_matches(got, want)


def test_plain_cross_entropy_and_frozen_head():
    h, w, rh, rw, t, m = problem(2, (2, 50), width=16, vocab=333)
    want = run("reference", h, w, t, m, 77, train_weight=False)
    got = run("linear", h, w, t, m, 77, rh, rw, 0.0, implementation="triton", train_weight=False)
    assert_matches(got, want)
    assert float(got[0].kl) == 0.0 and got[2] is None


def test_no_masked_position_gives_zero_gradients():
    h, w, rh, rw, t, _ = problem(3, (2, 5), vocab=50)
    m = torch.zeros(2, 5, dtype=torch.bool)
    losses, gh, gw = run("linear", h, w, t, m, 7, rh, rw, 0.5, implementation="triton")
    assert float(losses.objective.detach()) == 0.0 and losses.objective.requires_grad
    assert torch.equal(gh, torch.zeros_like(h)) and torch.equal(gw, torch.zeros_like(w))


@pytest.mark.parametrize("kind", KINDS)
def test_the_kernel_writes_the_logits_gradient_in_place(kind):
    # The kernel alone, on logits: its per-row values and the gradient it writes over the logits equal
    # autograd through reference_losses.
    g = torch.Generator().manual_seed(4)
    z = torch.randn(37, 300, generator=g) * 3
    r = torch.randn(37, 300, generator=g) * 3
    t = torch.randint(0, 300, (37,), generator=g)
    beta, denom = 0.7, 50.0
    leaf = z.clone().requires_grad_(True)
    want = reference_losses(leaf, t, torch.ones(37, dtype=torch.bool), 50, r, beta, kind)
    want.objective.backward()
    code = triton_losses.TOKEN_KL if kind == "token_kl" else triton_losses.NLL_DIFFERENCE
    ce_scale, kl_scale = (1 / denom, beta / denom) if kind == "token_kl" else ((1 + beta) / denom, 0.0)
    out = z.clone()
    nll, kl, correct = triton_losses.row_losses(out, r, t, code, ce_scale, kl_scale, True, (8, 128))
    torch.testing.assert_close(nll.sum() / denom, want.ce)
    torch.testing.assert_close(kl.sum() / denom, want.kl)
    assert int(correct.sum()) == int(want.num_correct)
    torch.testing.assert_close(out, leaf.grad)


def test_argmax_keeps_the_first_of_equal_maxima_across_tiles():
    z = torch.zeros(2, 600)
    z[:, 3] = z[:, 500] = 5.0  # tied maxima in the first and the second 256-wide tile
    targets = torch.tensor([3, 500])
    _, _, correct = triton_losses.row_losses(z, None, targets, triton_losses.NO_KL, 1.0, 0.0, False, (2, 256))
    assert correct.tolist() == [1, 0]
    assert z.argmax(-1).tolist() == [3, 3]


def test_the_same_inputs_give_the_same_bits():
    h, w, rh, rw, t, m = problem(5, (2, 60), width=16, vocab=500)
    first, second = (run("linear", h, w, t, m, 99, rh, rw, 0.5, implementation="triton") for _ in range(2))
    assert torch.equal(first[0].objective, second[0].objective)
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])


def test_a_triton_loaded_without_the_interpreter_is_one_clear_error(tmp_path):
    code = (
        "import torch\n"
        "from rewind.kernels.linear_losses import KernelUnavailable, linear_losses\n"
        "h, w = torch.randn(4, 3), torch.randn(5, 3)\n"
        "try:\n"
        "    linear_losses(h, w, torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.bool), 4,"
        " implementation='triton')\n"
        "except KernelUnavailable as exc:\n"
        "    print(exc)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [
        "the triton loss kernel runs CPU tensors only in Triton's interpreter, and triton was loaded "
        "without it: set TRITON_INTERPRET=1 in the environment, or use the chunked loss"
    ]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_matches_reference_on_cuda(dtype, kind):
    h, w, rh, rw, t, m = problem(6, (4, 1000), width=256, vocab=32_768, mask_p=0.9, dtype=dtype)
    h, w, rh, rw, t, m = (x.cuda() for x in (h, w, rh, rw, t, m))
    num = int(m.sum())
    want = run("reference", h, w, t, m, num, rh, rw, 0.5, kind)
    got = run("linear", h, w, t, m, num, rh, rw, 0.5, kind, implementation="triton", chunk_rows=1000)
    if dtype == torch.float32:
        # cuBLAS may use other kernels for a chunk than for the whole batch: float32 rounding, not 1e-5.
        assert_matches(got, want, rtol=1e-4, atol=1e-5)
    else:
        assert_matches(got, want, rtol=1e-2, atol=1e-3, grad_rtol=2e-2)
    again = run("linear", h, w, t, m, num, rh, rw, 0.5, kind, implementation="triton", chunk_rows=1000)
    assert torch.equal(got[1], again[1]) and torch.equal(got[2], again[2])


@pytest.mark.gpu
@needs_cuda
def test_compiled_kernel_peak_memory_is_a_fraction_of_the_logits():
    h, w, rh, rw, t, m = problem(7, (8192,), width=512, vocab=32_768, mask_p=2.0, dtype=torch.bfloat16)
    h, w, rh, rw, t, m = (x.cuda() for x in (h, w, rh, rw, t, m))
    h.requires_grad_(True)
    w.requires_grad_(True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    linear_losses(h, w, t, m, 8192, rh, rw, 0.5, implementation="triton").objective.backward()
    torch.cuda.synchronize()
    logits_bytes = 8192 * 32_768 * 2
    assert torch.cuda.max_memory_allocated() - before < logits_bytes / 2
