"""Runs on real data, end to end through `rewind` (in-process, one torch thread; one subprocess check).

- token files: the data on record (RunStarted.data with sha256), a stopped run resumed bit for bit across
  an epoch boundary, epochs on record and said on stderr, `on_epoch_end` reaching the batches;
- a changed data file refused by resume, replay and fork in one line with exit 1, before anything is
  written; `rewind verify --data` clean on an intact run, and finding an edit the cheap fingerprint misses;
- documents tokenised into RUN/data/NAME at the start and reused on resume, the tokenizer trained at
  the start, a changed tokenizer file refused, a corpus and a built-in task mixed in one run;
- pretrained: a run started from another run's `export --to` file starts at those weights, records
  their sha256, and refuses a changed file on a resume before its first checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from rewind.engine.data import dataprep
from rewind.engine.data.tokenizer import train_bpe
from rewind.states.events import (
    CheckpointCommitted,
    ConfigChanged,
    EpochStarted,
    Evaluated,
    RunStarted,
    StepCommitted,
)
from rewind.states.fold import fold
from rewind.stores.datafiles import FINGERPRINT_BLOCK, NUM_FINGERPRINT_BLOCKS, fingerprint_offsets
from tests.engine.test_loop import (
    assert_bitwise_equal,
    effective_steps,
    events_of,
    one_line,
    one_torch_thread,
    run_cli,
)
from tests.engine.test_userdata import prepared_in

NUM_WINDOWS = 20  # of 17 tokens; validation_fraction 0.1 leaves 18 train rows: an epoch every 4.5 steps
NUM_TRAIN_ROWS = 18
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "from", "home", "and"]

CONFIG = """
[run]
seed = 3
[architecture]
block_size = {block_size}
vocab_size = {vocab_size}
num_layers = 2
num_heads = 2
d_model = 32
[training]
batch_size = 4
tokens = [{tokens}]
datasets = [[{datasets}]]
evaluations = [{evaluations}]
validation_steps = 1
[logging]
report_interval = 1
checkpoint_interval = 4
"""


def write_config(
    folder: Path,
    *,
    steps: int = 12,
    block_size: int = 16,
    vocab_size: int = 256,
    datasets: str = '{ name = "corpus" }',
    evaluations: str = "",
    extra: str = "",
    name: str = "run.toml",
) -> Path:
    text = CONFIG.format(
        block_size=block_size,
        vocab_size=vocab_size,
        tokens=steps * 4 * block_size,
        datasets=datasets,
        evaluations=evaluations,
    )
    path = folder / name
    path.write_text(text + extra)
    return path


TOKENS = """
[data.corpus]
kind = "tokens"
path = "{path}"
validation_fraction = 0.1
on_epoch_end = "{policy}"
"""


def token_setup(
    folder: Path, *, num_tokens: int = NUM_WINDOWS * 17, policy: str = "reshuffle", **config
) -> Path:
    """A token file of random ids and a config that trains on it; returns the config's path."""
    folder.mkdir(parents=True, exist_ok=True)
    np.random.default_rng(0).integers(0, 256, size=num_tokens).astype(np.uint16).tofile(folder / "corpus.bin")
    return write_config(folder, extra=TOKENS.format(path="corpus.bin", policy=policy), **config)


def train(config: Path, run: Path, *extra: str) -> tuple[int, str, str]:
    return run_cli("train", config, "--run-dir", run, "--no-progress", *extra)


def log_bytes(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "events").glob("*.log"))}


def final_tensors(run: Path) -> dict:
    """The model and optimizer tensors of the run's last checkpoint."""
    state = fold(events_of(run))
    folder = run / "checkpoints" / state.last_checkpoint.checkpoint
    return {f"{p.stem}/{k}": v for p in sorted(folder.glob("*.safetensors")) for k, v in load_file(p).items()}


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


# --- token files: record, resume, epochs ------------------------------------------------------------


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, str]:
    """A run of 12 steps over 18 train rows, straight through (epochs begin at steps 5, 9 and 10...)."""
    folder = tmp_path_factory.mktemp("straight")
    code, _, err = train(token_setup(folder), folder / "run")
    assert code == 0, err
    return folder / "run", err


def test_the_data_is_on_record_with_its_sha256(straight):
    run, _ = straight
    started = events_of(run)[0]
    assert isinstance(started, RunStarted) and "data_identity" in started.features
    identity = started.data["corpus"]
    [source] = identity.sources
    corpus = run.parent / "corpus.bin"
    assert source.path == str(corpus) and source.size == corpus.stat().st_size
    assert source.sha256 == sha256_of(corpus) and identity.num_tokens == NUM_WINDOWS * 17
    assert identity.kind == "tokens" and started.tokenizer == "" and started.pretrained == ""
    assert not (run / "data" / "tokenizer.json").exists()


def test_epochs_are_on_record_with_the_step_that_begins_them_and_said(straight):
    run, err = straight
    events = events_of(run)
    epochs = [(i, e) for i, e in enumerate(events) if isinstance(e, EpochStarted)]
    assert [e.epoch for _, e in epochs] == [1, 2]  # 12 steps * 4 rows = 48 positions: 18 and 36 begin one
    for i, epoch in epochs:
        step = events[i + 1]
        assert isinstance(step, StepCommitted) and step.step == epoch.step + 1 and epoch.dataset == "corpus"
        first_read = step.cursors["corpus"] - 4
        assert (
            first_read <= epoch.epoch * NUM_TRAIN_ROWS <= step.cursors["corpus"] - 1
        )  # that step read the first row
    assert fold(events).epochs == {"corpus": 2}
    said = [line for line in err.splitlines() if "epoch" in line]
    first, second = (e for _, e in epochs)  # both in the run's one stage: the second is said at its end
    assert said == [
        f"rewind: dataset 'corpus': all its {NUM_TRAIN_ROWS} train rows read; epoch 1 begins at step {first.step + 1} "
        "(any more in stage 0 are said once, at its end)",
        f"rewind: dataset 'corpus': epoch 2 began too in stage 0, at step {second.step + 1}",
    ]


def test_a_stopped_run_resumes_bitwise_across_an_epoch_boundary(straight, tmp_path):
    config = token_setup(tmp_path)
    code, _, err = train(config, tmp_path / "run", "--max-steps", "4")  # epoch 1 begins at step 5
    assert code == 0, err
    assert not any(isinstance(e, EpochStarted) for e in events_of(tmp_path / "run"))
    code, _, err = run_cli("resume", tmp_path / "run", "--no-progress")
    assert code == 0 and "resuming" in err, err
    reference, _ = straight
    assert effective_steps(tmp_path / "run") == effective_steps(reference)
    assert_bitwise_equal(final_tensors(reference), final_tensors(tmp_path / "run"))
    epochs = [(e.step, e.epoch) for e in events_of(tmp_path / "run") if isinstance(e, EpochStarted)]
    assert epochs == [(e.step, e.epoch) for e in events_of(reference) if isinstance(e, EpochStarted)]


def test_repeat_reads_the_first_epochs_rows_again_and_reshuffle_does_not(straight, tmp_path):
    code, _, err = train(token_setup(tmp_path, policy="repeat"), tmp_path / "run", "--max-steps", "6")
    assert code == 0, err
    repeat = [e.loss for e in events_of(tmp_path / "run") if isinstance(e, StepCommitted)]
    reshuffle = [e.loss for e in events_of(straight[0]) if isinstance(e, StepCommitted)][:6]
    # The same rows until position 18 (step 5 reads 16..19): the same losses, bit for bit; then not.
    assert repeat[:4] == reshuffle[:4] and repeat[4] != reshuffle[4]
    assert [e.epoch for e in events_of(tmp_path / "run") if isinstance(e, EpochStarted)] == [1]


def test_a_run_on_a_remote_token_file_takes_the_same_steps(straight, tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    remote = f"/rewind-data-runs-{os.getpid()}/corpus.bin"
    fs.pipe(remote, (straight[0].parent / "corpus.bin").read_bytes())
    try:
        config = write_config(tmp_path, extra=TOKENS.format(path=f"memory://{remote}", policy="reshuffle"))
        code, _, err = train(config, tmp_path / "run", "--max-steps", "6")
        assert code == 0, err
        identity = events_of(tmp_path / "run")[0].data["corpus"]
        assert [f.path for f in identity.sources] == [f"memory://{remote}"]
        assert identity.sources[0].sha256 == sha256_of(straight[0].parent / "corpus.bin")
    finally:
        fs.rm(remote.rsplit("/", 1)[0], recursive=True)
    # Ranged reads of the same bytes: the same rows, so the same steps bit for bit.
    assert effective_steps(tmp_path / "run") == effective_steps(straight[0])[:6]


def test_replay_reproduces_a_run_on_a_token_file_and_a_fork_records_its_data(straight, tmp_path):
    run, _ = straight
    code, out, err = run_cli("replay", run, "--no-progress")
    assert code == 0 and "replay: reproducible" in out, err
    code, out, err = run_cli(
        "fork",
        run,
        tmp_path / "child",
        "--at-step",
        "8",
        "--no-progress",
        "--set",
        "data.corpus.on_epoch_end=repeat",
    )
    assert code == 0 and "run finished" in out, err
    child = events_of(tmp_path / "child")
    assert child[0].data == events_of(run)[0].data and child[0].parent is not None
    changed = [e for e in child if isinstance(e, ConfigChanged)]
    assert len(changed) == 1 and changed[0].data == child[0].data  # the same files, now read on repeat
    assert run_cli("verify", "--data", tmp_path / "child")[0] == 0


# --- changed data ----------------------------------------------------------------------------------


@pytest.fixture
def stopped(tmp_path) -> Path:
    """A run stopped at step 2 on tmp_path/corpus.bin (its own copy of the data, free to change)."""
    code, _, err = train(token_setup(tmp_path), tmp_path / "run", "--max-steps", "2")
    assert code == 0, err
    return tmp_path / "run"


CHANGES = {
    "same size, a sampled byte": (
        lambda p: flip_byte(p, 101),
        "contents changed (same size, different fingerprint)",
    ),
    "longer": (
        lambda p: p.write_bytes(p.read_bytes() + b"\1\0"),
        f"size {NUM_WINDOWS * 34 + 2} bytes, the run recorded",
    ),
    "shorter": (
        lambda p: p.write_bytes(p.read_bytes()[:-2]),
        f"size {NUM_WINDOWS * 34 - 2} bytes, the run recorded",
    ),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_changed_data_file_is_refused_on_resume_before_anything_is_written(stopped, change):
    alter, needle = CHANGES[change]
    alter(stopped.parent / "corpus.bin")
    before, checkpoints = log_bytes(stopped), sorted(os.listdir(stopped / "checkpoints"))
    code, out, err = run_cli("resume", stopped, "--no-progress")
    assert code == 1 and out == ""
    line = one_line(err)
    assert line.startswith(f"rewind: {stopped}: dataset 'corpus': {stopped.parent / 'corpus.bin'}: {needle}")
    assert line.endswith(f"the run's data changed under it (`rewind verify --data {stopped}`)")
    assert log_bytes(stopped) == before and sorted(os.listdir(stopped / "checkpoints")) == checkpoints


@pytest.mark.parametrize("command", ["replay", "fork"])
def test_replay_and_fork_refuse_changed_data(stopped, command):
    flip_byte(stopped.parent / "corpus.bin", 7)
    before = log_bytes(stopped)
    args = (
        ["replay", stopped]
        if command == "replay"
        else ["fork", stopped, stopped.parent / "child", "--at-step", "2"]
    )
    code, _, err = run_cli(*args, "--no-progress")
    assert code == 1
    assert (
        "dataset 'corpus': " in one_line(err) and "contents changed (same size, different fingerprint)" in err
    )
    assert log_bytes(stopped) == before and not (stopped.parent / "child").exists()


def test_a_deleted_data_file_is_refused_on_resume_as_a_change(stopped):
    os.remove(stopped.parent / "corpus.bin")
    before = log_bytes(stopped)
    code, _, err = run_cli("resume", stopped, "--no-progress")
    assert log_bytes(stopped) == before
    assert code == 1 and "dataset 'corpus'" in one_line(err)


@pytest.mark.parametrize("command", ["replay", "fork"])
def test_a_deleted_data_file_is_one_line_in_replay_and_fork(stopped, command):
    # (Before: DatasetError out of main, a traceback.)
    os.remove(stopped.parent / "corpus.bin")
    args = (
        ["replay", stopped]
        if command == "replay"
        else ["fork", stopped, stopped.parent / "child", "--at-step", "2"]
    )
    code, _, err = run_cli(*args, "--no-progress")
    assert code == 1 and f"{stopped.parent / 'corpus.bin'}: file not found" in one_line(err)
    assert not (stopped.parent / "child").exists()


def test_a_deleted_data_file_is_a_problem_for_verify(stopped):
    os.remove(stopped.parent / "corpus.bin")
    code, out, err = run_cli("verify", "--data", stopped)
    assert code == 1 and err == ""
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert len(problems) == 1 and f"{stopped.parent / 'corpus.bin'}: file not found" in problems[0]


def test_verify_data_is_clean_on_an_intact_run_and_finds_what_the_fingerprint_misses(tmp_path):
    num_tokens = NUM_FINGERPRINT_BLOCKS * FINGERPRINT_BLOCK  # 2 MiB of uint16: fingerprinted by blocks
    code, _, err = train(token_setup(tmp_path, num_tokens=num_tokens), tmp_path / "run", "--max-steps", "0")
    assert code == 0, err
    run = tmp_path / "run"
    code, out, _ = run_cli("verify", "--data", run)
    assert (
        code == 0
        and "data: 1 dataset(s), 1 file(s) re-hashed, all as recorded" in out
        and "verify: clean" in out
    )
    corpus = tmp_path / "corpus.bin"
    offsets = fingerprint_offsets(corpus.stat().st_size)
    flip_byte(corpus, offsets[5] + FINGERPRINT_BLOCK + 100)  # between two sampled blocks
    assert run_cli("verify", run)[0] == 0  # without --data the data is not read
    code, out, _ = run_cli("verify", "--data", run)
    assert code == 1 and "verify: 1 problem(s)" in out
    [problem] = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert problem.startswith(f"PROBLEM data: dataset 'corpus': {corpus}: contents changed (sha256 ")


# --- documents and tokenizers ----------------------------------------------------------------------

DOCUMENTS_CONFIG = """
[data.corpus]
kind = "jsonl"
path = "docs.jsonl"
validation_fraction = 0.1
[tokenizer]
{tokenizer}
"""


def documents(seed: int = 0, num: int = 40) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=25)) + "." for _ in range(num)]


def documents_setup(folder: Path, tokenizer: str = "train_vocab_size = 300", **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents()))
    return write_config(folder, vocab_size=320, extra=DOCUMENTS_CONFIG.format(tokenizer=tokenizer), **config)


@pytest.fixture(scope="module")
def documents_run(tmp_path_factory) -> Path:
    """A run on jsonl documents with a tokenizer trained at its start, stopped at step 3."""
    folder = tmp_path_factory.mktemp("documents")
    code, _, err = train(documents_setup(folder), folder / "run", "--max-steps", "3")
    assert code == 0, err
    return folder / "run"


def test_documents_are_tokenised_into_the_run_by_the_tokenizer_trained_at_its_start(documents_run):
    run = documents_run
    started = events_of(run)[0]
    tokenizer = train_bpe(documents(), 300)
    assert started.tokenizer == tokenizer.identity == sha256_of(run / "data" / "tokenizer.json")
    prepared = prepared_in(run / "data", "corpus")
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["tokenizer"] == tokenizer.identity and manifest["input_kind"] == "jsonl"
    ids = np.fromfile(prepared / "train.bin", dtype=manifest["dtype"]).tolist()
    expected = []
    for i, document in enumerate(documents()):
        expected += ([tokenizer.eos_id] if i else []) + tokenizer.encode(document)
    assert ids == expected
    identity = started.data["corpus"]
    assert identity.kind == "jsonl" and identity.tokenizer == tokenizer.identity
    assert [f.sha256 for f in identity.sources] == [sha256_of(run.parent / "docs.jsonl")]
    assert identity.prepared == sha256_of(prepared / "manifest.json")


def test_a_resume_reuses_the_tokenised_documents(documents_run, tmp_path, monkeypatch):
    run = tmp_path / "run"
    shutil.copytree(documents_run, run)
    prepared = prepared_in(run / "data", "corpus")
    stamps = {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()}

    def no_tokenising(*args, **kwargs):
        raise AssertionError("documents tokenised again on resume")

    monkeypatch.setattr(dataprep, "tokenise_split", no_tokenising)
    code, out, err = run_cli("resume", run, "--no-progress")
    assert code == 0 and "run finished" in out, err
    assert {p.name: p.stat().st_mtime_ns for p in prepared.iterdir()} == stamps


def test_a_changed_run_tokenizer_is_refused_on_resume(documents_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(documents_run, run)
    (run / "data" / "tokenizer.json").write_text(train_bpe(documents(5), 300).to_json())
    before = log_bytes(run)
    code, _, err = run_cli("resume", run, "--no-progress")
    assert code == 1 and "tokenizer.json: the run's tokenizer file changed since the run started" in one_line(
        err
    )
    assert log_bytes(run) == before


def test_a_changed_tokenizer_path_is_refused_on_resume(tmp_path):
    (tmp_path / "tok.json").write_text(train_bpe(documents(1), 300).to_json())
    config = documents_setup(tmp_path, tokenizer='path = "tok.json"')
    code, _, err = train(config, tmp_path / "run", "--max-steps", "1")
    assert code == 0, err
    (tmp_path / "tok.json").write_text(train_bpe(documents(2), 300).to_json())
    before = log_bytes(tmp_path / "run")
    code, _, err = train(config, tmp_path / "run")
    assert code == 1 and f"tokenizer.path: {tmp_path / 'tok.json'} changed since the run started" in one_line(
        err
    )
    assert log_bytes(tmp_path / "run") == before


def test_a_run_on_documents_forks(documents_run, tmp_path):
    code, _, err = run_cli(
        "fork", documents_run, tmp_path / "child", "--at-step", "2", "--max-steps", "1", "--no-progress"
    )
    assert code == 0, err
    prepared_in(tmp_path / "child" / "data", "corpus")  # its own copy of the tokenised documents


def test_a_changed_run_tokenizer_is_one_line_in_replay(documents_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(documents_run, run)
    (run / "data" / "tokenizer.json").write_text(train_bpe(documents(5), 300).to_json())
    code, _, err = run_cli("replay", run, "--no-progress")
    assert code == 1 and "tokenizer" in one_line(err)


def test_a_prepared_directory_trains_with_its_tokenizer_and_validation_file(tmp_path):
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents()))
    (tmp_path / "valid.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(7, 10)))
    code, _, err = run_cli(
        "data",
        "prepare",
        tmp_path / "docs.jsonl",
        "--out",
        tmp_path / "prep",
        "--train-tokenizer",
        "300",
        "--validation",
        tmp_path / "valid.jsonl",
        "--no-progress",
    )
    assert code == 0, err
    prepared = tmp_path / "prep"
    manifest = json.loads((prepared / "manifest.json").read_text())
    config = write_config(tmp_path, vocab_size=320, extra='[data.corpus]\nkind = "tokens"\npath = "prep"\n')
    code, _, err = train(config, tmp_path / "run", "--max-steps", "2")
    assert code == 0, err
    started = events_of(tmp_path / "run")[0]
    assert started.tokenizer == manifest["tokenizer"] == sha256_of(prepared / "tokenizer.json")  # adopted
    assert (tmp_path / "run" / "data" / "tokenizer.json").read_bytes() == (
        prepared / "tokenizer.json"
    ).read_bytes()
    identity = started.data["corpus"]
    assert (
        identity.prepared == sha256_of(prepared / "manifest.json")
        and identity.tokenizer == manifest["tokenizer"]
    )
    assert [(f.path, f.sha256) for f in identity.sources] == [
        (str(prepared / "train.bin"), manifest["splits"]["train"]["sha256"])
    ]
    assert [f.path for f in identity.validation_sources] == [str(prepared / "validation.bin")]
    assert not [
        p for p in (tmp_path / "run" / "data").iterdir() if p.is_dir()
    ]  # read where it is, not copied

    (tmp_path / "other.json").write_text(train_bpe(documents(3), 300).to_json())
    other = write_config(
        tmp_path,
        vocab_size=320,
        name="other.toml",
        extra='[data.corpus]\nkind = "tokens"\npath = "prep"\n[tokenizer]\npath = "other.json"\n',
    )
    code, _, err = train(other, tmp_path / "run2")
    assert code == 2
    assert one_line(err).startswith(
        f"rewind: dataset 'corpus': {prepared} was tokenised by {manifest['tokenizer'][:12]}"
    )
    assert not (tmp_path / "run2" / "events").exists()


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_in_one_line(tmp_path):
    too_big = documents_setup(tmp_path, tokenizer="train_vocab_size = 400")  # architecture.vocab_size 320
    code, _, err = train(too_big, tmp_path / "run")
    assert code == 2
    assert (
        one_line(err)
        == f"rewind: {too_big}: tokenizer.train_vocab_size: 400 exceeds architecture.vocab_size 320"
    )
    assert not (tmp_path / "run").exists()


def test_a_tokenizer_file_larger_than_the_vocabulary_is_one_line_from_the_command(tmp_path):
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 7))) for _ in range(2000)]
    (tmp_path / "tok.json").write_text(
        train_bpe([" ".join(words[i : i + 50]) for i in range(0, 2000, 50)], 400).to_json()
    )
    config = documents_setup(tmp_path, tokenizer='path = "tok.json"')
    result = subprocess.run(
        [sys.executable, "-m", "rewind.tools.cli", "train", str(config), "--run-dir", "run", "--no-progress"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 2 and result.stdout == ""
    assert (
        one_line(result.stderr) == "rewind: the tokenizer has 400 ids, more than architecture.vocab_size 320"
    )
    assert not (tmp_path / "run" / "events").exists()


def test_a_corpus_and_a_task_mix_in_one_run(tmp_path):
    config = documents_setup(
        tmp_path,
        block_size=24,
        steps=6,
        evaluations='"corpus", "sort"',
        datasets='{ name = "corpus", rate = 0.5 }, { name = "sort", rate = 0.5 }',
    )
    code, out, err = train(config, tmp_path / "run")
    assert code == 0 and "run finished" in out, err
    events = events_of(tmp_path / "run")
    last = [e for e in events if isinstance(e, StepCommitted)][-1]
    assert last.cursors == {"corpus": 12, "sort": 12} and np.isfinite(last.loss)
    final = [e for e in events if isinstance(e, Evaluated)][-1]
    assert set(final.scores) == {"sort"} and 0.0 <= final.scores["sort"] <= 1.0
    assert set(final.losses) == {"corpus", "sort"} and "corpus" in final.bits_per_byte


def test_a_fork_in_place_onto_a_larger_file_goes_on_past_its_epochs(tmp_path):
    config = token_setup(tmp_path, steps=24)
    code, _, err = train(config, tmp_path / "run", "--max-steps", "10")  # 40 rows read: epoch 2 of 18 rows
    assert code == 0, err
    np.random.default_rng(1).integers(0, 256, size=40 * 17).astype(np.uint16).tofile(tmp_path / "larger.bin")
    code, _, err = train(
        config, tmp_path / "run", "--fork", "--set", f"data.corpus.path={tmp_path / 'larger.bin'}"
    )
    # 36 train rows now: cursor 72 begins "epoch 2" again (before: the fold refused it, the run stuck).
    assert code == 0, err
    assert any(isinstance(e, ConfigChanged) for e in events_of(tmp_path / "run"))


def test_a_fork_before_a_data_change_checks_the_data_of_its_fork_point(tmp_path):
    config = token_setup(tmp_path, steps=24)
    code, _, err = train(config, tmp_path / "run", "--max-steps", "8")  # checkpoints at steps 4 and 8
    assert code == 0, err
    np.random.default_rng(1).integers(0, 256, size=40 * 17).astype(np.uint16).tofile(tmp_path / "larger.bin")
    code, _, err = train(
        config,
        tmp_path / "run",
        "--fork",
        "--max-steps",
        "1",
        "--set",
        f"data.corpus.path={tmp_path / 'larger.bin'}",
    )
    assert code == 0, err
    # Step 4 was trained on corpus.bin, which is unchanged: the child goes on from there on it.
    code, _, err = run_cli(
        "fork", tmp_path / "run", tmp_path / "child", "--at-step", "4", "--max-steps", "1", "--no-progress"
    )
    # (Before: refused, "1 file(s) gone (larger.bin) and 1 new file(s) (corpus.bin)", exit 1.)
    assert code == 0, err


def test_a_fork_in_place_that_changes_the_tokenizer_is_refused(tmp_path):
    from rewind.engine.run.session import open_run
    from rewind.tools.configfile import load_config

    config = documents_setup(tmp_path, tokenizer="")  # bytes
    with one_torch_thread():  # started, then killed before a checkpoint
        run, _, _ = open_run(load_config(config), str(tmp_path / "run"))
    run.journal.close()
    trained = documents_setup(tmp_path, tokenizer="train_vocab_size = 300", name="trained.toml")
    before = log_bytes(tmp_path / "run")
    code, _, err = train(trained, tmp_path / "run", "--fork", "--max-steps", "1")
    # (Before: accepted, the ConfigChanged naming a trained tokenizer while the run went on reading bytes.)
    assert code == 2 and "tokenizer" in one_line(err)
    assert log_bytes(tmp_path / "run") == before


def test_the_steps_before_a_fork_onto_other_documents_still_replay(tmp_path):
    config = documents_setup(tmp_path)
    code, _, err = train(config, tmp_path / "run", "--max-steps", "4")
    assert code == 0, err
    (tmp_path / "other.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents(8)))
    code, _, err = train(
        config,
        tmp_path / "run",
        "--fork",
        "--max-steps",
        "1",
        "--set",
        f"data.corpus.path={tmp_path / 'other.jsonl'}",
    )
    assert code == 0, err
    code, out, err = run_cli("replay", tmp_path / "run", "--to-step", "4", "--no-progress")
    # (Before: "dataset 'corpus': its prepared manifest changed", exit 1: RUN/data/corpus held other.jsonl.)
    assert code == 0 and "replay: reproducible" in out, err


# --- pretrained ------------------------------------------------------------------------------------

PRETRAINED = """
[pretrained]
path = "{path}"
"""


@pytest.fixture(scope="module")
def exported(straight, tmp_path_factory) -> Path:
    """The straight run's final weights, exported (`rewind export --to`), in a folder of their own."""
    folder = tmp_path_factory.mktemp("exported")
    code, _, err = run_cli("export", straight[0], "--to", folder / "w.safetensors")
    assert code == 0, err
    return folder / "w.safetensors"


def pretrained_setup(folder: Path, weights: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(weights, folder / "w.safetensors")
    config = token_setup(folder)
    config.write_text(
        config.read_text().replace("seed = 3", "seed = 11") + PRETRAINED.format(path="w.safetensors")
    )
    return config


def test_a_run_starts_at_the_exported_weights_and_records_them(exported, tmp_path):
    config = pretrained_setup(tmp_path, exported)
    code, _, err = train(
        config, tmp_path / "run", "--max-steps", "0"
    )  # a checkpoint of the weights at step 0
    assert code == 0, err
    started = events_of(tmp_path / "run")[0]
    assert started.pretrained == sha256_of(exported)
    step0 = next(e for e in events_of(tmp_path / "run") if isinstance(e, CheckpointCommitted))
    assert step0.step == 0
    code, _, err = run_cli("export", tmp_path / "run", "--to", tmp_path / "again.safetensors")
    assert code == 0, err
    assert_bitwise_equal(load_file(exported), load_file(tmp_path / "again.safetensors"))
    # A changed file does not matter once a checkpoint holds the weights: it is not read again.
    flip_byte(tmp_path / "w.safetensors", (tmp_path / "w.safetensors").stat().st_size - 3)
    code, _, err = run_cli("resume", tmp_path / "run", "--no-progress", "--max-steps", "1")
    assert code == 0, err


def test_a_changed_pretrained_file_is_refused_before_the_first_checkpoint(exported, tmp_path):
    from rewind.engine.run.session import open_run
    from rewind.tools.configfile import load_config

    config = pretrained_setup(tmp_path, exported)
    with one_torch_thread():
        run, _, how = open_run(load_config(config), str(tmp_path / "run"))  # started, killed before a step
    run.journal.close()
    assert how == "started" and not fold(events_of(tmp_path / "run")).live_checkpoints
    weights = load_file(tmp_path / "w.safetensors")
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(tmp_path / "w.safetensors"), "pt") as handle:
        metadata = handle.metadata()
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1.0  # other weights, same shapes and metadata
    save_file(weights, str(tmp_path / "w.safetensors"), metadata=metadata)
    before = log_bytes(tmp_path / "run")
    code, _, err = run_cli("resume", tmp_path / "run", "--no-progress")
    assert code == 1
    line = one_line(err)
    assert line.startswith(
        f"rewind: pretrained: {tmp_path / 'w.safetensors'} changed since the run started (sha256 "
    )
    assert f"recorded {sha256_of(exported)[:12]})" in line
    assert log_bytes(tmp_path / "run") == before
