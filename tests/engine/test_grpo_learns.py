"""A grpo stage raises the reward: a small model warm-started by an sft stage on `sort` to a held-out greedy
pass@1 of about 0.5 (pass@4 > 0), then 300 grpo steps (group of 4, 8 prompts a step, exact-match reward,
temperature 1, the lr re-warmed to 3e-4 for the stage), samples better completions: the rollout batches'
mean reward (the RolloutsRecorded records) and the mean reward of sampled completions of held-out prompts
both rise.

Recorded run (seed 7, CPU, this config): rollout mean reward 0.198 over the first quarter of the stage's
batches, 0.269 over the last; held-out mean reward (128 prompts x 4 samples at T = 1) 0.158 -> 0.254.
The margins are about half those rises. Greedy pass@1 did not rise in any config tried within this
budget (0.47 -> 0.45 here; 256 prompts: 0.50 -> 0.46): the stage sharpens the sampling distribution
towards answers the greedy decoder already gives, so greedy accuracy is not asserted."""

from __future__ import annotations

import pytest

from rewind.engine import posttrain_eval as pe
from rewind.states.events import RolloutsRecorded
from rewind.tools.sample_cmd import model_at
from tests.engine.test_loop import events_of, run_cli

CONFIG = """
[run]
name = "grpo-learns"
seed = 7

[architecture]
block_size = 32
vocab_size = 256
num_layers = 2
num_heads = 4
d_model = 64

[training]
batch_size = 32

[optimization]
lr = 3e-3
schedule = "cosine_rewarm"   # each stage after the first re-warms to rewarm_lr
rewarm_lr = 3e-4             # RL needs a smaller step: at 1e-3 the policy collapsed to reward 0
warmup_pct = 0.0

[logging]
report_interval = 50

[[stages]]
strategy = "sft"
tokens = 204_800             # 200 steps
datasets = [{ name = "sort", rate = 1.0 }]

[[stages]]
strategy = "grpo"
tokens = 307_200             # 300 steps
datasets = [{ name = "sort", rate = 1.0 }]
grpo = { group_size = 4, max_new_tokens = 10, num_iterations = 1 }
"""
WARM_STEP = 200  # the sft stage's end: a stage boundary commits a checkpoint
NEW = 10
ROLLOUT_RISE = 0.035  # recorded: 0.198 -> 0.269 (first vs last quarter of the rollout batches)
HELD_OUT_RISE = 0.05  # recorded: 0.158 -> 0.254


def _quarters(values: list[float]) -> tuple[float, float]:
    width = len(values) // 4
    return sum(values[:width]) / width, sum(values[-width:]) / width


@pytest.mark.slow
def test_a_grpo_stage_raises_the_mean_reward_of_a_warm_started_model(tmp_path):
    config, run = tmp_path / "grpo.toml", tmp_path / "run"
    config.write_text(CONFIG)
    code, _, err = run_cli("train", config, "--run-dir", run, "--no-progress")
    assert code == 0, err
    rows = pe.held_out_rows("sort", 128)
    warm, trained = model_at(str(run), WARM_STEP).model, model_at(str(run), None).model
    # the warm start the issue asks for: partly right, and some right answer among G samples
    assert 0.2 <= pe.pass_at_1(warm, rows, max_new_tokens=NEW) <= 0.6
    assert pe.pass_at_k(warm, rows, k=4, temperature=1.0, seed=0, max_new_tokens=NEW) > 0

    rewards = [e.mean_reward for e in events_of(run) if isinstance(e, RolloutsRecorded)]
    assert len(rewards) == 300
    early, late = _quarters(rewards)
    assert late >= early + ROLLOUT_RISE, (early, late)

    before, after = (
        pe.mean_reward(model, rows, samples=4, temperature=1.0, seed=0, max_new_tokens=NEW)
        for model in (warm, trained)
    )
    assert after >= before + HELD_OUT_RISE, (before, after)
