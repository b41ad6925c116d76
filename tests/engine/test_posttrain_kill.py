"""A run through every strategy (pretrain -> sft -> packed sft -> dpo -> grpo, fading between the first
three, with dropout and two micro-batches a step; grpo with two updates per rollout batch and a KL term)
SIGKILLed at a random moment inside each stage and restarted at once ends on the tensors and the
effective StepCommitted and RolloutsRecorded streams (metrics, rollout files by hash) of the run that
never stopped: a kill inside a rollout window resumes without sampling differently.

Each stage is 12 steps (one or two checkpoints, every 7 steps, land in each), and its kill comes a moment
after a step drawn in its steps 2-7, at once if its ninth step is committed first (the log shows steps
three at a time, or at a checkpoint: a fast machine does not push the kill into the next stage):
pretraining, sft, packed sft (in their fades), dpo against a refreshed reference, grpo inside a two-step
rollout window. The last step committed at each kill is checked to lie in its stage. (25-step stages
added no transition.)"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import msgspec
import pytest

from rewind.states.events import RolloutsRecorded, StepCommitted
from rewind.states.history import effective
from rewind.stores.runs import read_seq_events
from tests.conftest import EXAMPLES
from tests.engine.exactness_checks import committed, trained_beside
from tests.engine.test_growth import final_tensors
from tests.engine.test_loop import assert_bitwise_equal

TINY = (EXAMPLES / "tiny.toml").read_text()
STAGES = """
[[stages]]
tokens = 6_144
datasets = [{ name = "grammar", rate = 1.0 }]

[[stages]]
strategy = "sft"
tokens = 6_144
datasets = [{ name = "reverse", rate = 1.0 }]

[[stages]]
strategy = "sft"
tokens = 6_144
datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]
sft = { packing = true }
overlap = 0.0

[[stages]]
strategy = "dpo"
tokens = 6_144
datasets = [{ name = "reverse", rate = 0.5 }, { name = "sort", rate = 0.5 }]
refresh_reference = true
dpo = { beta = 0.1, sft_weight = 0.1 }
overlap = 0.0

[[stages]]
strategy = "grpo"
tokens = 6_144
datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]
refresh_reference = true
grpo = { group_size = 4, max_new_tokens = 12, num_iterations = 2, kl_beta = 0.05 }
"""
CONFIG = TINY[: TINY.index("[[stages]]")].replace("block_size = 32", "block_size = 64") + STAGES
SETS = ("architecture.dropout=0.1", "training.per_device_batch_size=4", "logging.report_interval=3",
        "logging.checkpoint_interval=7")
STEPS_PER_STAGE = 12  # 6144 tokens of 8 rows x 64


def _command(config_path, run_dir) -> list[str]:
    return [sys.executable, "-m", "rewind.tools.cli", "train", str(config_path), "--run-dir", str(run_dir),
            "--no-progress", *[part for s in SETS for part in ("--set", s)]]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")


def _last_step(run_dir) -> int:
    return max((e.step for _, e in committed(run_dir) if isinstance(e, StepCommitted)), default=-1)


def _records(run_dir) -> list[StepCommitted | RolloutsRecorded]:
    kept = (StepCommitted, RolloutsRecorded)
    return [e for _, e in effective(read_seq_events(run_dir)) if isinstance(e, kept)]


@pytest.mark.slow
def test_a_run_through_every_strategy_killed_at_random_moments_ends_as_the_straight_run(tmp_path):
    config_path = tmp_path / "posttrain.toml"
    config_path.write_text(CONFIG)
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # The straight run trains beside the killed one (one thread each: two cores do both at once).
    rng = random.Random(20261127)
    # One kill in each stage, at a step reached by polling the log (a loaded machine delays a kill but
    # does not move it to another stage), then a moment later (mid-step or mid-commit), or at once when
    # the stage's ninth step is committed first.
    targets = [rng.randrange(STEPS_PER_STAGE * stage + 2, STEPS_PER_STAGE * stage + 8) for stage in range(5)]
    killed_at = []  # the last step committed when each kill landed
    with trained_beside(_command(config_path, straight), env=_env()):
        for stage, target in enumerate(targets):
            process = subprocess.Popen(_command(config_path, killed), stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True, env=_env())
            due, cap = None, STEPS_PER_STAGE * stage + 9
            deadline = time.monotonic() + 120
            while process.poll() is None and time.monotonic() < deadline:
                last = _last_step(killed)
                if due is None and last >= target:
                    due = time.monotonic() + rng.uniform(0.0, 0.3)
                if last >= cap or (due is not None and time.monotonic() >= due):
                    break
                time.sleep(0.01)
            if process.poll() is not None:  # finished before the kill
                assert process.returncode == 0, process.stderr.read()
                process.stderr.close()
                break
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            process.stderr.close()
            killed_at.append(_last_step(killed))
        final = subprocess.run(_command(config_path, killed), capture_output=True, text=True, env=_env(), timeout=300)
        assert final.returncode == 0, final.stderr
    # Every kill happened (the run did not finish first), each inside its own stage (step s is the
    # stage's (s - 1) // 12: one committed at the stage's last step has left it).
    assert [(s - 1) // STEPS_PER_STAGE for s in killed_at] == [0, 1, 2, 3, 4], killed_at
    want, got = _records(straight), _records(killed)
    assert {e.stage for e in got if isinstance(e, StepCommitted)} == {0, 1, 2, 3, 4}
    assert all(e.metrics for e in got if isinstance(e, StepCommitted) and e.stage >= 3)
    assert not any(e.metrics for e in got if isinstance(e, StepCommitted) and e.stage < 3)
    # rollouts on record: sampled once a window (every 2 steps), the same files by name and content
    grpo = range(4 * STEPS_PER_STAGE, 5 * STEPS_PER_STAGE)
    assert [e.step for e in got if isinstance(e, RolloutsRecorded)] == list(grpo[::2])
    assert [msgspec.msgpack.encode(e) for e in got] == [msgspec.msgpack.encode(e) for e in want]
    # The last checkpoint's every tensor (weights and moments), read here rather than by two `rewind export`s.
    assert_bitwise_equal(final_tensors(straight), final_tensors(killed))
