"""`rewind bench overhead` measures both loops and leaves the model's step as it found it."""

from __future__ import annotations

from rewind.engine.step import mixed_step
from rewind.engine.step.step import train_step
from rewind.tools.bench import overhead as bench_overhead


def test_the_overhead_bench_reports_its_figures_and_restores_the_step():
    result = bench_overhead.run_overhead_bench(quick=True)
    assert result["num_steps_measured"] == 13
    assert result["bare_step_ms"] > result["bare_data_ms"] > 0
    assert result["rewind_data_and_bookkeeping_ms"] > 0
    assert abs(result["bookkeeping_share"] - result["bookkeeping_ms"] / result["bare_step_ms"]) < 1e-9
    assert result["ratio"] > 0 and result["total_ratio"] > 0
    # The bench swaps the model's step out to time what surrounds it; training must get it back.
    assert mixed_step.train_step is train_step and bench_overhead.train_step is train_step
