"""The training losses from the final hidden states and the head weight: no (positions x vocab) logits.

`linear_losses(hidden, weight, ...)` equals `reference_losses(hidden @ weight.T, ...)` (kernels/losses.py:
masked next-token cross-entropy, a KL penalty to a frozen reference, the global normaliser), values and
gradients wrt `hidden` and `weight`, but never holds more than one chunk of rows' logits.

How (the trick of Liger's fused linear cross-entropy): the gradient is computed during the forward pass.
The masked rows are selected first; for each chunk of them the logits z = h @ W.T (and the reference's r)
are formed, reduced per row (log-sum-exp, target logit, argmax, KL), turned at once into dz = d loss / dz,
and folded into grad_h = dz @ W and grad_W += dz.T @ h. The chunk's logits then die. Backward only scales
the stored gradients by grad_output. Two implementations of the per-row work, one contract:

- "chunked": torch ops on the chunk's logits, upcast to float32 (float64 stays float64).
- "triton": kernels/triton_losses.py, an online softmax over vocabulary tiles that writes dz over the
  logits in place: the torch side does the matmuls only. Triton is imported only when asked for.

Memory: O(chunk_rows x vocab) for the logits, plus grad_h (the size of `hidden`) and a float32 grad_W
accumulator (the size of `weight` in float32: summing the chunks' bf16 products in bf16 would lose the
digits a single full matmul keeps). Chunk size: a budget for one chunk's float32 logits (CHUNK_BYTES), 16
MiB on CPU (the torch path holds about four such buffers at once: logits, probabilities, the reference,
the gradient) and 64 MiB on a GPU, where a taller matmul (512 rows at a 32768-token vocabulary) keeps the
tensor cores busy.

Determinism: chunks are taken in order and each row is reduced by one program or op; nothing is
accumulated with atomics, so the same inputs give the same bits on every call. The bits do depend on the
implementation and on chunk_rows (float sums in another order): both belong to the run's configuration.

Mixed precision: the matmuls run in the inputs' dtype (or autocast's, when autocast is on for the
device); logits are reduced in float32 whatever that dtype; gradients come back in the inputs' dtypes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rewind.kernels.losses import KL_KINDS, KernelUnavailable, Losses

IMPLEMENTATIONS = ("chunked", "triton")
NO_KL, TOKEN_KL, NLL_DIFFERENCE = 0, 1, 2  # as triton_losses numbers them
CHUNK_BYTES = {"cpu": 16 * 2**20, "cuda": 64 * 2**20}


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits are reduced in float32; float64 (tests) stays float64 (as losses.py does)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def triton_available(device_type: str) -> None:
    """Raise KernelUnavailable (one line) unless the triton implementation can run on `device_type`
    ("cpu": in Triton's interpreter; "cuda": compiled) in this process: checked when a run starts."""
    try:
        from rewind.kernels import triton_losses
    except ImportError as exc:
        raise KernelUnavailable(f"needs triton (pip install 'rewind[triton]'), which cannot be imported: {exc}") from None
    if device_type == "cpu" and not triton_losses.INTERPRETED:
        raise KernelUnavailable(
            "on the CPU it runs in Triton's interpreter, and triton was loaded without it: set TRITON_INTERPRET=1"
        )


def default_chunk_rows(vocab_size: int, device: torch.device | str = "cpu") -> int:
    """Rows per chunk so that a chunk's float32 logits take about CHUNK_BYTES (a multiple of 8 rows,
    matmul-friendly, when there is room for 8)."""
    budget = CHUNK_BYTES.get(torch.device(device).type, CHUNK_BYTES["cuda"])
    rows = max(1, budget // (4 * max(vocab_size, 1)))
    return rows - rows % 8 if rows >= 8 else rows


@dataclass(frozen=True)
class _Options:
    denominator: float
    beta: float
    kl_code: int
    chunk_rows: int
    implementation: str
    need_hidden_grad: bool
    need_weight_grad: bool
    matmul_dtype: torch.dtype
    blocks: tuple[int, int] | None


def _torch_rows(z, r, targets, kl_code, ce_scale, kl_scale, write_grad):
    """Per row of a chunk: (nll, kl or None, correct, dz or None), in torch. `z` and `r` are this chunk's
    own logits: they are overwritten."""
    zf = _upcast(z)
    correct = zf.argmax(-1) == targets
    target_logits = zf.gather(1, targets[:, None]).squeeze(1)
    # log_softmax and softmax with one exp pass and no other (rows x vocab) buffer than probs.
    top = zf.amax(-1, keepdim=True)
    logp = zf.sub_(top)
    probs = logp.exp()
    sums = probs.sum(-1, keepdim=True)
    probs.div_(sums)
    log_sums = sums.log_()
    logp.sub_(log_sums)
    nll = (top + log_sums).squeeze(1) - target_logits
    kl = None
    if kl_code == TOKEN_KL:
        ref_logp = _upcast(r)
        ref_logp = ref_logp.sub_(torch.logsumexp(ref_logp, -1)[:, None])
        diff = logp.sub_(ref_logp)  # log p - log q; logp is not needed any more
        kl = (probs * diff).sum(-1)
    elif kl_code == NLL_DIFFERENCE:
        rf = _upcast(r)
        kl = nll - (torch.logsumexp(rf, -1) - rf.gather(1, targets[:, None]).squeeze(1))
    if not write_grad:
        return nll, kl, correct, None
    if kl_code == TOKEN_KL:
        # d KL / dz_v = p_v ((log p_v - log q_v) - KL)
        grad = diff.sub_(kl[:, None]).mul_(probs).mul_(kl_scale).add_(probs, alpha=ce_scale)
    else:
        grad = probs.mul_(ce_scale)
    grad[torch.arange(grad.shape[0], device=grad.device), targets] -= ce_scale
    return nll, kl, correct, grad


def _triton_rows(z, r, targets, kl_code, ce_scale, kl_scale, write_grad, blocks):
    from rewind.kernels import triton_losses

    nll, kl, correct = triton_losses.row_losses(
        z, r, targets, kl_code, ce_scale, kl_scale, write_grad, blocks
    )
    return nll, (kl if kl_code != NO_KL else None), correct.bool(), (z if write_grad else None)


class _LinearLosses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, reference_hidden, reference_weight, targets, mask, options: _Options):
        device = hidden.device
        # The matmuls below are in options.matmul_dtype, chosen by the caller: autocast would re-cast them.
        with torch.autocast(device_type=device.type, enabled=False):
            return _forward(ctx, hidden, weight, reference_hidden, reference_weight, targets, mask, options)

    @staticmethod
    def backward(ctx, grad_objective, *_ignored):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = None if grad_hidden is None else grad_hidden * grad_objective
        grad_weight = None if grad_weight is None else grad_weight * grad_objective
        return grad_hidden, grad_weight, None, None, None, None, None


def _forward(ctx, hidden, weight, reference_hidden, reference_weight, targets, mask, o: _Options):
    device, mm = hidden.device, o.matmul_dtype
    loss_dtype = torch.promote_types(mm, torch.float32)
    keep = mask.nonzero().squeeze(-1)  # only masked rows contribute: answer-only tasks skip most rows
    use_kl = o.kl_code != NO_KL
    w = weight.detach().to(mm)
    ref_w = reference_weight.detach().to(mm) if use_kl else None
    if o.kl_code == NLL_DIFFERENCE:  # its gradient is the task gradient again (see losses.py)
        ce_scale, kl_scale = (1.0 + o.beta) / o.denominator, 0.0
    else:
        ce_scale, kl_scale = 1.0 / o.denominator, o.beta / o.denominator
    write_grad = o.need_hidden_grad or o.need_weight_grad
    grad_hidden = torch.zeros_like(hidden) if o.need_hidden_grad else None
    # float32 (float64 for float64 weights) accumulator across chunks; cast to the weight's dtype at the end.
    grad_weight = torch.zeros(weight.shape, dtype=loss_dtype, device=device) if o.need_weight_grad else None
    nll_sums, kl_sums, num_correct = [], [], torch.zeros((), dtype=torch.long, device=device)
    for start in range(0, keep.numel(), o.chunk_rows):
        rows = keep[start : start + o.chunk_rows]
        h = hidden.detach().index_select(0, rows).to(mm)
        t = targets.index_select(0, rows)
        z = h @ w.T
        r = reference_hidden.detach().index_select(0, rows).to(mm) @ ref_w.T if use_kl else None
        if o.implementation == "triton":
            nll, kl, correct, dz = _triton_rows(z, r, t, o.kl_code, ce_scale, kl_scale, write_grad, o.blocks)
        else:
            nll, kl, correct, dz = _torch_rows(z, r, t, o.kl_code, ce_scale, kl_scale, write_grad)
        nll_sums.append(nll.sum())
        if kl is not None:
            kl_sums.append(kl.sum())
        num_correct = num_correct + correct.sum()
        if dz is None:
            continue
        dz = dz.to(mm)
        if grad_hidden is not None:
            grad_hidden.index_copy_(0, rows, (dz @ w).to(hidden.dtype))
        if grad_weight is not None:
            if dz.dtype == grad_weight.dtype:
                grad_weight.addmm_(dz.T, h)
            else:  # a bf16 product, summed in float32
                grad_weight.add_(dz.T @ h)
    ce, kl = (torch.zeros((), dtype=loss_dtype, device=device) for _ in range(2))
    if nll_sums:
        ce = torch.stack(nll_sums).sum().to(loss_dtype) / o.denominator
    if kl_sums:
        kl = torch.stack(kl_sums).sum().to(loss_dtype) / o.denominator
    objective = ce + o.beta * kl if use_kl else ce.clone()
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.mark_non_differentiable(ce, kl, num_correct)
    return objective, ce, kl, num_correct


def _flat(t: torch.Tensor, name: str, width: int | None = None) -> torch.Tensor:
    if width is None:
        return t.reshape(-1)
    if t.shape[-1] != width:
        raise ValueError(f"{name} has width {t.shape[-1]}, expected {width}")
    return t.reshape(-1, width)


def linear_losses(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    num_target_tokens: int,
    reference_hidden: torch.Tensor | None = None,
    reference_weight: torch.Tensor | None = None,
    beta: float = 0.0,
    kl_kind: str = "token_kl",
    *,
    implementation: str = "chunked",
    chunk_rows: int | None = None,
    triton_blocks: tuple[int, int] | None = None,
) -> Losses:
    """`reference_losses(hidden @ weight.T, targets, mask, num_target_tokens,
    reference_hidden @ reference_weight.T, beta, kl_kind)` without the logits of all positions at once.

    hidden (..., D), weight (V, D) (no bias), targets and mask (...); reference_hidden (..., D_ref) and
    reference_weight (V, D_ref): the frozen reference's final hidden states and head (never
    differentiated; the KL term needs both and beta != 0). `objective` carries the gradient to `hidden`
    and `weight` (those that require it); ce, kl and num_correct are detached. `implementation`:
    "chunked" (torch) or "triton" (kernels/triton_losses.py; CPU tensors run in Triton's interpreter).
    `chunk_rows`: masked rows per chunk (default: default_chunk_rows). `triton_blocks`: the kernel's
    (rows, vocabulary) tile, powers of two (default: triton_losses' choice for the device)."""
    if kl_kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kl_kind!r}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"unknown loss implementation {implementation!r} (one of {', '.join(IMPLEMENTATIONS)})"
        )
    if implementation == "triton":
        try:
            from rewind.kernels import triton_losses  # noqa: F401 (imported here so "chunked" never needs it)
        except ImportError as exc:
            raise KernelUnavailable(
                f"the triton loss kernel needs triton, which cannot be imported: {exc}"
            ) from None
    if weight.dim() != 2:
        raise ValueError(f"the head weight must be (vocab, width), not {tuple(weight.shape)}")
    vocab, width = weight.shape
    flat_hidden = _flat(hidden, "hidden", width)
    flat_targets, flat_mask = _flat(targets, "targets"), _flat(mask, "mask").to(torch.bool)
    if not flat_targets.numel() == flat_mask.numel() == flat_hidden.shape[0]:
        raise ValueError("hidden, targets and mask must cover the same positions")
    device_type = hidden.device.type
    autocast = torch.is_autocast_enabled(device_type)
    matmul_dtype = torch.get_autocast_dtype(device_type) if autocast else hidden.dtype
    if not autocast and weight.dtype != hidden.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but the head weight is {weight.dtype}")
    if implementation == "triton" and matmul_dtype == torch.float64:
        raise ValueError("the triton loss kernel computes in float32: give it float32, bfloat16 or float16")
    use_kl = reference_hidden is not None and beta != 0.0
    flat_reference = None
    if use_kl:
        if reference_weight is None or reference_weight.dim() != 2 or reference_weight.shape[0] != vocab:
            raise ValueError(f"the KL term needs a reference head weight of shape ({vocab}, width)")
        flat_reference = _flat(reference_hidden, "reference_hidden", reference_weight.shape[1])
        if flat_reference.shape[0] != flat_hidden.shape[0]:
            raise ValueError("reference_hidden must cover the same positions as hidden")
        if not autocast and reference_weight.dtype != reference_hidden.dtype:
            raise ValueError(
                f"reference_hidden is {reference_hidden.dtype} but its head is {reference_weight.dtype}"
            )
    kl_code = {"token_kl": TOKEN_KL, "nll_difference": NLL_DIFFERENCE}[kl_kind] if use_kl else NO_KL
    grad_on = torch.is_grad_enabled()
    rows = default_chunk_rows(vocab, hidden.device) if chunk_rows is None else int(chunk_rows)
    if rows < 1:
        raise ValueError(f"chunk_rows must be positive, not {chunk_rows}")
    options = _Options(
        denominator=float(max(num_target_tokens, 1)),
        beta=float(beta),
        kl_code=kl_code,
        chunk_rows=rows,
        implementation=implementation,
        need_hidden_grad=grad_on and hidden.requires_grad,
        need_weight_grad=grad_on and weight.requires_grad,
        matmul_dtype=matmul_dtype,
        blocks=triton_blocks,
    )
    objective, ce, kl, num_correct = _LinearLosses.apply(
        flat_hidden,
        weight,
        flat_reference,
        reference_weight if use_kl else None,
        flat_targets,
        flat_mask,
        options,
    )
    return Losses(objective=objective, ce=ce, kl=kl, num_correct=num_correct)
