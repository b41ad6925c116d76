"""`rewind bench cache`: the trunk-speedup half, and the command's smoke test (no timing targets)."""

from __future__ import annotations

import json
import math

import torch

from rewind.tools.bench.cache_trunk import run_trunk_speedup


def test_the_cached_sides_train_exactly_like_the_recomputing_sides_at_3x_and_6x():
    before = torch.random.get_rng_state()
    result = run_trunk_speedup(quick=True)
    assert result["losses_match"] is True  # the cache handed back the trunk's outputs bit for bit, twice
    assert result["trunk_blocks"] == 3 * result["new_blocks"] == 6 * result["new_blocks_6x"]
    assert result["num_steps_measured"] == 4
    assert result["recompute_step_ms"] > result["trunk_forward_ms"] > 0
    assert result["recompute_step_6x_ms"] > result["trunk_forward_ms"]
    for key in ("speedup", "speedup_6x"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert math.isclose(result["speedup"], result["recompute_step_ms"] / result["cached_step_ms"])
    assert math.isclose(result["speedup_6x"], result["recompute_step_6x_ms"] / result["cached_step_6x_ms"])
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's RNG is left alone


def test_bench_cache_quick_json(rewind_cli):
    code, out, err = rewind_cli("bench", "cache", "--quick", "--json")
    assert code == 0, err
    result = json.loads(out)
    for key in ("cache_write_MBps", "memmap_write_MBps", "cache_read_MBps", "memmap_read_MBps"):
        assert result[key] > 0, key
    for key in ("read_ratio", "write_ratio", "speedup", "speedup_6x"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["recompute_step_ms"] > 0 and result["cached_step_ms"] > 0
    assert result["recompute_step_6x_ms"] > 0 and result["cached_step_6x_ms"] > 0
    assert result["losses_match"] is True
