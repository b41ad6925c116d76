"""Parts 2 and 3 of `rewind bench gpu`: the loss kernels, and MFU.

Kernels. `rewind bench kernels`' own measurement (rewind.tools.bench.kernels.measure: median seconds of a
forward+backward, peak memory above the inputs) of materialised logits, the Triton kernel and the chunked
torch loss, at its CUDA size (16384 rows, d_model 2048, V = 32768, bf16, token KL), repeated: the time
ratios are given as the median and the range over the repeats. Then each fused loss against
`reference_losses` on materialised logits, float32 and bf16: relative errors of the values and of the
gradients, held to the bounds tests/kernels holds them to. CPU form: the bench's quick size, one repeat,
the chunked loss alone timed (Triton's interpreter says nothing about speed), agreement at a small size.

MFU. The ~375M model of `rewind bench mfu` (tools/bench/mfu.py: its architecture, batch, FLOPs per
token and peak table) trained in rewind's bf16-mixed: placed by rewind's own `place` as a one-rank
FSDP2 group (bf16 parameters for compute, fp32 master weights and reductions), AdamW fused, eager and
then compiled (`compute.compile`; the first step's time is the compile's). Each step is timed between
synchronisations: the median step, and its range. A compile that outlives the part's budget leaves the
eager figures. CPU form: a tiny model, eager only (a cold compile takes tens of seconds on a CPU).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rewind.states.model_size import mlp_width
from rewind.tools.bench.gpu_schema import Agreement, FusedKernel, MfuRun

KERNEL_REPEATS = {"cuda": 3, "cpu": 1}
FUSED = {"cuda": ("triton", "chunked"), "cpu": ("chunked",)}
AGREEMENT_SIZE = {"cuda": (4096, 1024, 32_768), "cpu": (48, 32, 1000)}  # rows, d_model, vocabulary
# tests/kernels' bounds: (value rtol, value atol, gradient rtol). float32 on CUDA is not 1e-5: cuBLAS
# may pick other kernels for a chunk than for the whole batch.
BOUNDS = {torch.float32: (1e-4, 1e-5, 1e-4), torch.bfloat16: (1e-2, 1e-3, 2e-2)}
AGREEMENT_SEED = 26

MFU_STEPS = {"cuda": (3, 15), "cpu": (1, 2)}  # warm-up steps, timed steps
CPU_MFU_BATCH = 2


def kernels_part(rec, device: str, work: Path) -> None:
    if device == "cpu":
        import rewind.kernels.triton_losses  # noqa: F401 (first: it switches Triton's interpreter on)
    from rewind.tools.bench import kernels as bench

    num_rows, d_model, num_calls = bench.SIZES[(device, device == "cpu")]
    repeats = KERNEL_REPEATS[device]
    rec.figures(
        dtype="bfloat16" if device == "cuda" else "float32",
        num_rows=num_rows,
        d_model=d_model,
        vocab_size=bench.VOCAB,
        beta=bench.BETA,
        kl_kind=bench.KL_KIND,
        repeats=repeats,
    )
    seconds: dict[str, list[float]] = {name: [] for name in ("eager", *FUSED[device])}
    peaks: dict[str, int] = {}
    for repeat in range(repeats):
        for name in seconds:
            rec.doing(f"timing {name}, repeat {repeat + 1} of {repeats}")
            variant, implementation = ("eager", "chunked") if name == "eager" else ("fused", name)
            measured = bench.measure(variant, device, implementation, num_rows, d_model, num_calls)
            seconds[name].append(measured["seconds"])
            peaks.setdefault(name, measured["peak_bytes"])  # the first call's: the same every repeat
            rec.figures(peak_method=measured["peak_method"])
            if device == "cuda":
                torch.cuda.empty_cache()
    eager = seconds.pop("eager")
    fused = []
    for name, times in seconds.items():
        ratios = [t / e for t, e in zip(times, eager, strict=True)]
        kernel = FusedKernel(
            implementation=name,
            seconds=statistics.median(times),
            peak_bytes=peaks[name],
            memory_ratio=peaks[name] / max(peaks["eager"], 1),
            time_ratio=statistics.median(ratios),
            time_ratio_min=min(ratios),
            time_ratio_max=max(ratios),
        )
        fused.append(kernel)
        rec.goal(f"{name} memory ratio", kernel.memory_ratio, bench.MEMORY_GOAL, "<=")
        if device == "cuda":  # on a CPU the ratio is reported, not a goal (kernels.py)
            rec.goal(f"{name} time ratio", kernel.time_ratio, bench.TIME_GOAL, "<=")
    rec.figures(eager_seconds=statistics.median(eager), eager_peak_bytes=peaks["eager"], fused=fused)

    agreements = []
    for implementation in ("triton", "chunked"):
        for dtype in (torch.float32, torch.bfloat16):
            rec.doing(f"{implementation} against the reference, {dtype}")
            found, values_ok = agreement(implementation, dtype, device, *AGREEMENT_SIZE[device])
            agreements.append(found)
            rec.figures(agreement=agreements)
            grads_ok = max(found.grad_hidden_rel, found.grad_weight_rel) <= found.grad_rtol
            rec.check(
                f"{implementation} agrees with the torch reference in {found.dtype}",
                values_ok and grads_ok and found.num_correct_diff == 0,
                f"objective {found.objective_rel:.2g}, kl {found.kl_rel:.2g} relative (bound {found.value_rtol:g} "
                f"+ {found.value_atol:g} absolute); gradients {found.grad_hidden_rel:.2g} (hidden), "
                f"{found.grad_weight_rel:.2g} (head) relative (bound {found.grad_rtol:g}); argmax differs on "
                f"{found.num_correct_diff} rows",
            )


def agreement(
    implementation: str, dtype: torch.dtype, device: str, rows: int, width: int, vocab: int
) -> tuple[Agreement, bool]:
    """A fused loss against the reference on random inputs; and whether every value is within the tests'
    rule for this dtype (|got - want| <= atol + rtol |want|)."""
    from rewind.kernels.linear_losses import linear_losses
    from rewind.kernels.losses import reference_losses
    from rewind.tools.bench import kernels as bench

    g = torch.Generator(device=device).manual_seed(AGREEMENT_SEED)

    def normal(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    hidden, weight = normal(rows, width), normal(vocab, width, scale=3.0 / width**0.5)
    ref_hidden, ref_weight = normal(rows, width), normal(vocab, width, scale=3.0 / width**0.5)
    targets = torch.randint(0, vocab, (rows,), generator=g, device=device)
    mask = torch.rand(rows, generator=g, device=device) < 0.9
    num = int(mask.sum())

    def losses_and_grads(fused: bool):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if fused:
            losses = linear_losses(
                h,
                w,
                targets,
                mask,
                num,
                ref_hidden,
                ref_weight,
                bench.BETA,
                bench.KL_KIND,
                implementation=implementation,
            )
        else:
            losses = reference_losses(
                h @ w.T, targets, mask, num, ref_hidden @ ref_weight.T, bench.BETA, bench.KL_KIND
            )
        losses.objective.backward()
        return losses, h.grad, w.grad

    (got, got_h, got_w), (want, want_h, want_w) = losses_and_grads(True), losses_and_grads(False)
    pairs = [(float(getattr(got, n)), float(getattr(want, n))) for n in ("objective", "ce", "kl")]
    value_rtol, value_atol, grad_rtol = BOUNDS[dtype]
    found = Agreement(
        implementation=implementation,
        dtype=str(dtype).removeprefix("torch."),
        num_rows=rows,
        d_model=width,
        vocab_size=vocab,
        objective_rel=_relative(*pairs[0]),
        ce_rel=_relative(*pairs[1]),
        kl_rel=_relative(*pairs[2]),
        num_correct_diff=abs(int(got.num_correct) - int(want.num_correct)),
        grad_hidden_rel=_norm_relative(got_h, want_h),
        grad_weight_rel=_norm_relative(got_w, want_w),
        value_rtol=value_rtol,
        value_atol=value_atol,
        grad_rtol=grad_rtol,
    )
    return found, all(abs(a - b) <= value_atol + value_rtol * abs(b) for a, b in pairs)


def _relative(got: float, want: float) -> float:
    return abs(got - want) / abs(want) if want else abs(got - want)


def _norm_relative(got: torch.Tensor, want: torch.Tensor) -> float:
    want64 = want.double()
    return float((got.double() - want64).norm() / want64.norm().clamp_min(1e-300))


def mfu_part(rec, device: str, work: Path) -> None:
    from rewind.engine.model.placement import join_process_group, leave_process_group
    from rewind.states.config import ArchitectureSection, ComputeSection
    from rewind.tools.bench import mfu as bench_mfu

    on_cuda = device == "cuda"
    if on_cuda:
        arch, batch_size = bench_mfu.BENCH_ARCHITECTURE, bench_mfu.CUDA_BATCH_SIZE
        peak = bench_mfu.peak_flops(torch.cuda.get_device_name())
    else:
        arch = ArchitectureSection(
            block_size=32, vocab_size=256, num_layers=2, num_heads=2, d_model=32, mlp="swiglu"
        )
        batch_size, peak = CPU_MFU_BATCH, None
    # Speed, not bits: deterministic CUDA algorithms are slower, and no run is compared here.
    compute = ComputeSection(device=device, precision="bf16-mixed", deterministic=False)
    rec.figures(
        precision=compute.precision,
        architecture=f"d_model {arch.d_model}, {arch.num_layers} layers, {arch.num_heads} heads, {arch.mlp} "
        f"(d_ff {mlp_width(arch)}), vocab {arch.vocab_size}",
        batch_size=batch_size,
        block_size=arch.block_size,
        peak_tflops=None if peak is None else peak / 1e12,
        mfu_goal=bench_mfu.MFU_GOAL,
    )
    join_process_group(compute)
    try:
        for compiled in (False, True):
            if compiled and not on_cuda:
                rec.figures(
                    compiled_skipped="the CPU form does not compile (a cold compile takes tens of seconds)"
                )
                break
            rec.doing(f"building the {'compiled' if compiled else 'eager'} model")
            run = _mfu_run(rec, arch, compute, batch_size, compiled, peak)
            rec.figures(**{"compiled" if compiled else "eager": run})
            rec.check(
                f"the {'compiled' if compiled else 'eager'} model's loss is finite",
                math.isfinite(run.final_loss),
            )
            if run.mfu is not None:
                rec.goal(f"MFU, {'compiled' if compiled else 'eager'}", run.mfu, bench_mfu.MFU_GOAL, ">=")
    finally:
        leave_process_group()


def _mfu_run(rec, arch, compute, batch_size: int, compiled: bool, peak: float | None) -> MfuRun:
    import msgspec

    from rewind.engine.model.model import GPT
    from rewind.engine.model.placement import place
    from rewind.engine.model.rng import torch_generator
    from rewind.states.config import Config
    from rewind.tools.bench import mfu as bench_mfu

    on_cuda = compute.device == "cuda"
    device = torch.device("cuda" if on_cuda else "cpu")
    model = GPT(arch, seed=bench_mfu.SEED)
    num_parameters, num_matmul = model.num_parameters(), bench_mfu.non_embedding_parameters(model)
    per_token = bench_mfu.flops_per_token(arch, num_matmul)
    rec.figures(num_parameters=num_parameters, model_flops_per_token=per_token)
    place(model, Config(architecture=arch, compute=msgspec.structs.replace(compute, compile=compiled)))
    model.train()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    num_warmup, num_timed = MFU_STEPS[compute.device]
    generator = torch_generator(bench_mfu.SEED, "bench-gpu-mfu", "tokens")
    shape = (num_warmup + num_timed, batch_size, arch.block_size + 1)
    batches = torch.randint(0, arch.vocab_size, shape, generator=generator).to(device).unbind(0)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds, loss = [], torch.zeros(())
    label = "the compiled model" if compiled else "the eager model"
    for i, tokens in enumerate(batches):
        rec.doing(
            f"{label}, step {i + 1} of {len(batches)}" + (" (compiling)" if compiled and i == 0 else "")
        )
        began = time.perf_counter()
        logits = model(tokens[:, :-1])
        # fp32, as rewind's losses compute it: a bf16 softmax over 32k entries loses digits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if on_cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
    timed = seconds[num_warmup:]
    step = statistics.median(timed)
    tokens_per_second = batch_size * arch.block_size / step
    run = MfuRun(
        compiled=compiled,
        warmup_steps=num_warmup,
        timed_steps=num_timed,
        first_step_s=seconds[0],
        step_ms=step * 1e3,
        step_ms_min=min(timed) * 1e3,
        step_ms_max=max(timed) * 1e3,
        tokens_per_second=tokens_per_second,
        achieved_tflops=per_token * tokens_per_second / 1e12,
        mfu=None if peak is None else per_token * tokens_per_second / peak,
        peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None,
        final_loss=float(loss.detach()),
    )
    del model, optimizer, batches, logits, loss
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return run
