"""`rewind bench kernels`: the fused loss kernel's quick bench reports figures that hold together."""

from __future__ import annotations

from rewind.tools.bench.kernels import run_kernels_bench


def test_quick_kernels_bench_reports_sane_figures():
    result = run_kernels_bench(quick=True)
    assert result["device"] == "cpu" and result["implementation"] == "chunked"
    assert result["vocab_size"] >= 32_768 and result["beta"] > 0 and result["kl_kind"] == "token_kl"
    rows, vocab = result["num_rows"], result["vocab_size"]
    # Materialised: the policy's and the reference's float32 logits at least.
    assert result["eager_peak_bytes"] >= 2 * rows * vocab * 4
    assert result["fused_peak_bytes"] > 0
    assert result["memory_ratio"] == result["fused_peak_bytes"] / result["eager_peak_bytes"]
    assert result["eager_seconds"] > 0 and result["fused_seconds"] > 0
    assert result["time_ratio"] == result["fused_seconds"] / result["eager_seconds"]
    assert result["memory_goal"] == 0.25 and result["time_goal"] == 1.0 and not result["time_goal_applies"]
