"""A run on your own data, killed (SIGKILL) at three moments and resumed by the same command, ends as if
it had never stopped: the same final checkpoint (every file's sha256, and its manifest but for how far
the log reached), the same effective StepCommitted records byte for byte, the same epochs; and no
resume tokenised its documents or trained its tokenizer again.

The run mixes every way user data comes in: a uint16 token file small enough that the run reads it
four times over (epoch boundaries), a text corpus tokenised at the start, and prompt/response pairs
from JSONL, with a byte-level BPE trained at the start. The kills: one during start-up (as
soon as RUN/data/ appears: the tokenizer trained, the documents being tokenised, or just after), and
two at the first and the last step that begins an epoch of the token file and is not a checkpoint's,
so that the resume after each must supersede an EpochStarted and record it again.

Each process is `python -m rewind.tools.cli train` with one torch thread, as a user runs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest

from rewind.states.events import CheckpointCommitted, EpochStarted, RunResumed, RunStarted, StepCommitted
from rewind.states.history import effective
from rewind.stores.runs import read_seq_events
from tests.engine.exactness import KILLED
from tests.engine.exactness_checks import committed, superseded_seqs, trained_beside
from tests.engine.test_loop import effective_steps
from tests.engine.test_userdata import prepared_in

CHECKPOINT_INTERVAL = 4
NUM_STEPS = 40  # 2 stages x 1280 tokens / (4 rows x 16 tokens)
NUM_WINDOWS = 20  # of the token file, 17 tokens each: 18 train rows, about 2 a step: an epoch every ~9 steps
KILL_TIMEOUT_S = 120.0
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "from", "home", "and",
         "back", "river", "stone"]

CONFIG = f"""
[run]
seed = 5
[architecture]
block_size = 16
vocab_size = 320
num_layers = 2
num_heads = 2
d_model = 32
[training]
batch_size = 4
tokens = [1280, 1280]
datasets = [
  [{{ name = "corpus", rate = 0.5 }}, {{ name = "prose", rate = 0.5 }}],
  [{{ name = "pairs", rate = 0.5 }}, {{ name = "corpus", rate = 0.5 }}],
]
validation_steps = 1
[training.fade]
overlap = 0.3
[logging]
report_interval = 1
checkpoint_interval = {CHECKPOINT_INTERVAL}
validation_interval = 7
[data.corpus]
kind = "tokens"
path = "corpus.bin"
validation_fraction = 0.1
[data.prose]
kind = "text"
path = "texts/*.txt"
validation_fraction = 0.1
[data.pairs]
kind = "jsonl"
path = "pairs.jsonl"
prompt_field = "prompt"
response_field = "response"
validation_fraction = 0.1
[tokenizer]
train_vocab_size = 300
"""


def write_inputs(folder: Path) -> Path:
    """The token file, the text corpus, the pairs and the config; returns the config's path."""
    rng = np.random.default_rng(0)
    rng.integers(0, 256, size=NUM_WINDOWS * 17).astype(np.uint16).tofile(folder / "corpus.bin")
    (folder / "texts").mkdir()
    for i in range(3):
        lines = (" ".join(rng.choice(WORDS, size=20)) + "." for _ in range(10))
        (folder / "texts" / f"{i}.txt").write_text("\n".join(lines), encoding="utf-8")
    pairs = []
    for _ in range(30):
        words = list(rng.choice(WORDS, size=4))
        pairs.append({"prompt": f"reverse: {' '.join(words)} =", "response": " ".join(words[::-1])})
    (folder / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs), encoding="utf-8")
    (folder / "run.toml").write_text(CONFIG, encoding="utf-8")
    return folder / "run.toml"


def train_command(run: str) -> list[str]:
    return [sys.executable, "-m", "rewind.tools.cli", "train", "run.toml", "--run-dir", run, "--no-progress"]


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")


def train(folder: Path, run: str) -> None:
    done = subprocess.run(train_command(run), cwd=folder, capture_output=True, text=True, env=env(), timeout=300)
    assert done.returncode == 0, done.stderr


def train_until_killed(folder: Path, run: str, due: Callable[[list], bool]) -> list:
    """Start the command, SIGKILL it once `due(records it appended)` holds; the records it appended."""
    before = len(committed(folder / run))
    process = subprocess.Popen(train_command(run), cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=env())
    try:
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            if due(committed(folder / run)[before:]):
                break
            time.sleep(0.002)
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
        code = process.wait()
        assert code == KILLED, f"exit code {code} before the kill: {process.stderr.read().decode()[-1500:]}"
        return committed(folder / run)[before:]
    finally:
        process.stderr.close()


def reached(records: list, step: int) -> bool:
    return any(isinstance(e, StepCommitted) and e.step >= step for _, e in records)


def effective_of(run: Path, kind: type) -> list[bytes]:
    return [msgspec.msgpack.encode(e) for _, e in effective(read_seq_events(run)) if isinstance(e, kind)]


def final_checkpoint(run: Path) -> tuple[CheckpointCommitted, dict]:
    """The run's final checkpoint and its manifest. How far the log reached when it was written (one
    record further for every resume) is beside the manifest, not in it (rewind.stores.manifest): the
    same state has the same manifest, hash and name, straight or resumed."""
    finals = [e for _, e in effective(read_seq_events(run))
              if isinstance(e, CheckpointCommitted) and e.reason == "final"]
    assert len(finals) == 1, finals
    manifest = json.loads((run / "checkpoints" / finals[0].checkpoint / "manifest.json").read_text())
    assert "log_seq" not in manifest["meta"]
    return finals[0], manifest


def stamps(run: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of the run's tokenizer and of every file of its tokenised documents."""
    data = run / "data"
    files = [data / "tokenizer.json", *sorted(prepared_in(data, "prose").iterdir())]
    return {str(p.relative_to(data)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}


@pytest.mark.slow
def test_a_run_on_token_text_and_pair_data_killed_three_times_resumes_bitwise(tmp_path):
    write_inputs(tmp_path)
    # The straight run trains beside the start-up kill (one thread each: two cores do both at once); the
    # other two kills need its epochs.
    with trained_beside(train_command("straight"), cwd=tmp_path, env=env()):
        killed = tmp_path / "killed"
        appended = [train_until_killed(tmp_path, "killed", lambda _: (killed / "data").is_dir())]
    straight = tmp_path / "straight"
    epochs = [e for e in (msgspec.msgpack.decode(b, type=EpochStarted) for b in effective_of(straight, EpochStarted))
              if e.dataset == "corpus"]
    # Steps that begin an epoch of the token file and are not checkpointed: a kill there leaves the
    # EpochStarted in the range the resume supersedes.
    targets = [e.step + 1 for e in epochs if (e.step + 1) % CHECKPOINT_INTERVAL]
    assert len(epochs) >= 2 and len(targets) >= 2, epochs

    prepared_by: dict[str, tuple[int, int]] = {}
    if any(isinstance(e, RunStarted) for _, e in appended[0]):
        prepared_by = stamps(killed)  # the start got as far as its first record: the data is ready
    for step in (targets[0], targets[-1]):
        appended.append(train_until_killed(tmp_path, "killed", lambda records, step=step: reached(records, step)))
        assert reached(appended[-1], step), f"killed by the timeout before step {step}"
        prepared_by = prepared_by or stamps(killed)
    train(tmp_path, "killed")

    records = read_seq_events(killed)
    resumes = [e for _, e in records if isinstance(e, RunResumed)]
    assert len(resumes) >= 2, resumes  # the first kill may land before the run's first record
    gone = superseded_seqs(records)
    assert any(isinstance(e, EpochStarted) for seq, e in records if seq in gone), "no kill left an epoch to redo"
    (want, want_manifest), (got, got_manifest) = final_checkpoint(straight), final_checkpoint(killed)
    assert got.step == want.step == NUM_STEPS and got.files == want.files  # each file's sha256: the same bytes
    assert got_manifest == want_manifest
    assert (got.checkpoint, got.manifest_sha256) == (want.checkpoint, want.manifest_sha256)
    assert effective_steps(killed) == effective_steps(straight)
    assert len(effective_steps(straight)) == NUM_STEPS
    assert effective_of(killed, EpochStarted) == effective_of(straight, EpochStarted)
    assert stamps(killed) == prepared_by  # no resume tokenised the documents or trained the tokenizer again
