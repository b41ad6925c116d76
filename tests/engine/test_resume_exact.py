"""The product's promise: kill a run at any moment, resume it, and get the same weights, bit for bit.

A run is trained straight through in one process; the same run is trained again in processes that
are SIGKILLed at random moments (mid-step, mid-commit, mid-checkpoint) and resumed each time. The final
weights and the effective StepCommitted stream must be bitwise identical.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from safetensors.torch import load_file

from rewind.states.events import RunResumed, StepCommitted
from rewind.states.fold import fold
from rewind.states.history import effective
from rewind.stores.checkpoints import CheckpointStore
from rewind.stores.runs import LogNotFoundError, read_records
from tests.conftest import EXAMPLES

TINY = EXAMPLES / "tiny.toml"
# Small enough to run the whole kill-and-resume dance in well under a minute on 2 cores.
OVERRIDES = ["--set", "logging.checkpoint_interval=10"]


def _command(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "rewind.tools.cli", "train", str(TINY), "--run-dir", str(run_dir), "--no-progress", *OVERRIDES]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = "0"
    return env


def _num_records(run_dir: Path) -> int:
    try:
        return sum(1 for _ in read_records(str(run_dir)))
    except (LogNotFoundError, OSError):
        return 0


def _checkpoint_in_flight(run_dir: Path) -> bool:
    folder = run_dir / "checkpoints"
    return folder.exists() and any(p.name.startswith(".tmp") for p in folder.iterdir())


def _final_weights(run_dir: Path) -> dict:
    out = run_dir / "final.safetensors"
    subprocess.run(
        [sys.executable, "-m", "rewind.tools.cli", "export", str(run_dir), "--to", str(out)],
        check=True,
        capture_output=True,
        env=_env(),
    )
    return load_file(out)


def _effective_steps(run_dir: Path) -> list[bytes]:
    records = effective([(r.seq, r.event) for r in read_records(str(run_dir))])
    # msgpack bytes compare floats bit for bit (NaN included), unlike ==.
    return [msgspec.msgpack.encode(e) for _, e in records if isinstance(e, StepCommitted)]


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_gives_identical_weights(tmp_path):
    straight = tmp_path / "straight"
    done = subprocess.run(_command(straight), capture_output=True, text=True, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr

    killed = tmp_path / "killed"
    rng = random.Random(20261121)
    num_kills = 0
    progress = 0
    while num_kills < 5:
        process = subprocess.Popen(_command(killed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
        target = progress + rng.randint(10, 40)  # records, i.e. a few steps further than last time
        hunt_checkpoint = num_kills % 2 == 1
        deadline = time.monotonic() + 120
        while process.poll() is None and time.monotonic() < deadline:
            if hunt_checkpoint and _num_records(killed) >= target and _checkpoint_in_flight(killed):
                break  # kill while a checkpoint is being written
            if not hunt_checkpoint and _num_records(killed) >= target:
                time.sleep(rng.uniform(0.0, 0.03))  # land anywhere inside a step or a commit
                break
            time.sleep(0.002)
        if process.poll() is not None:
            break  # it finished before we could kill it: nothing left to interrupt
        process.send_signal(signal.SIGKILL)
        process.wait()
        num_kills += 1
        progress = _num_records(killed)

    finish = subprocess.run(_command(killed), capture_output=True, text=True, env=_env(), timeout=300)
    assert finish.returncode == 0, finish.stderr

    records = [r.event for r in read_records(str(killed))]
    assert sum(isinstance(e, RunResumed) for e in records) >= 3, "the run was not actually interrupted"

    want, got = _final_weights(straight), _final_weights(killed)
    assert want.keys() == got.keys()
    for name in want:
        assert want[name].dtype == got[name].dtype
        assert want[name].view(-1).view(dtypes_as_bytes(want[name])).equal(got[name].view(-1).view(dtypes_as_bytes(got[name]))), name
    assert _effective_steps(straight) == _effective_steps(killed)

    # Every resume removed the debris of the process it replaced: no checkpoint directory is unnamed.
    live = fold(records).live_checkpoints
    assert CheckpointStore(str(killed)).orphans(c.checkpoint for c in live) == []
    # And the whole run, crashes and superseded records included, replays bit for bit.
    replayed = subprocess.run(
        [sys.executable, "-m", "rewind.tools.cli", "replay", str(killed), "--no-progress"],
        capture_output=True, text=True, env=_env(), timeout=300,
    )
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert replayed.stdout.strip().endswith("replay: reproducible")


def dtypes_as_bytes(tensor):
    """Compare raw bits (so -0.0 vs 0.0 or NaN payloads would show), not float equality."""
    import torch

    return {4: torch.int32, 2: torch.int16, 8: torch.int64, 1: torch.uint8}[tensor.element_size()]
