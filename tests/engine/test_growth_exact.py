"""SIGKILL at random moments across every kind of growth, each restart at once: the run ends with the
tensors of the run that never stopped, bit for bit (base weights, frozen stacks, adapters, moments).

The run is tests/engine/test_growth.py's GROWN (progressive.toml shrunk): an append on a frozen trunk
with copied blocks and an activation cache, an identity prepend on a LoRA trunk, an NF4 stack with its
own adapters on a QLoRA trunk, dropout, two micro-batches a step, at 16 steps a stage. One kill lands in
each stage (ROUNDS equal bands of the run: a band is a stage), a random moment after a step drawn in the
band's first half: in stage 0 before any growth, in stage 2 on the LoRA trunk, in stage 3 on the NF4 stack,
each mid-step, mid-commit or mid-checkpoint, possibly between the growth and the checkpoint after it. Stage
1's kill comes as soon as its process writes a chunk of the frozen trunk's activation cache: mid-write (the
next process writes the missing chunks) or just after it, between the growth and the checkpoint after it.
(Eight kills at random steps over 160 steps added no transition these four do not pass through.) The processes
run outside the checkout (cwd = a temporary directory), as an installed rewind does: the checkout's
top-level `kernels/` must not shadow the package bitsandbytes imports under that name.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from rewind.states.events import ActivationsCached, RunResumed, StackAppended, StepCommitted
from tests.engine.exactness_checks import committed
from tests.engine.test_growth import final_tensors, grown_args
from tests.engine.test_loop import assert_bitwise_equal, events_of

STEPS_PER_STAGE = 16  # 4096 tokens of 8 x 32: four checkpoints (every 4 steps) a stage
NUM_STEPS = 4 * STEPS_PER_STAGE
ROUNDS = int(os.environ.get("REWIND_GROWTH_KILL_ROUNDS", "4"))


def _command(run_dir) -> list[str]:
    # Longer than GROWN's 10 steps a stage, so that a kill in a stage's first half, a moment after its
    # drawn step is committed (start-up is ~3 s with peft), still lands in that stage.
    tokens = STEPS_PER_STAGE * 8 * 32
    longer = ["--set", f"training.tokens=[{tokens},{tokens},{tokens},{tokens}]"]
    return [sys.executable, "-m", "rewind.tools.cli", *grown_args(run_dir), *longer]


def _last_step(run_dir) -> int:
    return max((e.step for _, e in committed(run_dir) if isinstance(e, StepCommitted)), default=-1)


def _cached_chunks(run_dir) -> int:
    """Chunks of the activation cache written so far (each gets a done marker after its data)."""
    return sum(1 for _ in (run_dir / "cache").glob("*/done/*.json"))


def _run(command, cwd, **kwargs):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    return subprocess.Popen(command, cwd=cwd, env=env, **kwargs)


@pytest.mark.slow
def test_sigkill_across_growth_then_resume_gives_the_straight_tensors(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # The straight run trains beside the killed one (one thread each: two cores do both at once).
    done = _run(_command(straight), tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        rng = random.Random(20261124)
        num_killed = 0
        # One kill in each of ROUNDS equal bands of the run's steps, wherever the machine's load puts
        # the time: the log is polled until a step drawn in the band's first half is committed, then the
        # kill comes a random fraction of a second later (mid-step, mid-commit, mid-checkpoint, mid-cache).
        for band in range(ROUNDS):
            first = band * NUM_STEPS // ROUNDS
            target = rng.randrange(first, first + max(1, NUM_STEPS // ROUNDS // 2))
            num_before, cached_before = len(committed(killed)), _cached_chunks(killed)
            writes_cache = first <= STEPS_PER_STAGE < first + NUM_STEPS // ROUNDS  # the band of the first growth
            if writes_cache:  # due at the cache's first chunk; the band's middle only if it was written already
                target = first + max(1, NUM_STEPS // ROUNDS // 2)
            process = _run(_command(killed), tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            # Past its own first record (its RunStarted or RunResumed: start-up kills are test_kill_restart's),
            # and past the band's step, or (the cache's band) as soon as it writes into the cache.
            while process.poll() is None and (len(committed(killed)) <= num_before or _last_step(killed) < target):
                if writes_cache and len(committed(killed)) > num_before and _cached_chunks(killed) > cached_before:
                    break
                time.sleep(0.005 if writes_cache else 0.02)
            time.sleep(rng.uniform(0.0, 0.05 if writes_cache else 0.6))
            if process.poll() is not None:
                assert process.returncode == 0
                break
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            num_killed += 1
        final = _run(_command(killed), tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert final.wait(timeout=600) == 0, final.stderr.read()
        final.stderr.close()
        assert done.wait(timeout=600) == 0, done.stderr.read()
        events = events_of(killed)
        assert num_killed >= ROUNDS - 1 and sum(isinstance(e, RunResumed) for e in events) >= num_killed - 1
        assert sum(isinstance(e, StackAppended) for e in events) >= 3  # every growth happened (some twice)
        assert any(isinstance(e, ActivationsCached) for e in events)
        # Resumed inside at least three of the four stages (a kill in the first steps may come before the
        # first checkpoint, or before the log exists): the kills span the growths, not one region.
        assert len({e.step // STEPS_PER_STAGE for e in events if isinstance(e, RunResumed)}) >= 3
        assert_bitwise_equal(final_tensors(straight), final_tensors(killed))
    finally:
        if done.poll() is None:  # a failure above: the straight run is not left behind
            done.kill()
            done.wait()
        done.stderr.close()
