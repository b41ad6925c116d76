"""`rewind bench cache`, the training half: what reading a frozen trunk's outputs from a cache saves.

A grown model trains a new stack of N blocks on a frozen trunk of >= 3N blocks. Two ways to get the
trunk's output for a batch, timed on the same model, data and optimizer:

- recompute: embed and run the trunk every step, under torch.no_grad as a frozen trunk is run;
- cached: read the rows from an ActivationCache the trunk's outputs were written to beforehand.

Each step then trains the new stack, a final norm and a head (forward, backward, AdamW). `speedup` =
recompute step time / cached step time (medians; the cached step includes its read), goal >= 2.
What the cache can save is the trunk's forward pass (`trunk_forward_ms`, printed beside it): with a
trunk of 3N blocks and a backward pass about twice a forward, the new stack's step costs about what
the trunk's forward does, so the speedup approaches 2 from below; deeper trunks go beyond it.
Both sides train identical copies of the new stack, so they must report the same losses, bit for bit:
`losses_match` checks that the cache handed back exactly what the trunk computes.

Only `Block`, `GPT._rope_tables` and `ArchitectureSection` are taken from the engine.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

from rewind.engine.model import GPT, Block
from rewind.states.config import ArchitectureSection
from rewind.stores.activations import ActivationCache, CacheSpec

FULL = {"d_model": 256, "num_heads": 4, "block_size": 128, "batch": 8, "trunk": 6, "new": 2, "steps": 12}
QUICK = {"d_model": 64, "num_heads": 4, "block_size": 32, "batch": 4, "trunk": 6, "new": 2, "steps": 4}
NUM_WARMUP_STEPS = 2  # first steps pay for allocations and AdamW's state: not timed
BATCHES_PER_CHUNK = 1  # one chunk per step, as engine/trunkcache.py lays caches out


class _Head(nn.Module):
    """What trains: the new stack, a final norm and the output head."""

    def __init__(self, arch: ArchitectureSection, num_blocks: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(arch) for _ in range(num_blocks))
        self.norm = nn.RMSNorm(arch.d_model, eps=1e-5)
        self.head = nn.Linear(arch.d_model, arch.vocab_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


class _Trunk(nn.Module):
    """The frozen part: embedding and the trunk's blocks."""

    def __init__(self, arch: ArchitectureSection, num_blocks: int):
        super().__init__()
        self.embed = nn.Embedding(arch.vocab_size, arch.d_model)
        self.blocks = nn.ModuleList(Block(arch) for _ in range(num_blocks))
        self.requires_grad_(False)
        self.eval()

    @torch.no_grad()
    def forward(self, idx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return x


def _train_step(model: _Head, optimizer, x, targets, cos, sin) -> float:
    logits = model(x, cos, sin)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


def _write_trunk_outputs(url: str, trunk: _Trunk, inputs: torch.Tensor, batch: int, cos, sin) -> ActivationCache:
    """The trunk's outputs for every row, computed batch by batch exactly as the recomputing side
    computes them (same shapes, so the same bits), written chunk by chunk."""
    num_rows, seq_len = inputs.shape
    width = trunk.embed.embedding_dim
    spec = CacheSpec(num_rows, seq_len, width, "float32", rows_per_chunk=batch * BATCHES_PER_CHUNK)
    cache = ActivationCache.create(url, spec)
    for chunk in range(cache.num_chunks):
        start, stop = cache.chunk_rows(chunk)
        parts = [trunk(inputs[a : min(a + batch, stop)], cos, sin) for a in range(start, stop, batch)]
        cache.write_chunk(chunk, torch.cat(parts))
    cache.mark_complete()
    return cache


def run_trunk_speedup(quick: bool = False) -> dict:
    sizes = QUICK if quick else FULL
    arch = ArchitectureSection(
        block_size=sizes["block_size"],
        d_model=sizes["d_model"],
        num_heads=sizes["num_heads"],
        num_layers=sizes["trunk"] + sizes["new"],
    )
    batch, seq_len, num_steps = sizes["batch"], sizes["block_size"], NUM_WARMUP_STEPS + sizes["steps"]
    cos, sin = (table[:seq_len] for table in GPT._rope_tables(arch))
    # Blocks draw their initial weights from the global RNG: seeded here, the caller's left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        trunk = _Trunk(arch, sizes["trunk"])
        recomputing = _Head(arch, sizes["new"])
        tokens = torch.randint(0, arch.vocab_size, (num_steps * batch, seq_len + 1))
    cached = copy.deepcopy(recomputing)
    optimizers = {
        side: torch.optim.AdamW(model.parameters(), lr=1e-3)
        for side, model in (("recompute", recomputing), ("cached", cached))
    }
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    times: dict[str, list[float]] = {"recompute": [], "cached": [], "read": [], "trunk": []}
    losses: dict[str, list[float]] = {"recompute": [], "cached": []}
    with tempfile.TemporaryDirectory(prefix="rewind-bench-trunk-") as root:
        cache = _write_trunk_outputs(f"{root}/trunk.zarr", trunk, inputs, batch, cos, sin)
        cache = ActivationCache.open(cache.location.url)  # as a resumed run would find it
        for step in range(num_steps):  # the two sides interleaved: a busy spell hits both
            rows = slice(step * batch, (step + 1) * batch)
            began = time.perf_counter()
            x = trunk(inputs[rows], cos, sin)
            trunk_s = time.perf_counter() - began
            losses["recompute"].append(_train_step(recomputing, optimizers["recompute"], x, targets[rows], cos, sin))
            recompute_s = time.perf_counter() - began
            began = time.perf_counter()
            x = cache.read_rows(rows.start, rows.stop)
            read_s = time.perf_counter() - began
            losses["cached"].append(_train_step(cached, optimizers["cached"], x, targets[rows], cos, sin))
            cached_s = time.perf_counter() - began
            if step >= NUM_WARMUP_STEPS:
                times["recompute"].append(recompute_s)
                times["cached"].append(cached_s)
                times["read"].append(read_s)
                times["trunk"].append(trunk_s)
    recompute_step, cached_step = statistics.median(times["recompute"]), statistics.median(times["cached"])
    return {
        "trunk_blocks": sizes["trunk"],
        "new_blocks": sizes["new"],
        "d_model": arch.d_model,
        "seq_len": seq_len,
        "batch": batch,
        "num_steps_measured": len(times["cached"]),
        "recompute_step_ms": recompute_step * 1e3,
        "cached_step_ms": cached_step * 1e3,
        "trunk_forward_ms": statistics.median(times["trunk"]) * 1e3,
        "cache_read_ms": statistics.median(times["read"]) * 1e3,
        "speedup": recompute_step / cached_step,
        "losses_match": losses["recompute"] == losses["cached"],
        "goal_speedup": ">= 2",
        "threads": torch.get_num_threads(),
    }
