"""`rewind bench rollout`: both samplers run the same exported model on the same prompts (greedy rows agree),
every figure is there beside its raw seconds, the ratios are what the seconds say, and the CLI prints it."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

pytest.importorskip("transformers")

from rewind.engine.model.model import GPT
from rewind.engine.posttrain.generation import sample_completions
from rewind.tools.bench.rollout import QUICK_ARCHITECTURE, bench_prompts, exported, run_rollout_bench
from tests.engine.test_loop import run_cli


def test_the_export_computes_rewinds_logits_and_greedy_tokens(tmp_path):
    """The baseline is the same model: transformers' logits and greedy `generate` are rewind's."""
    model = GPT(QUICK_ARCHITECTURE, seed=2).eval()
    with torch.no_grad():
        model.head.weight.mul_(20.0)  # peaked logits: no near-ties for rounding to break
    hf = exported(model, tmp_path)
    prompt = bench_prompts(QUICK_ARCHITECTURE.vocab_size, 1, 6, 6)[0]
    with torch.no_grad():
        ours, theirs = model(torch.tensor([prompt])), hf(torch.tensor([prompt])).logits
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    (completion,) = sample_completions(
        model, [prompt], samples_per_prompt=1, max_new_tokens=12, temperature=0.0, seed=0, stage=0, step=0
    )
    assert generated[0, len(prompt) :].tolist() == completion.tokens


def test_the_quick_bench_reports_ratios_beside_raw_figures():
    result = run_rollout_bench(quick=True)
    json.dumps(result)  # what --json prints
    repeats, rows, new = result["repeats"], result["num_rows"], result["max_new_tokens"]
    assert rows == result["num_prompts"] * result["samples_per_prompt"] and repeats >= 2
    every = []
    for mode in ("greedy", "sampled"):
        ours, theirs = result[f"{mode}_rewind_s"], result[f"{mode}_transformers_s"]
        assert len(ours) == len(theirs) == repeats and min(ours) > 0 and min(theirs) > 0
        ratios = result[f"{mode}_ratios"]
        assert ratios == pytest.approx([t / o for o, t in zip(ours, theirs, strict=True)])
        assert result[f"{mode}_ratio_range"] == [min(ratios), max(ratios)]
        assert result[f"{mode}_rewind_tokens_per_second"] == pytest.approx(rows * new / min(ours))
        assert result[f"{mode}_transformers_tokens_per_second"] == pytest.approx(rows * new / min(theirs))
        every += ratios
    assert result["speed_ratio"] == pytest.approx(statistics.median(every))
    assert result["speed_ratio_range"] == [min(every), max(every)] and result["speed_ratio_goal"] == 1.0
    assert result["greedy_rows_equal"] == rows  # the same model on both sides
    shares = [s / (s + t) for s, t in zip(result["grpo_sampling_s"], result["grpo_train_s"], strict=True)]
    assert result["sampling_share"] == pytest.approx(statistics.median(shares))
    assert 0 < result["sampling_share_range"][0] <= result["sampling_share_range"][1] < 1


def test_the_cli_runs_it_and_refuses_gpu_options():
    code, out, err = run_cli("bench", "rollout", "--quick", "--json")
    assert code == 0, err
    assert json.loads(out)["baseline"].startswith("transformers generate")
    code, _, err = run_cli("bench", "rollout", "--out", "x")
    assert code == 2 and "options of bench gpu, not of bench rollout" in err
