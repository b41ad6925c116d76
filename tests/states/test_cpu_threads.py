"""How many CPU threads a new run computes with: the threads a micro-batch's model FLOPs keep busy,
at least one, at most the process's cores (rewind.states.cpu_threads)."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from rewind.states.config import Config, GrowthStep
from rewind.states.config_reading import loads_config
from rewind.states.cpu_threads import STEP_FLOPS_PER_THREAD, micro_batch_flops, threads_worth
from tests.conftest import EXAMPLES


def example(name: str) -> Config:
    return loads_config((EXAMPLES / f"{name}.toml").read_text())


def test_the_examples_small_models_compute_with_one_thread_and_the_demo_with_two():
    assert [threads_worth(example(n), 2) for n in ("tiny", "posttrain", "progressive")] == [1, 1, 1]
    assert threads_worth(example("abcd"), 2) == 2  # the demo's recorded figures were made with 2
    assert threads_worth(example("abcd"), 1) == 1  # never more than the process's cores
    assert threads_worth(example("text"), 64) == 4


def test_the_flops_are_palm_s_count_of_one_micro_batch():
    config = example("tiny")  # d 32, d_ff 128, 2 layers, vocab 256, 8 rows of 32 tokens, gelu
    matmul = 2 * (4 * 32 * 32 + 2 * 32 * 128) + 32 * 256
    assert micro_batch_flops(config) == 8 * 32 * (6 * matmul + 12 * 2 * 32 * 32)
    half = msgspec.structs.replace(config, training=msgspec.structs.replace(config.training, per_device_batch_size=4))
    assert micro_batch_flops(half) * 2 == micro_batch_flops(config)  # a micro-batch, not the step
    swiglu = msgspec.structs.replace(config, architecture=msgspec.structs.replace(config.architecture, mlp="swiglu"))
    assert micro_batch_flops(swiglu) > micro_batch_flops(config)


def test_growth_counts_the_blocks_the_model_will_have():
    config = example("tiny")
    grown = msgspec.structs.replace(config, growth=[GrowthStep(at_stage=1, num_blocks=2)])
    deeper = msgspec.structs.replace(
        config, architecture=msgspec.structs.replace(config.architecture, num_layers=4)
    )
    assert micro_batch_flops(grown) == micro_batch_flops(deeper)


@given(d_model=st.sampled_from([16, 64, 256, 1024]), rows=st.integers(1, 64), cores=st.integers(1, 128))
def test_the_count_is_between_one_and_the_cores_and_grows_with_the_work(d_model, rows, cores):
    base = example("tiny")
    config = msgspec.structs.replace(
        base,
        architecture=msgspec.structs.replace(base.architecture, d_model=d_model, num_heads=4),
        training=msgspec.structs.replace(base.training, batch_size=rows),
    )
    count = threads_worth(config, cores)
    assert 1 <= count <= cores
    assert count == max(1, min(cores, int(micro_batch_flops(config) // STEP_FLOPS_PER_THREAD)))
    bigger = msgspec.structs.replace(config, training=msgspec.structs.replace(config.training, batch_size=2 * rows))
    assert threads_worth(bigger, cores) >= count
