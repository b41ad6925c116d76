"""A token file that changes under a training run stops it with one line naming it, before anything is
recorded that a later process could not honour (rewind.engine.data.tokens, rewind.engine.data.rundata).

- rewritten in place (same size) after the checkpoint of step 4: the run stops before the checkpoint of
  step 8 (exit 1, the dataset named), no checkpoint vouches for the steps that read the new tokens, and
  with the data put back the same command resumes into the straight run's final checkpoint, bit for bit;
- cut short (truncated) while a process trains on it: one line naming the file and exit 1, where reading
  the mapped file past its new end killed the process with SIGBUS (exit 135, no word).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rewind.engine.step import mixed_step
from rewind.states.events import CheckpointCommitted, RunFinished, RunStopped
from tests.engine.test_loop import events_of, run_cli

CONFIG = """
[run]
seed = 3
[architecture]
block_size = 16
vocab_size = 64
num_layers = 1
num_heads = 2
d_model = 16
[training]
batch_size = 4
tokens = [{tokens}]
datasets = [[{{ name = "corpus" }}]]
validation_steps = 1
[logging]
report_interval = 1
checkpoint_interval = 4
validation_interval = 5
[data.corpus]
kind = "tokens"
path = "corpus.bin"
validation_fraction = 0.1
"""
TOKENS_PER_STEP = 4 * 16


def _setup(folder: Path, num_steps: int) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "corpus.bin"
    np.random.default_rng(0).integers(0, 64, size=17 * 60).astype(np.uint16).tofile(data)
    config = folder / "run.toml"
    config.write_text(CONFIG.format(tokens=num_steps * TOKENS_PER_STEP))
    return config, data


def _train(config: Path, run: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli("train", config, "--run-dir", run, "--no-progress", *extra)


def _checkpoints(run: Path) -> list[CheckpointCommitted]:
    return [e for e in events_of(run) if isinstance(e, CheckpointCommitted)]


def test_a_token_file_rewritten_under_a_run_stops_it_before_the_next_checkpoint(tmp_path, monkeypatch):
    config, data = _setup(tmp_path / "data", num_steps=16)
    straight = tmp_path / "straight"
    code, _, err = _train(config, straight)
    assert code == 0, err

    original = data.read_bytes()
    real_train_step = mixed_step.train_step

    def rewrites_the_data_before_step_5(*args, step, **kwargs):
        if step == 5:
            with open(data, "r+b") as handle:  # in place: the same inode and size, other tokens
                handle.write(np.frombuffer(original, dtype=np.uint16)[::-1].tobytes())
        return real_train_step(*args, step=step, **kwargs)

    monkeypatch.setattr(mixed_step, "train_step", rewrites_the_data_before_step_5)
    run = tmp_path / "run"
    code, out, err = _train(config, run)
    assert code == 1, out + err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "dataset 'corpus'" in err and "corpus.bin: changed since the run opened it" in err, err
    assert "without the checkpoint of step 8" in err
    assert [c.step for c in _checkpoints(run)] == [4]  # nothing vouches for steps 5..8
    assert not any(isinstance(e, RunStopped | RunFinished) for e in events_of(run))
    code, out, err = run_cli("verify", run)
    assert code == 0, out + err

    monkeypatch.setattr(mixed_step, "train_step", real_train_step)
    code, _, err = _train(config, run)  # the changed data: refused, nothing written
    assert code == 1 and "changed" in err, err
    data.write_bytes(original)
    code, _, err = _train(config, run)  # the data the run recorded: it resumes from step 4
    assert code == 0, err
    assert _checkpoints(run)[-1].files == _checkpoints(straight)[-1].files


@pytest.mark.slow
def test_a_token_file_cut_short_under_a_training_process_is_one_line_not_a_sigbus(tmp_path):
    config, data = _setup(tmp_path / "data", num_steps=5000)
    run = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "rewind.tools.cli",
        "train",
        str(config),
        "--run-dir",
        str(run),
        "--no-progress",
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    deadline = time.monotonic() + 240
    checkpoints = run / "checkpoints"
    while time.monotonic() < deadline and process.poll() is None:
        if checkpoints.is_dir() and any(p.name[:1].isdigit() for p in checkpoints.iterdir()):
            break
        time.sleep(0.02)
    assert process.poll() is None, process.communicate()[1]  # still training
    data.write_bytes(b"")  # cut to nothing where it stands (O_TRUNC): every mapped page is past the end
    _, err = process.communicate(timeout=240)
    assert process.returncode == 1, (process.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("rewind: ") and str(data) in lines[0], err
    assert "cut to 0 bytes while the run read it" in lines[0] or "changed since the run opened it" in lines[0]
    assert not any(isinstance(e, RunStopped | RunFinished) for e in events_of(run))
    code, out, err = run_cli("verify", run)  # what was recorded is whole: a resume can honour it
    assert code == 0, out + err
