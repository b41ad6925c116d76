"""Kill a training process at a random moment and start the same command at once, before the killed
one is reaped (it is still a zombie): the restart is never refused, and the run ends with the tensors
(weights and optimizer moments) of a run that never stopped. (Before the kernel lock, `kill(pid, 0)` on
the zombie said "alive".)

Six rounds (REWIND_KILL_ROUNDS, docs/developing.md: 50 for a soak); each next start meets the zombie the last one
left. The first kill comes 0.1-0.5 s after its start, during start-up (torch's import alone takes
longer): before the process's first record, which is checked. The second comes a random moment (up to
0.3 s) after its process commits a step, mid-run (mid-step, mid-commit, mid-checkpoint): the log is
polled for it, so a slow machine delays the kill but cannot move it into start-up, and the record after
that process's is a RunResumed (checked). The others come 1-2.5 s after their start, at start-up or
mid-run (torch's import takes ~1.5 s here). More rounds repeat the same two cases."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from rewind.states.events import RunResumed, StepCommitted
from rewind.states.fold import fold
from rewind.stores.runs import read_seq_events
from tests.engine.exactness_checks import committed, trained_beside
from tests.engine.test_growth import final_tensors
from tests.engine.test_loop import OVERRIDES, TINY, assert_bitwise_equal

ROUNDS = int(os.environ.get("REWIND_KILL_ROUNDS", "6"))


def _command(run_dir) -> list[str]:
    # 240 steps of the tiny model (~5 s of training here): long enough that every round kills it.
    longer = (*OVERRIDES, "training.tokens=[30720,15360,15360]", "logging.report_interval=2")
    sets = [part for override in longer for part in ("--set", override)]
    return [sys.executable, "-m", "rewind.tools.cli", "train", str(TINY), "--run-dir", str(run_dir), "--no-progress", *sets]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")


def _checkpoint_names(run_dir) -> list[str]:
    return [c.checkpoint for c in fold(e for _, e in read_seq_events(run_dir)).live_checkpoints]


@pytest.mark.slow
def test_kill_and_restart_at_once_is_never_refused_and_ends_bitwise_equal(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # The straight run trains beside the killed one (one thread each: two cores do both at once).
    rng = random.Random(20261123)
    zombies = []
    # What each process left: the number of records in the log before it started and when it was killed,
    # and whether it had committed a step of its own.
    spans: list[tuple[int, int, bool]] = []
    try:
        with trained_beside(_command(straight), env=_env()):
            for round_ in range(ROUNDS):
                before = len(committed(killed))
                process = subprocess.Popen(_command(killed), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
                if round_ == 1:  # mid-run: a moment after it commits a step of its own
                    deadline = time.monotonic() + 120
                    while process.poll() is None and time.monotonic() < deadline:
                        if any(isinstance(e, StepCommitted) for _, e in committed(killed)[before:]):
                            break
                        time.sleep(0.01)
                    time.sleep(rng.uniform(0.0, 0.3))
                else:  # at start-up (the first), at start-up or mid-run (the others)
                    time.sleep(rng.uniform(0.1, 0.5) if round_ == 0 else rng.uniform(1.0, 2.5))
                if process.poll() is not None:  # finished before the kill
                    assert process.returncode == 0, process.stderr.read()
                    process.stderr.close()
                    break
                os.kill(process.pid, signal.SIGKILL)
                zombies.append(process)  # not reaped: the next start meets a zombie holder
                os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)  # dead, still not reaped
                records = committed(killed)
                stepped = any(isinstance(e, StepCommitted) for _, e in records[before:])
                spans.append((before, len(records), stepped))
            assert len(zombies) >= ROUNDS // 2  # the kills happened (the run did not just finish first)
            # The first kill landed before its process wrote anything, the second after it committed a step.
            assert spans[0][0] == spans[0][1] and spans[1][2], spans
            final = subprocess.run(_command(killed), capture_output=True, text=True, env=_env(), timeout=300)
            assert final.returncode == 0, final.stderr
            assert "locked" not in final.stderr
    finally:  # the killed processes, reaped at last
        for process in zombies:
            process.wait()
            process.stderr.close()
    # The last checkpoint's every tensor, read here (two `rewind export` processes cost a torch import each).
    assert_bitwise_equal(final_tensors(straight), final_tensors(killed))
    assert _checkpoint_names(killed) == _checkpoint_names(straight)  # the same state, the same names
    # After the mid-run kill, the next record (the first of a process that got that far) resumes the run.
    assert isinstance(read_seq_events(killed)[spans[1][1]][1], RunResumed)
