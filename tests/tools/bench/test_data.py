"""`rewind bench data --quick`: runs, compares like with like, and reports every figure (no timing asserted)."""

from __future__ import annotations

import json
import os

from rewind.tools.bench.data import stdlib_files


def test_bench_data_quick(rewind_cli):
    exit_code, out, err = rewind_cli("bench", "data", "--quick", "--json")
    assert exit_code == 0, err
    result = json.loads(out)
    for key in ("read_ratio", "read_engine_s", "read_bare_s", "read_index_s", "prepare_ratio", "prepare_s",
                "encode_batch_s", "prepare_tokens_per_s"):
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["read_file_tokens"] == 4_000_000
    assert result["prepare_documents"] > 10 and result["prepare_tokens"] > 100_000
    assert result["prepare_vocab_size"] == 1024
    # The ratios are the raw times' quotients, baseline over rewind.
    assert abs(result["read_ratio"] - result["read_bare_s"] / result["read_engine_s"]) < 1e-9
    assert abs(result["prepare_ratio"] - result["encode_batch_s"] / result["prepare_s"]) < 1e-9


def test_the_corpus_is_utf8_stdlib_source_within_budget():
    paths = stdlib_files(300_000)
    assert paths and all(p.endswith(".py") for p in paths)
    assert sum(os.path.getsize(p) for p in paths) <= 300_000
