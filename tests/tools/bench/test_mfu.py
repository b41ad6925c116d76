"""`rewind bench mfu`: the FLOP count is PaLM's for the model it says it builds, the peak table finds the
devices it lists and no others, and the CPU path reports tokens per second with no MFU, saying why."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rewind.engine.model.model import GPT
from rewind.tools.bench import mfu as bench_mfu
from rewind.tools.bench.mfu import (
    BENCH_ARCHITECTURE,
    CPU_ARCHITECTURE,
    flops_per_token,
    non_embedding_parameters,
    peak_flops,
    run_mfu_bench,
)

KEYS = {
    "device", "num_parameters", "tokens_per_second", "model_flops_per_token", "achieved_tflops", "peak_tflops",
    "mfu", "mfu_goal", "precision", "batch_size", "block_size",
}


def test_the_bench_model_is_the_350m_one_the_docstring_counts():
    with torch.device("meta"):  # shapes only: no memory, no init
        model = GPT(BENCH_ARCHITECTURE)
    assert model.num_parameters() == 375_440_384
    arch = BENCH_ARCHITECTURE
    assert non_embedding_parameters(model) == 375_440_384 - arch.vocab_size * arch.d_model == 341_885_952
    # 6 N + 12 L d T, by hand
    assert flops_per_token(arch, 341_885_952) == 6 * 341_885_952 + 12 * 24 * 1024 * 1024 == 2_353_305_600
    assert "375,440,384 parameters" in bench_mfu.__doc__ and "341,885,952" in bench_mfu.__doc__


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 SXM5 80GB", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA H100 NVL", None),  # another part with another peak: not guessed
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_the_peak_comes_from_the_table_by_device_name(name, peak):
    assert peak_flops(name) == peak


def test_on_a_cpu_tokens_per_second_and_no_mfu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path, even on a GPU machine
    result = run_mfu_bench(quick=True)
    assert result.keys() >= KEYS
    json.dumps(result)  # what `rewind bench mfu --json` prints
    arch = CPU_ARCHITECTURE
    assert (result["device"], result["precision"]) == ("cpu", "fp32")
    assert (result["block_size"], result["batch_size"]) == (arch.block_size, 4)
    assert result["mfu"] is None and result["peak_tflops"] is None
    assert result["mfu_reason"] == "no peak FLOP/s for a CPU" and result["mfu_goal"] == 0.45
    num_matmul = result["num_parameters"] - arch.vocab_size * arch.d_model
    assert result["num_non_embedding_parameters"] == num_matmul
    assert result["model_flops_per_token"] == 6 * num_matmul + 12 * arch.num_layers * arch.d_model * arch.block_size
    assert result["tokens_per_second"] > 0
    assert result["achieved_tflops"] == pytest.approx(
        result["model_flops_per_token"] * result["tokens_per_second"] / 1e12
    )
    tokens_per_step = result["batch_size"] * result["block_size"]
    assert result["step_ms"] == pytest.approx(tokens_per_step / result["tokens_per_second"] * 1e3)
    # It trained: the loss of random tokens is near ln(vocab) and finite.
    assert math.isfinite(result["final_loss"]) and abs(result["final_loss"] - math.log(arch.vocab_size)) < 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_350m_model_in_bf16_with_an_mfu_when_the_device_is_known():
    result = run_mfu_bench(quick=True)
    name = torch.cuda.get_device_name()
    assert result["device"] == f"cuda:{name}" and result["precision"] == "bf16-autocast"
    assert result["num_parameters"] == 375_440_384 and result["model_flops_per_token"] == 2_353_305_600
    assert (result["batch_size"], result["block_size"]) == (16, 1024)
    assert result["tokens_per_second"] > 0 and math.isfinite(result["final_loss"])
    if peak_flops(name) is None:
        assert result["mfu"] is None and name in result["mfu_reason"]
    else:
        assert result["peak_tflops"] == peak_flops(name) / 1e12
        assert 0 < result["mfu"] < 1  # above 1 the FLOP count or the table would be wrong
        assert result["mfu"] == pytest.approx(result["achieved_tflops"] / result["peak_tflops"])
