"""The log benchmark runs end to end and reports every figure (speed targets are not tested here)."""

from __future__ import annotations

import math

from rewind.states.fold import fold
from rewind.tools.bench.log import bench_events, run_log_bench


def test_bench_events_fold_into_a_run_at_the_last_step():
    state = fold(bench_events(30))
    assert (state.step, state.started) == (30, True)


def test_run_log_bench_reports_every_ratio_and_its_raw_figures(tmp_path):
    result = run_log_bench(num_events=300, tmpdir=str(tmp_path), repeats=1)
    assert result["num_events"] == 300 and result["num_events_commit_1"] == 50
    assert result["replay_includes_fold"] is True
    for kind in ("append_ratio_commit_1", "append_ratio_commit_100", "decode_ratio", "replay_ratio"):
        assert math.isfinite(result[kind]) and result[kind] > 0, kind
    for commit_every in (1, 100):
        ours, raw = (result[f"{side}_events_per_s_commit_{commit_every}"] for side in ("append", "raw"))
        assert math.isclose(ours / raw, result[f"append_ratio_commit_{commit_every}"])
    assert list(tmp_path.iterdir()) == []  # it cleans up after itself
