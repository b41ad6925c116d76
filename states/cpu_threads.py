"""How many CPU threads a new run's steps keep busy: a pure function of its config.

torch splits an op over its OpenMP threads when the op is large; a small model's ops hand each extra
thread a few microseconds of work, and every one of the hundreds of parallel regions a step opens wakes
the sleeping threads and waits for them at a barrier. On a machine other jobs keep busy each such wait
is a trip through the scheduler: the tiny example computed with 2 threads took 1.7-2.5x its time alone
beside two CPU-bound processes, with 1 thread 1.4-1.6x, and it was faster alone with 1 thread too
(`rewind bench threads`). So a new run computes with as many threads as a micro-batch's forward and
backward keep busy (one per STEP_FLOPS_PER_THREAD of its model FLOPs, at least one), up to the cores
the process may use. Measured on a 2-core AVX512 machine (torch 2.13): examples/posttrain.toml (0.8
GFLOP a micro-batch) 10% slower with 2 threads than with 1, examples/abcd.toml (5.4 GFLOP) the same
either way.

The count is part of a run's bits (rewind.engine.model.placement.adopt_threads) and is recorded when the run
starts; a resume computes with the recorded count, so this rule decides for new runs only.
"""

from __future__ import annotations

import msgspec

from rewind.states.config import Config
from rewind.states.model_size import flops_per_token, matmul_parameters

# Model FLOPs of one micro-batch's forward and backward worth one more CPU thread.
STEP_FLOPS_PER_THREAD = 2e9


def micro_batch_flops(config: Config) -> int:
    """PaLM's model FLOPs (rewind.states.model_size.flops_per_token) of one micro-batch of the largest
    model the config's growth reaches: its matmul weights (attention, MLP, output head), not its
    embeddings."""
    arch = config.architecture
    layers = arch.num_layers + sum(step.num_blocks for step in config.growth)
    grown = msgspec.structs.replace(arch, num_layers=layers)
    rows = config.training.per_device_batch_size
    tokens = (rows if rows > 0 else config.training.batch_size) * arch.block_size
    return tokens * flops_per_token(grown, matmul_parameters(grown))


def threads_worth(config: Config, cores: int) -> int:
    """The CPU threads a new run of `config` computes with, given the `cores` the process may use."""
    worth = int(micro_batch_flops(config) // STEP_FLOPS_PER_THREAD)
    return max(1, min(cores, worth))
