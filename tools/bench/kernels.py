"""`rewind bench kernels`: the fused linear + cross-entropy + token-KL loss against materialised logits.

Both variants compute the same thing, forward and backward, from final hidden states and a head weight
(with a frozen reference's hidden states and head, beta > 0, the token KL: the case the fused loss is for):

- eager: logits = hidden @ W.T and the reference's logits materialised for every position, then
  `fused_losses` (kernels/losses.py), then backward through the matmul.
- fused: `linear_losses` (kernels/linear_losses.py): "triton" on CUDA, "chunked" (torch) on CPU.

Figures: seconds per forward+backward (the median of a few calls after a warm-up) and the peak memory
that one call adds above its inputs (hidden states, weights, targets). Goals: memory_ratio (fused/eager)
<= 0.25 everywhere; time_ratio <= 1.0 on CUDA, where the fused loss is meant to run (on CPU the ratio is
reported, not a goal: CPU training is for small models, whose logits fit anyway).

How peak memory is measured. CUDA: torch.cuda.max_memory_allocated after resetting the peak, minus what
was allocated before the call. CPU: each variant runs in a fresh interpreter (sys.executable), so one
variant's freed-but-kept pages cannot hide the other's; after the inputs exist, the kernel's high-water
mark of resident memory is reset (writing 5 to /proc/self/clear_refs) and the call's peak is VmHWM minus
the resident size before the call. Where that reset is refused, the call's figure is getrusage's max RSS
minus the resident size before the call, an upper bound (the inputs are filled in place, so nothing
before the call peaks above them by much); `peak_method` says which was used.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

MEMORY_GOAL = 0.25
TIME_GOAL = 1.0
BENCH_SEED = 20_013  # a fixed, local generator: the figures do not depend on the caller's RNG state
BETA = 0.1
KL_KIND = "token_kl"
VOCAB = 32_768
# (rows, d_model, timed calls): CPU sizes keep the full bench near a minute on two cores.
SIZES = {
    ("cpu", False): (4096, 256, 3),
    ("cpu", True): (64, 64, 3),
    ("cuda", False): (16_384, 2048, 5),
    ("cuda", True): (512, 256, 2),
}


def _inputs(device: str, dtype: torch.dtype, num_rows: int, d_model: int, vocab: int):
    """Hidden states, head, reference hidden states and head, targets, mask: filled in place, so making
    them peaks no higher than holding them."""
    g = torch.Generator(device=device).manual_seed(BENCH_SEED)
    tensors = []
    for shape in ((num_rows, d_model), (vocab, d_model), (num_rows, d_model), (vocab, d_model)):
        t = torch.empty(shape, dtype=dtype, device=device)
        t.normal_(generator=g)
        if shape[0] == vocab:
            t.mul_(3.0 / d_model**0.5)  # logits of a few units: a softmax that is neither flat nor one-hot
        tensors.append(t)
    hidden, weight, ref_hidden, ref_weight = tensors
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    targets = torch.randint(0, vocab, (num_rows,), generator=g, device=device)
    mask = torch.ones(num_rows, dtype=torch.bool, device=device)
    return hidden, weight, ref_hidden, ref_weight, targets, mask


def _variant(name: str, implementation: str) -> Callable[..., None]:
    from rewind.kernels.linear_losses import linear_losses
    from rewind.kernels.losses import fused_losses

    def eager(hidden, weight, ref_hidden, ref_weight, targets, mask):
        logits = hidden @ weight.T
        with torch.no_grad():
            reference_logits = ref_hidden @ ref_weight.T
        num = int(mask.sum())
        fused_losses(logits, targets, mask, num, reference_logits, BETA, KL_KIND).objective.backward()

    def fused(hidden, weight, ref_hidden, ref_weight, targets, mask):
        num = int(mask.sum())
        losses = linear_losses(
            hidden,
            weight,
            targets,
            mask,
            num,
            ref_hidden,
            ref_weight,
            BETA,
            KL_KIND,
            implementation=implementation,
        )
        losses.objective.backward()

    return {"eager": eager, "fused": fused}[name]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _high_water_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


def measure(name: str, device: str, implementation: str, num_rows: int, d_model: int, num_calls: int) -> dict:
    """One variant's figures, in this process: {"seconds", "peak_bytes", "peak_method"}."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    inputs = _inputs(device, dtype, num_rows, d_model, VOCAB)
    hidden, weight = inputs[0], inputs[1]
    call = _variant(name, implementation)

    def once() -> None:
        hidden.grad = weight.grad = None  # each call allocates its own gradients, as a step does
        call(*inputs)

    if device == "cuda":
        once()  # warm-up: Triton compiles, cuBLAS picks its kernels
        torch.cuda.synchronize()
        hidden.grad = weight.grad = None
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        once()
        torch.cuda.synchronize()
        peak, method = torch.cuda.max_memory_allocated() - before, "cuda_max_memory_allocated"
    else:
        before = _resident_bytes()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the high-water mark of resident memory to what is resident now
            method = "vmhwm"
        except OSError:
            method = "ru_maxrss_upper_bound"
        once()  # the first call, also the warm-up: its peak is the one measured
        if method == "vmhwm":
            peak = _high_water_bytes() - before
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    times = []
    for _ in range(num_calls):
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        once()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return {"seconds": statistics.median(times), "peak_bytes": max(int(peak), 0), "peak_method": method}


def _measure_in_child(name: str, implementation: str, num_rows: int, d_model: int, num_calls: int) -> dict:
    code = (
        "import json, sys; from rewind.tools.bench.kernels import measure; "
        f"print(json.dumps(measure({name!r}, 'cpu', {implementation!r}, {num_rows}, {d_model}, {num_calls})))"
    )
    # From a temporary directory: the repository's top-level kernels/ would shadow another package's module.
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tempfile.gettempdir(), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the {name} variant of the kernels bench failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_kernels_bench(quick: bool = False) -> dict:
    """Forward+backward time and peak memory of materialised logits against `linear_losses`, at a 32768-token
    vocabulary (quick: a few rows, for smoke tests)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    implementation = "triton" if device == "cuda" else "chunked"
    num_rows, d_model, num_calls = SIZES[(device, quick)]
    figures = {}
    for name in ("eager", "fused"):
        if device == "cuda":
            figures[name] = measure(name, device, implementation, num_rows, d_model, num_calls)
            torch.cuda.empty_cache()
        else:
            figures[name] = _measure_in_child(name, implementation, num_rows, d_model, num_calls)
    eager, fused = figures["eager"], figures["fused"]
    return {
        "device": device,
        "implementation": implementation,
        "dtype": "bfloat16" if device == "cuda" else "float32",
        "num_rows": num_rows,
        "d_model": d_model,
        "vocab_size": VOCAB,
        "beta": BETA,
        "kl_kind": KL_KIND,
        "eager_seconds": eager["seconds"],
        "fused_seconds": fused["seconds"],
        "time_ratio": fused["seconds"] / eager["seconds"],
        "eager_peak_bytes": eager["peak_bytes"],
        "fused_peak_bytes": fused["peak_bytes"],
        "memory_ratio": fused["peak_bytes"] / max(eager["peak_bytes"], 1),
        "peak_method": fused["peak_method"],
        "memory_goal": MEMORY_GOAL,
        "time_goal": TIME_GOAL,
        "time_goal_applies": device == "cuda",
        "num_calls": num_calls,
    }
