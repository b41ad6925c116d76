"""The Triton row kernel behind `linear_losses(..., implementation="triton")`.

The torch side (kernels/linear_losses.py) does the matmuls only: a chunk's logits z = h @ W.T (and the
reference's r), then this kernel, then grad_h = dz @ W and grad_W += dz.T @ h. The kernel takes one block
of BLOCK_R rows per program and walks the vocabulary in BLOCK_V tiles, twice:

1. online softmax statistics: running max and sum of exponentials for z (and r), the argmax (first of
   equal maxima, as torch's), and for the token KL the running sum_v exp(z_v - m) (z_v - r_v), rescaled
   like the sum of exponentials whenever the running max grows. Then per row: lse_z, lse_r,
   nll = lse_z - z[target], KL(p||q) = sum_v p_v (z_v - r_v) - lse_z + lse_r (token_kl) or
   nll - (lse_r - r[target]) (nll_difference).
2. (training only) the gradient of the row's share of the objective, written over z in place:
   ce_scale * (p_v - [v == target]) + kl_scale * p_v * ((z_v - lse_z) - (r_v - lse_r) - KL).
   For nll_difference the KL's gradient is the task gradient again, so the caller folds beta into
   ce_scale and passes no KL term.

Every value loaded is upcast to float32 at once (logits arrive in bf16 under mixed precision, and the
interpreter mishandles bf16 arithmetic); the gradient is rounded to the logits' dtype only on the store.
Out-of-range lanes load a large finite negative, never -inf: -inf - -inf is NaN, and numpy (the
interpreter) warns on it, which the test suite turns into an error.

Each row is reduced by one program in a fixed tile order and nothing is accumulated across programs: no
atomics, so the same inputs give the same bits on every call.

The interpreter. `@triton.jit` decides when it decorates whether a kernel is compiled for a GPU or run
by Triton's interpreter (numpy, on CPU tensors), reading TRITON_INTERPRET; so does triton.language for
its own helpers (tl.sum, tl.max, ...) when triton is first imported. Without CUDA there is nothing to
compile for, so this module asks for the interpreter before it imports triton (setdefault: a user's own
setting wins). Where triton was imported earlier without it (bitsandbytes imports triton), or on a CUDA
machine, CPU tensors cannot run here: `row_losses` says so in one line (set TRITON_INTERPRET=1 in the
environment, or use the chunked loss).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # after the interpreter switch above
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from rewind.kernels.losses import KernelUnavailable

# What `kl_code` means: no KL term, the token KL, the NLL difference.
NO_KL, TOKEN_KL, NLL_DIFFERENCE = 0, 1, 2
# "Minus infinity" that stays finite (see the module docstring); constexpr: a kernel reads no other globals.
_NEG = tl.constexpr(-1.0e30)

# Tiles. On a GPU one row per program over 4096-wide vocabulary tiles (a starting point like Liger's
# per-row kernels, not tuned here: this machine has no GPU). In the interpreter each program and each
# tile costs Python overhead, so big 2-D tiles: a small test's 300 rows x 1000 tokens is a handful of
# programs of one tile each.
CUDA_BLOCKS = (1, 4096)
CUDA_NUM_WARPS = 8
INTERPRETER_BLOCKS = (64, 1024)


@triton.jit
def _row_losses_kernel(
    z_ptr,
    r_ptr,
    target_ptr,
    nll_ptr,
    kl_ptr,
    correct_ptr,
    num_rows,
    vocab,
    z_stride,
    r_stride,
    ce_scale,
    kl_scale,
    KL_CODE: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < num_rows
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_V)
    z_rows = z_ptr + rows64[:, None] * z_stride
    r_rows = r_ptr + rows64[:, None] * r_stride

    # Pass 1: online statistics over the vocabulary tiles.
    z_max = tl.full([BLOCK_R], _NEG, tl.float32)
    z_sum = tl.zeros([BLOCK_R], tl.float32)
    r_max = tl.full([BLOCK_R], _NEG, tl.float32)
    r_sum = tl.zeros([BLOCK_R], tl.float32)
    cross = tl.zeros([BLOCK_R], tl.float32)  # sum_v exp(z_v - z_max) (z_v - r_v)
    best = tl.full([BLOCK_R], _NEG, tl.float32)
    best_at = tl.zeros([BLOCK_R], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        at = start + cols
        ok = row_ok[:, None] & (at < vocab)[None, :]
        z = tl.load(z_rows + at[None, :], mask=ok, other=_NEG).to(tl.float32)
        tile_max = tl.max(z, axis=1)
        tile_at = tl.argmax(z, axis=1).to(tl.int32)
        better = tile_max > best  # strictly: an earlier tile keeps a tie, as torch.argmax does
        best_at = tl.where(better, start + tile_at, best_at)
        best = tl.where(better, tile_max, best)
        new_max = tl.maximum(z_max, tile_max)
        rescale = tl.exp(z_max - new_max)
        e = tl.where(ok, tl.exp(z - new_max[:, None]), 0.0)
        z_sum = z_sum * rescale + tl.sum(e, axis=1)
        if KL_CODE != 0:
            r = tl.load(r_rows + at[None, :], mask=ok, other=_NEG).to(tl.float32)
            r_new = tl.maximum(r_max, tl.max(r, axis=1))
            r_e = tl.where(ok, tl.exp(r - r_new[:, None]), 0.0)
            r_sum = r_sum * tl.exp(r_max - r_new) + tl.sum(r_e, axis=1)
            r_max = r_new
            if KL_CODE == 1:
                cross = cross * rescale + tl.sum(tl.where(ok, e * (z - r), 0.0), axis=1)
        z_max = new_max

    # Rows past the end summed nothing: a 1 (and a log-sum-exp of 0) there keeps everything finite.
    z_sum = tl.where(row_ok, z_sum, 1.0)
    z_lse = tl.where(row_ok, z_max + tl.log(z_sum), 0.0)
    target = tl.load(target_ptr + rows64, mask=row_ok, other=0)
    z_target = tl.load(z_ptr + rows64 * z_stride + target, mask=row_ok, other=0.0).to(tl.float32)
    nll = z_lse - z_target
    kl = tl.zeros([BLOCK_R], tl.float32)
    r_lse = tl.zeros([BLOCK_R], tl.float32)
    if KL_CODE != 0:
        r_lse = tl.where(row_ok, r_max + tl.log(tl.where(row_ok, r_sum, 1.0)), 0.0)
    if KL_CODE == 1:
        kl = cross / z_sum - z_lse + r_lse
    if KL_CODE == 2:
        r_target = tl.load(r_ptr + rows64 * r_stride + target, mask=row_ok, other=0.0).to(tl.float32)
        kl = nll - (r_lse - r_target)
    tl.store(nll_ptr + rows64, nll, mask=row_ok)
    tl.store(kl_ptr + rows64, kl, mask=row_ok)
    tl.store(correct_ptr + rows64, (best_at == target).to(tl.int32), mask=row_ok)

    # Pass 2: the gradient wrt z, over z.
    if WRITE_GRAD:
        for start in range(0, vocab, BLOCK_V):
            at = start + cols
            ok = row_ok[:, None] & (at < vocab)[None, :]
            z = tl.load(z_rows + at[None, :], mask=ok, other=_NEG).to(tl.float32)
            logp = z - z_lse[:, None]
            p = tl.exp(logp)
            grad = ce_scale * (p - tl.where(at[None, :] == target[:, None], 1.0, 0.0))
            if KL_CODE == 1:
                r = tl.load(r_rows + at[None, :], mask=ok, other=_NEG).to(tl.float32)
                grad += kl_scale * p * (logp - (r - r_lse[:, None]) - kl[:, None])
            tl.store(z_rows + at[None, :], grad.to(z_ptr.dtype.element_ty), mask=ok)


# Whether kernels run in the interpreter: ours and triton.language's helpers must agree.
INTERPRETED = isinstance(_row_losses_kernel, InterpretedFunction) and isinstance(tl.sum, InterpretedFunction)


def row_losses(
    logits: torch.Tensor,
    reference_logits: torch.Tensor | None,
    targets: torch.Tensor,
    kl_code: int,
    ce_scale: float,
    kl_scale: float,
    write_grad: bool,
    blocks: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of a chunk: (nll, kl, correct), float32, float32, int32. With `write_grad`, `logits` is
    overwritten by the gradient of sum_rows(ce_scale * nll + kl_scale * kl) wrt the logits (for
    nll_difference pass kl_scale 0 and fold beta into ce_scale).

    `logits`, `reference_logits`: (rows, vocab), unit stride along the vocabulary. `blocks`: (BLOCK_R,
    BLOCK_V) powers of two; by default CUDA_BLOCKS on a GPU, INTERPRETER_BLOCKS on CPU tensors."""
    num_rows, vocab = logits.shape
    if logits.stride(1) != 1 or (reference_logits is not None and reference_logits.stride(1) != 1):
        raise ValueError("the triton loss kernel needs logits with unit stride along the vocabulary")
    if kl_code != NO_KL and reference_logits is None:
        raise ValueError("a KL term needs reference logits")
    on_cpu = logits.device.type == "cpu"
    if on_cpu and not INTERPRETED:
        raise KernelUnavailable(
            "the triton loss kernel runs CPU tensors only in Triton's interpreter, and triton was loaded "
            "without it: set TRITON_INTERPRET=1 in the environment, or use the chunked loss"
        )
    block_r, block_v = blocks or (INTERPRETER_BLOCKS if on_cpu else CUDA_BLOCKS)
    block_v = min(block_v, triton.next_power_of_2(vocab))
    block_r = min(block_r, triton.next_power_of_2(max(num_rows, 1)))
    ref = logits if reference_logits is None else reference_logits  # a pointer the kernel never reads
    nll = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    kl = torch.empty_like(nll)
    correct = torch.empty(num_rows, dtype=torch.int32, device=logits.device)
    if num_rows == 0:
        return nll, kl, correct
    extra = {} if INTERPRETED else {"num_warps": CUDA_NUM_WARPS}
    _row_losses_kernel[(triton.cdiv(num_rows, block_r),)](
        logits,
        ref,
        targets,
        nll,
        kl,
        correct,
        num_rows,
        vocab,
        logits.stride(0),
        ref.stride(0),
        float(ce_scale),
        float(kl_scale),
        KL_CODE=kl_code,
        WRITE_GRAD=write_grad,
        BLOCK_R=block_r,
        BLOCK_V=block_v,
        **extra,
    )
    return nll, kl, correct
