"""Post-training stages under torchrun (gloo, two CPU processes): a dpo stage's ranks train their share of
the pairs, a grpo stage's ranks sample the same batch (rank 0 keeps it) and train their share of the
completions, the step's figures summed over the ranks; each stage matches the one-process run within the
documented tolerance (docs/distributed.md), metrics included.

One run holds both stages (pretrain -> sft -> dpo -> grpo), launched once at one process and once at two:
each launch costs seconds of start-up and the stages before them, so the dpo and the grpo stage share it."""

from __future__ import annotations

import sys

import pytest
import torch

from rewind.states.events import RolloutsRecorded, RunStarted, StepCommitted
from rewind.states.history import effective
from rewind.stores.rollouts import read_rollouts
from rewind.stores.runs import read_records
from tests.engine.test_distributed import _run, _worst_relative
from tests.engine.test_dpo import DPO_TEXT

pytestmark = pytest.mark.distributed
LOSS_RTOL = 1e-4
DPO_STAGE, GRPO_STAGE = 2, 3
# tests.engine.test_dpo's pretrain -> sft -> dpo, shortened (20, 10 and 10 steps), the dpo stage not fading
# out (no fade into or out of a post-training stage), then 10 grpo steps on the same tasks.
BOTH = (
    DPO_TEXT.replace("tokens = 25_600", "tokens = 5_120")
    .replace("tokens = 12_800", "tokens = 2_560")
    .replace(
        "dpo = { beta = 0.1, sft_weight = 0.1 }", "dpo = { beta = 0.1, sft_weight = 0.1 }\noverlap = 0.0"
    )
    + '\n[[stages]]\ntokens = 2_560\nstrategy = "grpo"\n'
    + 'datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]\nrefresh_reference = true\n'
    + "grpo = { group_size = 4, max_new_tokens = 8, num_iterations = 2, kl_beta = 0.05 }\n"
)


def _train(config, run_dir, num_processes: int) -> list[str]:
    rewind = [
        "-m",
        "rewind.tools.cli",
        "train",
        str(config),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        "--set",
        "logging.report_interval=5",
    ]
    if num_processes == 1:
        return [sys.executable, *rewind]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *rewind]


def _records(run_dir):
    return effective([(r.seq, r.event) for r in read_records(str(run_dir))])


def _stage_steps(run_dir, stage: int) -> dict[int, StepCommitted]:
    return {e.step: e for _, e in _records(run_dir) if isinstance(e, StepCommitted) and e.stage == stage}


@pytest.mark.slow
def test_a_dpo_stage_and_a_grpo_stage_train_sharded_as_in_one_process_within_tolerance(tmp_path):
    config = tmp_path / "posttrain.toml"
    config.write_text(BOTH)
    one, two = tmp_path / "one", tmp_path / "two"
    for run_dir, processes in ((one, 1), (two, 2)):
        done = _run(_train(config, run_dir, processes), tmp_path)
        assert done.returncode == 0, done.stderr
    started = next(r.event for r in read_records(str(two)) if isinstance(r.event, RunStarted))
    assert started.world_size == 2

    # dpo: the losses and the pairs' figures
    a, b = _stage_steps(one, DPO_STAGE), _stage_steps(two, DPO_STAGE)
    assert a.keys() == b.keys() and len(a) == 10
    assert _worst_relative({k: e.loss for k, e in a.items()}, {k: e.loss for k, e in b.items()}) < LOSS_RTOL
    for name in ("accuracy", "chosen_logps", "rejected_logps"):
        assert (
            _worst_relative(
                {k: e.metrics[name] or 1.0 for k, e in a.items()},
                {k: e.metrics[name] or 1.0 for k, e in b.items()},
            )
            < 1e-3
        ), name

    # grpo: the same samples' rewards, the KL to the (dpo) reference
    a, b = _stage_steps(one, GRPO_STAGE), _stage_steps(two, GRPO_STAGE)
    assert a.keys() == b.keys() and len(a) == 10
    assert (
        _worst_relative(
            {k: e.metrics["reward"] + 1 for k, e in a.items()},
            {k: e.metrics["reward"] + 1 for k, e in b.items()},
        )
        < 1e-6
    )  # the same rewards
    assert (
        _worst_relative({k: e.kl + 1 for k, e in a.items()}, {k: e.kl + 1 for k, e in b.items()}) < LOSS_RTOL
    )
    kept = sorted(p.name for p in (two / "rollouts").iterdir())
    assert len(kept) == 5  # one file a window, written once (by rank 0)
    # The same samples: every draw is keyed (seed, stage, step, prompt, sample, position), so the two
    # processes' collective forwards drew each window's completions token for token as one process did.
    # (The rewards above are all 0 this early: these tokens are what says the samples are the same.)
    batches = [[e for _, e in _records(run) if isinstance(e, RolloutsRecorded)] for run in (one, two)]
    assert [r.step for r in batches[0]] == [r.step for r in batches[1]] and len(batches[0]) == 5
    for x, y in zip(*batches, strict=True):
        tensors = [read_rollouts(str(run), r.path, r.sha256)[0] for run, r in ((one, x), (two, y))]
        for name in ("prompts", "completions", "completion_lengths", "finished"):
            assert torch.equal(tensors[0][name], tensors[1][name]), (x.step, name)
        # each rank computed its share of the old log-probs and the shares were gathered in rank order
        for name in ("old_logprobs", "reference_logprobs"):
            assert torch.allclose(tensors[0][name], tensors[1][name], rtol=1e-4, atol=1e-5), (x.step, name)
