"""The cache benchmark runs end to end and reports its figures (speed targets are not tested here)."""

from __future__ import annotations

import math

from rewind.tools.bench.cache_store import run_cache_bench


def test_run_cache_bench_reports_both_ratios_and_their_raw_figures(tmp_path, no_syncs):
    result = run_cache_bench(quick=True, tmpdir=str(tmp_path), repeats=1)
    assert result["cache_rows"] * 128 * 256 * 4 == 16 << 20
    assert 0 <= result["cache_stored_overhead"] < 0.01  # uncompressed: chunks, crcs, records
    for kind in ("write", "read"):
        assert math.isfinite(result[f"{kind}_ratio"]) and result[f"{kind}_ratio"] > 0, kind
        cache, memmap = result[f"cache_{kind}_MBps"], result[f"memmap_{kind}_MBps"]
        assert math.isclose(cache / memmap, result[f"{kind}_ratio"])
    assert list(tmp_path.iterdir()) == []  # it cleans up after itself
