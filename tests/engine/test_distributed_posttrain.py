"""Post-training stages under torchrun (gloo, two CPU processes): a dpo stage's ranks train their share of
the pairs, a grpo stage's ranks sample the same batch (rank 0 keeps it) and train their share of the
completions, the step's figures summed over the ranks; each run matches the one-process run within the
documented tolerance (docs/distributed.md), metrics included."""

from __future__ import annotations

import pytest

from rewind.states.events import RunStarted, StepCommitted
from rewind.states.history import effective
from rewind.stores.runs import read_records
from tests.engine.test_distributed import _run, _worst_relative
from tests.engine.test_dpo import DPO_TEXT

pytestmark = pytest.mark.distributed
LOSS_RTOL = 1e-4


def _train(config, run_dir, num_processes: int) -> list[str]:
    import sys

    rewind = ["-m", "rewind.tools.cli", "train", str(config), "--run-dir", str(run_dir), "--no-progress",
              "--set", "logging.report_interval=5"]
    if num_processes == 1:
        return [sys.executable, *rewind]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *rewind]


def _dpo_steps(run_dir) -> dict[int, StepCommitted]:
    records = effective([(r.seq, r.event) for r in read_records(str(run_dir))])
    return {e.step: e for _, e in records if isinstance(e, StepCommitted) and e.stage == 2}


@pytest.mark.slow
def test_a_dpo_stage_trains_sharded_as_in_one_process_within_tolerance(tmp_path):
    config = tmp_path / "dpo.toml"
    short = DPO_TEXT.replace("tokens = 25_600", "tokens = 5_120").replace("tokens = 12_800", "tokens = 2_560")
    config.write_text(short + "\n")
    one, two = tmp_path / "one", tmp_path / "two"
    for run_dir, processes in ((one, 1), (two, 2)):
        done = _run(_train(config, run_dir, processes), tmp_path)
        assert done.returncode == 0, done.stderr
    started = next(r.event for r in read_records(str(two)) if isinstance(r.event, RunStarted))
    assert started.world_size == 2
    a, b = _dpo_steps(one), _dpo_steps(two)
    assert a.keys() == b.keys() and len(a) == 10
    assert _worst_relative({k: e.loss for k, e in a.items()}, {k: e.loss for k, e in b.items()}) < LOSS_RTOL
    for name in ("accuracy", "chosen_logps", "rejected_logps"):
        assert _worst_relative({k: e.metrics[name] or 1.0 for k, e in a.items()},
                               {k: e.metrics[name] or 1.0 for k, e in b.items()}) < 1e-3, name


@pytest.mark.slow
def test_a_grpo_stage_trains_sharded_as_in_one_process_within_tolerance(tmp_path):
    config = tmp_path / "grpo.toml"
    grpo = DPO_TEXT.replace('strategy = "dpo"', 'strategy = "grpo"').replace(
        "refresh_reference = true\ndpo = { beta = 0.1, sft_weight = 0.1 }",
        "refresh_reference = true\ngrpo = { group_size = 4, max_new_tokens = 8, num_iterations = 2, kl_beta = 0.05 }",
    )
    config.write_text(grpo.replace("tokens = 25_600", "tokens = 5_120").replace("tokens = 12_800", "tokens = 2_560") + "\n")
    one, two = tmp_path / "one", tmp_path / "two"
    for run_dir, processes in ((one, 1), (two, 2)):
        done = _run(_train(config, run_dir, processes), tmp_path)
        assert done.returncode == 0, done.stderr
    a, b = _dpo_steps(one), _dpo_steps(two)  # (stage 2's steps: here grpo's)
    assert a.keys() == b.keys() and len(a) == 10
    assert _worst_relative({k: e.metrics["reward"] + 1 for k, e in a.items()},
                           {k: e.metrics["reward"] + 1 for k, e in b.items()}) < 1e-6  # the same rewards
    assert _worst_relative({k: e.kl + 1 for k, e in a.items()}, {k: e.kl + 1 for k, e in b.items()}) < LOSS_RTOL
    kept = sorted(p.name for p in (two / "rollouts").iterdir())
    assert len(kept) == 5  # one file a window, written once (by rank 0)
