"""SIGKILL at random moments across every kind of growth, each restart at once: the run ends with the
tensors of the run that never stopped, bit for bit (base weights, frozen stacks, adapters, moments).

The run is tests/engine/test_growth.py's GROWN (progressive.toml shrunk): an append on a frozen trunk
with copied blocks and an activation cache, an identity prepend on a LoRA trunk, an NF4 stack with its
own adapters on a QLoRA trunk, dropout, two micro-batches a step, at 16 steps a stage. Five kills, each
checked to have landed where it was due (from the log, and the cache's files):
- stage 0, before any growth; stage 2, its growth to the LoRA trunk and after; stage 3, the NF4 stack's:
  a random moment (up to 0.6 s) after a step drawn in the stage's first half (counting its start, the
  previous stage's last step), at the latest once its 8th step is committed (stage 0's 16 steps take
  about 0.3 s here): mid-step, mid-commit or mid-checkpoint, or (drawn at the start) around the growth;
- stage 1, as soon as its process has written a chunk of the frozen trunk's activation cache (16 chunks,
  about 0.1 s of writing here): mid-write, before the cache is complete (its completion records come
  with the manifest), so the next process finds no chunk vouched for and writes them again;
- stage 1 again, after a step drawn in its second half (past the checkpoint at step 24), at the latest
  once its 12th step is committed: the resume (from step 24 or 28) reads the finished cache mid-stage.
(Eight kills at random steps over 160 steps added no transition these pass through.) The processes
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
CACHE = "cache"  # where the kill is due when its process writes into the activation cache


def _command(run_dir) -> list[str]:
    # Longer than GROWN's 10 steps a stage, so that a kill in a stage's first half, a moment after its
    # drawn step is committed (start-up is ~3 s with peft), still lands in that stage.
    tokens = STEPS_PER_STAGE * 8 * 32
    longer = ["--set", f"training.tokens=[{tokens},{tokens},{tokens},{tokens}]"]
    return [sys.executable, "-m", "rewind.tools.cli", *grown_args(run_dir), *longer]


def _last_step(run_dir) -> int:
    return max((e.step for _, e in committed(run_dir) if isinstance(e, StepCommitted)), default=-1)


def _cache_files(run_dir, name: str) -> int:
    """Files of the activation cache: chunks (`c.<k>.0.0`, renamed into place whole) or the manifest."""
    return sum(1 for _ in (run_dir / "cache").glob(f"*/{name}"))


def _past(run_dir, num_before: int, step: int) -> bool:
    """Whether a process has appended to the log's first `num_before` records and step `step` is committed."""
    return len(committed(run_dir)) > num_before and _last_step(run_dir) >= step


def _run(command, cwd, **kwargs):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    return subprocess.Popen(command, cwd=cwd, env=env, **kwargs)


def _due(stage: int, rng: random.Random, second_half: bool = False) -> tuple[int, int]:
    """When a stage's kill is due: after a step drawn in its first half, its start included (its second
    half: past the checkpoint at its middle), and at once when its 8th (12th) step is committed. Steps as
    StepCommitted counts them (the first is 1). The log shows steps a group at a time (here four), and
    stage 0's come about 50 a second: a later cap could let the kill land past the stage's end."""
    first = stage * STEPS_PER_STAGE
    if second_half:
        return rng.randrange(first + 9, first + 13), first + 12
    return rng.randrange(first, first + STEPS_PER_STAGE // 2), first + STEPS_PER_STAGE // 2


@pytest.mark.slow
def test_sigkill_across_growth_then_resume_gives_the_straight_tensors(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # The straight run trains beside the killed one (one thread each: two cores do both at once).
    done = _run(_command(straight), tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        rng = random.Random(20261124)
        # (stage, the step after which the kill is due or CACHE, the step at which it comes at once):
        # polled from the log and the cache's files, wherever the machine's load puts the time.
        plan = [(0, *_due(0, rng)), (1, CACHE, None), (1, *_due(1, rng, True))]
        plan += [(stage, *_due(stage, rng)) for stage in (2, 3)]
        for stage, due, cap in plan:
            end = (stage + 1) * STEPS_PER_STAGE  # the stage's last step
            num_before, chunks_before = len(committed(killed)), _cache_files(killed, "c.*.0.0")
            process = _run(_command(killed), tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if due == CACHE:  # as soon as a chunk is on disk, then a moment (the whole cache takes ~0.1 s)
                while process.poll() is None and _cache_files(killed, "c.*.0.0") <= chunks_before:
                    time.sleep(0.002)
                time.sleep(rng.uniform(0.0, 0.02))
            else:
                # Past its own first record (its RunStarted or RunResumed: start-up kills are
                # test_kill_restart's) and the due step, then a random moment, but at once at the cap
                # (a fast machine does not push the kill out of its stage).
                while process.poll() is None and not _past(killed, num_before, due):
                    time.sleep(0.002)
                moment = time.monotonic() + rng.uniform(0.0, 0.6)
                while process.poll() is None and time.monotonic() < moment and _last_step(killed) < cap:
                    time.sleep(0.002)
            assert process.poll() is None, f"the run ended before its kill in stage {stage}"
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            last = _last_step(killed)
            if due == CACHE:  # mid-write: chunks on disk, the cache not complete
                assert last == end - STEPS_PER_STAGE and _cache_files(killed, "c.*.0.0") > 0
                assert _cache_files(killed, "complete.json") == 0
                assert not any(isinstance(e, ActivationsCached) for _, e in committed(killed))
            else:  # inside its stage, and past the due step (in the second half for stage 1's second kill)
                assert due <= last < end, (stage, due, last)
        final = _run(_command(killed), tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert final.wait(timeout=600) == 0, final.stderr.read()
        final.stderr.close()
        assert done.wait(timeout=600) == 0, done.stderr.read()
        events = events_of(killed)
        resumed = [e.step for e in events if isinstance(e, RunResumed)]
        # A kill before the first checkpoint (step 4) may restart the run; every other one resumes it.
        assert len(resumed) >= len(plan) - 1, resumed
        assert sum(isinstance(e, StackAppended) for e in events) >= 3  # every growth happened (some twice)
        cached = next(i for i, e in enumerate(events) if isinstance(e, ActivationsCached))
        # After the mid-write kill, resumed at the growth's checkpoint (step 16) with no cache recorded;
        # after the second-half kill, resumed mid-stage 1 with the finished cache there to read.
        assert STEPS_PER_STAGE in [e.step for e in events[:cached] if isinstance(e, RunResumed)]
        mid_stage = range(STEPS_PER_STAGE * 3 // 2, 2 * STEPS_PER_STAGE)  # the checkpoints at 24 and 28
        assert any(isinstance(e, RunResumed) and e.step in mid_stage for e in events[cached:]), resumed
        # Resumed inside at least three of the four stages (a resume at step 16 holds stage 0's end):
        # the kills span the growths, not one region.
        assert len({(step - 1) // STEPS_PER_STAGE for step in resumed}) >= 3, resumed
        assert_bitwise_equal(final_tensors(straight), final_tensors(killed))
    finally:
        if done.poll() is None:  # a failure above: the straight run is not left behind
            done.kill()
            done.wait()
        done.stderr.close()
