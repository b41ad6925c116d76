"""`rewind bench overhead`: what the event log, commits, cursors and metrics cost per step.

The same model, data and optimizer are run twice: by a bare PyTorch loop over batches assembled in
advance (no log, no cursors, no metrics), and by rewind's own loop (`drive`) in a fresh run
directory. Both call the same `train_step`, so the difference is rewind's bookkeeping alone.

Two figures: `ratio`, of median step times (what a typical step pays: cursors, decide, encoding and
appending the event, the metrics projection), and `total_ratio`, of the summed step times, which
also counts what lands on one step in `report_interval` (the group commit's fdatasync, the metrics
flush). The goal is <= 1.02 for both on CPU.

Step times on a shared 2-core machine wander by a percent or two between identical runs, which is as
large as what is measured. So the bench also times both loops with the model's step taken out (the
same `train_step` replaced by one that computes nothing): what remains is the bare loop's data
synthesis, and rewind's data synthesis plus its bookkeeping. `bookkeeping_ms` is the difference, and
`bookkeeping_share` that over a bare step: a steady figure for where the ratio's excess goes.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import torch

from rewind.engine.data.cursors import split_rows
from rewind.engine.data.registry import DatasetRegistry
from rewind.engine.model.layout import build_model
from rewind.engine.run.loop import drive
from rewind.engine.run.session import open_run
from rewind.engine.step.step import StepResult, build_optimizer, train_step
from rewind.states.config_reading import loads_config
from rewind.states.schedule import Schedule

# The demo's model size; one stage, no validation and no interval checkpoints: the steady state of a
# long run.
BENCH_CONFIG = """
[run]
name = "bench-overhead"
seed = 3
[architecture]
block_size = 64
num_layers = 4
num_heads = 4
d_model = 128
[training]
batch_size = 16
tokens = [{tokens}]
datasets = [[{{ name = "grammar", rate = 0.5 }}, {{ name = "reverse", rate = 0.5 }}]]
evaluations = ["reverse"]
eval_samples = 8
[optimization]
schedule = "constant"
lr = 1e-3
[logging]
validation_interval = 0
checkpoint_interval = 0
"""


def _bare_step_times(config, num_steps: int) -> list[float]:
    """A plain loop: the same samples synthesised on the fly (what any data loader pays), read at
    sequential indices (no cursors), no log, no metrics."""
    schedule = Schedule(config)
    datasets = DatasetRegistry(config)
    model = build_model(config, None)
    optimizer = build_optimizer(model, config)
    mixture = config.stages[0].datasets
    shares = split_rows(mixture, config.training.batch_size)
    times = []
    for k in range(num_steps):
        began = time.perf_counter()
        pieces = [
            datasets[s.name].batch("train", np.arange(k * n, (k + 1) * n)) for s, n in zip(mixture, shares, strict=True)
        ]
        tokens = torch.cat([p[0] for p in pieces])
        mask = torch.cat([p[1] for p in pieces])
        train_step(model, optimizer, tokens, mask, config=config, lr=schedule.lr(k), beta=0.0, reference=None, step=k)
        times.append(time.perf_counter() - began)
    return times


@contextlib.contextmanager
def _without_the_model_step() -> Iterator[None]:
    """Both loops call `train_step` through their module; swap in one that computes nothing, so what
    is timed is everything around the model's step."""
    from rewind.engine.step import mixed_step

    def nothing(*args, **kwargs) -> StepResult:
        return StepResult(loss=1.0, kl=0.0, grad_norm=1.0, num_correct=0, num_target_tokens=1, finite=True)

    here = globals()
    real = here["train_step"]
    here["train_step"], mixed_step.train_step = nothing, nothing
    try:
        yield
    finally:
        here["train_step"], mixed_step.train_step = real, real


def _rewind_step_times(config, num_steps: int) -> list[float]:
    stamps: list[float] = []
    with tempfile.TemporaryDirectory(prefix="rewind-bench-") as run_dir:
        run, state, _ = open_run(config, run_dir)
        try:
            began = time.perf_counter()
            stamps.append(began)
            drive(run, state, max_steps=num_steps, progress=lambda _state: stamps.append(time.perf_counter()))
        finally:
            run.journal.close()
    # The first interval also holds the run's start-up control events; drop it like the bare warm-up.
    return [b - a for a, b in itertools.pairwise(stamps)]


def run_overhead_bench(quick: bool = False, num_rounds: int = 3) -> dict:
    num_steps = 15 if quick else 60
    config = loads_config(BENCH_CONFIG.format(tokens=(num_steps + 5) * 16 * 64), source="bench")
    bare: list[float] = []
    ours: list[float] = []
    for _ in range(1 if quick else num_rounds):  # interleaved, so drift in machine load hits both
        bare += _bare_step_times(config, num_steps)[2:]
        ours += _rewind_step_times(config, num_steps)[2:]
    bare_median, ours_median = statistics.median(bare), statistics.median(ours)
    with _without_the_model_step():
        bare_rest = statistics.mean(_bare_step_times(config, num_steps * 4)[2:])
        ours_rest = statistics.mean(_rewind_step_times(config, num_steps * 4)[2:])
    return {
        "num_steps_measured": len(ours),
        "bare_step_ms": bare_median * 1e3,
        "rewind_step_ms": ours_median * 1e3,
        "ratio": ours_median / bare_median,
        "total_ratio": sum(ours) / sum(bare),
        "bare_data_ms": bare_rest * 1e3,
        "rewind_data_and_bookkeeping_ms": ours_rest * 1e3,
        "bookkeeping_ms": (ours_rest - bare_rest) * 1e3,
        "bookkeeping_share": (ours_rest - bare_rest) / bare_median,
        "goal": "<= 1.02",
        "threads": torch.get_num_threads(),
    }
