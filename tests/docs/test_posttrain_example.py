"""examples/posttrain.toml does what its comments say: sft teaches the task, dpo then prefers the right
answer to the corrupted one, and grpo raises the reward of its own samples. The margins are set well
under what the recorded run measured (seed 7, CPU: sort accuracy 0.78 after sft; dpo margin 0.36 and
accuracy 0.86 over its last 10 steps; grpo mean reward 0.20 over the first quarter of its rollout
batches, 0.31 over the last), so they hold across thread counts."""

from __future__ import annotations

import pytest

from rewind.states.events import Evaluated, RolloutsRecorded, StepCommitted
from tests.conftest import EXAMPLES
from tests.engine.test_loop import events_of, run_cli


@pytest.mark.slow
def test_the_post_training_example_learns_in_every_stage(tmp_path):
    run = tmp_path / "run"
    code, out, err = run_cli("train", EXAMPLES / "posttrain.toml", "--run-dir", run, "--no-progress")
    assert code == 0, err
    events = events_of(run)
    boundaries = {e.boundary: e.scores["sort"] for e in events if isinstance(e, Evaluated)}
    assert boundaries[1] > 0.5 and boundaries[1] > boundaries[0] + 0.3  # sft teaches the task
    dpo = [e for e in events if isinstance(e, StepCommitted) and e.stage == 2][-10:]
    assert sum(e.metrics["accuracy"] for e in dpo) / 10 > 0.6 and sum(e.metrics["margin"] for e in dpo) / 10 > 0.1
    rewards = [e.mean_reward for e in events if isinstance(e, RolloutsRecorded)]
    quarter = len(rewards) // 4
    assert sum(rewards[-quarter:]) / quarter > sum(rewards[:quarter]) / quarter + 0.04  # grpo raises it
    assert "run finished: 490 steps" in out
