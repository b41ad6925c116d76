"""`rewind bench mfu`: tokens per second and model FLOPs utilisation of a training step on this machine.

The model is rewind's own GPT (rewind.engine.model.model) at about GPT-2 medium's size, built from an
ArchitectureSection with the Llama block: d_model 1024, 24 layers of 16 heads, SwiGLU with d_ff 2816
(8/3 d_model rounded up to a multiple of 256), RMSNorm, vocabulary 32768, block_size 1024. That is
375,440,384 parameters: 308,330,496 in the blocks, 1,024 in the final norm, 33,554,432 each in the
embedding and the head (not tied); N below is 341,885,952, so 2.35 GFLOP per token. It trains with AdamW (fused on CUDA) under bf16 autocast, the
weights and moments in fp32, on random tokens: a few warm-up steps (allocator, cuBLAS heuristics), then
steps timed between torch.cuda.synchronize() calls. What is timed is the model and the optimizer alone:
rewind's bookkeeping around a step is `rewind bench overhead`'s business.

Model FLOPs per token, PaLM's appendix B (rewind.states.model_size.flops_per_token): 6 N + 12 L d T, N
the parameters that multiply (every one but the embedding table's, which is a lookup; the head is counted;
here counted on the model, so the norms' gains are in), L layers, d = d_model, T = block_size: 6 N
for the forward and backward matmuls, 12 L d T for attention's scores and weighted sums, counted whole
although the causal mask makes half of them zeros (the convention that makes MFUs comparable). No
recomputation is counted: activation checkpointing would cost time but add no model FLOPs. MFU is the
FLOP/s achieved divided by the device's peak dense bf16 FLOP/s, from a table by device name; a device it
does not list gets no MFU, and says why. The goal is 0.45.

On a CPU there is no peak to divide by (and the full model would take minutes a step): a small model
runs in fp32 and only tokens per second are reported.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from rewind.engine.model.model import GPT
from rewind.engine.model.rng import torch_generator
from rewind.states.config import ArchitectureSection
from rewind.states.model_size import flops_per_token, mlp_width

MFU_GOAL = 0.45
SEED = 3
BENCH_ARCHITECTURE = ArchitectureSection(
    block_size=1024, vocab_size=32768, num_layers=24, num_heads=16, d_model=1024, d_ff=2816, mlp="swiglu"
)
CUDA_BATCH_SIZE = 16  # 16k tokens a step keep the GPU busy; activations (estimated ~30 GiB) fit in 80 GB
# The CPU's model: the demo's size, so a step takes a fraction of a second on a shared core.
CPU_ARCHITECTURE = ArchitectureSection(block_size=128, vocab_size=512, num_layers=2, num_heads=4, d_model=128, mlp="swiglu")
CPU_BATCH_SIZE = 4
# Peak dense (not 2:4 sparse) bf16 tensor-core FLOP/s, from the vendors' data sheets. Matched on the
# lower-cased name torch reports, in order: "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe"
# the PCIe one; "H200" also matches GH200, whose GPU has the H100 SXM's peak.
PEAK_BF16_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("h200",), 989e12),
    (("h100", "pcie"), 756e12),
    (("h100", "sxm"), 989e12),
    (("h100", "hbm3"), 989e12),
    (("a100",), 312e12),
)


def peak_flops(device_name: str) -> float | None:
    """The device's peak dense bf16 FLOP/s, or None when the table does not know it."""
    name = device_name.lower()
    for needles, flops in PEAK_BF16_FLOPS:
        if all(needle in name for needle in needles):
            return flops
    return None


def non_embedding_parameters(model: GPT) -> int:
    """The parameters that take part in matmuls: all but the embedding tables (the head is counted)."""
    embeddings = model.embed.weight.numel() + (model.time_embed.weight.numel() if model.time_embed is not None else 0)
    return model.num_parameters() - embeddings


def run_mfu_bench(quick: bool = False) -> dict:
    """The bench on CUDA when there is one, else on the CPU (small model, no MFU). `quick`: fewer steps
    (the same model: MFU depends on its shape)."""
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        device = torch.device("cuda")
        device_name = torch.cuda.get_device_name(device)
        arch, batch_size, precision = BENCH_ARCHITECTURE, CUDA_BATCH_SIZE, "bf16-autocast"
        num_warmup, num_timed = (2, 3) if quick else (5, 20)
    else:
        device, device_name = torch.device("cpu"), "cpu"
        arch, batch_size, precision = CPU_ARCHITECTURE, CPU_BATCH_SIZE, "fp32"
        num_warmup, num_timed = (1, 2) if quick else (2, 8)
    model = GPT(arch, seed=SEED).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=on_cuda)
    batches = _token_batches(arch, batch_size, num_warmup + num_timed, device)
    for tokens in batches[:num_warmup]:
        _train_step(model, optimizer, tokens, on_cuda)
    _synchronize(on_cuda)
    began = time.perf_counter()
    for tokens in batches[num_warmup:]:
        loss = _train_step(model, optimizer, tokens, on_cuda)
    _synchronize(on_cuda)
    seconds = time.perf_counter() - began
    num_matmul = non_embedding_parameters(model)
    per_token = flops_per_token(arch, num_matmul)
    tokens_per_second = num_timed * batch_size * arch.block_size / seconds
    achieved = per_token * tokens_per_second
    peak = peak_flops(device_name) if on_cuda else None
    if not on_cuda:
        reason = "no peak FLOP/s for a CPU"
    elif peak is None:
        reason = f"no peak bf16 FLOP/s known for {device_name} (known: H100 SXM and PCIe, H200, A100)"
    else:
        reason = ""
    return {
        "device": f"cuda:{device_name}" if on_cuda else "cpu",
        "precision": precision,
        "num_parameters": model.num_parameters(),
        "num_non_embedding_parameters": num_matmul,
        "architecture": f"d_model {arch.d_model}, {arch.num_layers} layers, {arch.num_heads} heads, {arch.mlp} "
        f"(d_ff {mlp_width(arch)}), vocab {arch.vocab_size}",
        "batch_size": batch_size,
        "block_size": arch.block_size,
        "num_warmup_steps": num_warmup,
        "num_timed_steps": num_timed,
        "step_ms": seconds / num_timed * 1e3,
        "tokens_per_second": tokens_per_second,
        "model_flops_per_token": per_token,
        "flops_formula": "6 * non-embedding parameters + 12 * layers * d_model * block_size (PaLM, appendix B)",
        "achieved_tflops": achieved / 1e12,
        "peak_tflops": None if peak is None else peak / 1e12,
        "mfu": None if peak is None else achieved / peak,
        "mfu_goal": MFU_GOAL,
        "mfu_reason": reason or None,
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_cuda else None,
        "final_loss": float(loss),
        "threads": torch.get_num_threads(),
    }


def _token_batches(arch: ArchitectureSection, batch_size: int, num_batches: int, device: torch.device) -> list:
    """Random tokens, drawn on the CPU from rewind's streams and moved once: no copy inside the timing."""
    generator = torch_generator(SEED, "bench-mfu", "tokens")
    shape = (num_batches, batch_size, arch.block_size + 1)
    tokens = torch.randint(0, arch.vocab_size, shape, generator=generator).to(device)
    return list(tokens.unbind(0))


def _train_step(model: GPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, on_cuda: bool) -> torch.Tensor:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=on_cuda):
        logits = model(inputs)
    # Outside autocast, in fp32 as rewind's losses compute it: a bf16 softmax over 32k entries loses digits.
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _synchronize(on_cuda: bool) -> None:
    if on_cuda:
        torch.cuda.synchronize()
