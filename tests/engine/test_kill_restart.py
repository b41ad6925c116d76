"""Kill a training process at a random moment and start the same command at once, before the killed
one is reaped (it is still a zombie): the restart is never refused, and the run ends with the weights
of a run that never stopped. (Before the kernel lock, `kill(pid, 0)` on the zombie said "alive".)"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from rewind.states.fold import fold
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import OVERRIDES, TINY

ROUNDS = int(os.environ.get("REWIND_KILL_ROUNDS", "10"))


def _command(run_dir) -> list[str]:
    # 400 steps of the tiny model (~8 s of training here): long enough that every round kills it.
    longer = (*OVERRIDES, "training.tokens=[51200,25600,25600]", "logging.report_interval=2")
    sets = [part for override in longer for part in ("--set", override)]
    return [sys.executable, "-m", "rewind.tools.cli", "train", str(TINY), "--run-dir", str(run_dir), "--no-progress", *sets]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")


def _final(run_dir) -> dict:
    out = run_dir / "final.safetensors"
    subprocess.run([sys.executable, "-m", "rewind.tools.cli", "export", str(run_dir), "--to", str(out)], check=True,
                   capture_output=True, env=_env())
    return load_file(out)


def _checkpoint_names(run_dir) -> list[str]:
    return [c.checkpoint for c in fold(e for _, e in read_seq_events(run_dir)).live_checkpoints]


@pytest.mark.slow
def test_kill_and_restart_at_once_is_never_refused_and_ends_bitwise_equal(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    # The straight run trains beside the killed one (one thread each: two cores do both at once).
    done = subprocess.Popen(_command(straight), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env())
    rng = random.Random(20261123)
    zombies = []
    try:
        for _ in range(ROUNDS):
            process = subprocess.Popen(_command(killed), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
            time.sleep(rng.uniform(1.0, 2.5))  # torch's import takes ~1.5 s: kills land at start-up and mid-run
            if process.poll() is not None:  # finished before the kill
                assert process.returncode == 0, process.stderr.read()
                process.stderr.close()
                break
            os.kill(process.pid, signal.SIGKILL)
            zombies.append(process)  # not reaped: the next start meets a zombie holder
        assert len(zombies) >= ROUNDS // 2  # the kills happened (the run did not just finish first)
        final = subprocess.run(_command(killed), capture_output=True, text=True, env=_env(), timeout=300)
        assert final.returncode == 0, final.stderr
        assert "locked" not in final.stderr
        assert done.wait(timeout=300) == 0, done.stderr.read()
    finally:
        if done.poll() is None:  # a failure above: the straight run is not left behind
            done.kill()
            done.wait()
        done.stderr.close()
        for process in zombies:
            process.wait()
            process.stderr.close()
    a, b = _final(straight), _final(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _checkpoint_names(killed) == _checkpoint_names(straight)  # the same state, the same names
