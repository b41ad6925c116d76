"""`rewind bench resume` measures what it says: opening a run folds only the tail after a snapshot."""

from __future__ import annotations

from rewind.tools.bench.resume import TAIL_STEPS, run_resume_bench


def test_the_resume_bench_folds_a_tail_of_the_same_size_at_both_sizes(tmp_path):
    result = run_resume_bench(tmpdir=str(tmp_path), repeats=1, sizes=(2_000, 5_000))
    assert result["small_num_steps"] == 2_000 and result["large_num_steps"] == 5_000
    # The tail is TAIL_STEPS steps (a StepCommitted each, and their bookkeeping), not the log.
    assert TAIL_STEPS <= result["large_tail_records"] < result["large_num_records"] // 4
    assert result["large_warm_s"] > 0 and result["large_cold_s"] > 0 and result["tail_ratio"] > 0
    assert set(result) >= {"tail_ratio", "goal_tail_ratio", "large_warm_s", "goal_large_warm_s"}
