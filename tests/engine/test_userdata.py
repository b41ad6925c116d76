"""User datasets (rewind.engine.data.userdata, rewind.engine.data.datasets) opened as a run opens them.

- token files: rows are the file's windows as RowSplit carves them; a prepared directory (`rewind data
  prepare`) opens as kind tokens with its validation.bin as the validation split, and one tokenised by
  another tokenizer than the run's is refused in one line;
- documents (text, jsonl, parquet): tokenised once into the data directory, reused when opened again;
- prompt/response pairs: the loss on the response (and its end-of-text token) only, left truncation,
  padding;
- identities: what each kind records (rewind.states.data_identity);
- the built-in tasks through a trained tokenizer: the loss mask covers exactly the encoded answers;
- paths: `{stdlib}`, and relative paths taken against the config file (rewind.tools.configfile).
"""

from __future__ import annotations

import gc
import glob
import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.engine.data import dataprep
from rewind.engine.data.dataprep import prepare
from rewind.engine.data.datasets import BuiltinDataset, DatasetError, PairDataset, WindowedDataset, pack_pairs
from rewind.engine.data.registry import DatasetRegistry
from rewind.engine.data.tasks import task_sample
from rewind.engine.data.tokenizer import ByteTokenizer, Tokenizer, train_bpe
from rewind.engine.data.tokens import RowSplit
from rewind.engine.data.userdata import DataHome, dataset_identity, open_user_dataset
from rewind.states.config import ArchitectureSection, Config, DataSource, Sampling
from rewind.states.stages import PretrainStage
from rewind.stores.datamanifest import manifest_hash, read_manifest
from rewind.tools.configfile import load_config

BLOCK = 16
WIDTH = BLOCK + 1
DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.",
    "def double(x):\n    return x * 2  # the same number twice\n",
    "naïve café, 東京 — rivers run to the sea and the sea is never full.",
    "So she was considering in her own mind, as well as she could, for the hot day made her sleepy.",
] * 6


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_bpe(DOCUMENTS, 320)


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def joined(tokenizer, documents: list[str]) -> list[int]:
    """What a prepared token file holds: the documents' ids, the separator between them."""
    flat: list[int] = []
    for i, document in enumerate(documents):
        flat += (tokenizer.separator() if i else []) + tokenizer.encode(document)
    return flat


def windows_of(values, rows) -> np.ndarray:
    values = np.asarray(values, dtype=np.int64)
    return np.stack([values[r * WIDTH : (r + 1) * WIDTH] for r in rows])


def prepared_in(data_dir, name: str) -> Path:
    """The directory of `data_dir` that dataset `name`'s documents were tokenised into (NAME, or NAME-<key>
    when the directory is keyed by what made the tokens)."""
    found = [
        p
        for p in Path(data_dir).iterdir()
        if (p.name == name or p.name.startswith(f"{name}-")) and (p / "manifest.json").is_file()
    ]
    assert len(found) == 1, found
    return found[0]


def all_rows(dataset, split: str) -> np.ndarray:
    tokens, _ = dataset.batch(split, np.arange(dataset.num_samples(split)))
    return tokens.numpy()


# --- token files and prepared directories -----------------------------------------------------------


def test_a_token_file_serves_its_windows_as_the_random_split_carves_them(tmp_path):
    values = np.random.default_rng(0).integers(0, 256, size=40 * WIDTH + 3)
    values.astype(np.uint16).tofile(tmp_path / "t.bin")
    source = DataSource(kind="tokens", path=str(tmp_path / "t.bin"), validation_fraction=0.25)
    dataset = open_user_dataset("t", source, BLOCK, 256)  # a run of today: split "" is random
    assert isinstance(dataset, WindowedDataset) and dataset.rows.mode == "random"
    carve = RowSplit(40, "random", 0.25)
    for split in ("train", "validation"):
        rows = carve.rows(split, np.arange(carve.count(split)))
        assert np.array_equal(all_rows(dataset, split), windows_of(values, rows))
        tokens, mask = dataset.sample(split, 2)
        assert (
            np.array_equal(tokens, windows_of(values, rows[2:3])[0]) and mask.all() and mask.shape == (BLOCK,)
        )
    tail = open_user_dataset(
        "t",
        DataSource(kind="tokens", path=str(tmp_path / "t.bin"), validation_fraction=0.25, split="tail"),
        BLOCK,
        256,
    )
    assert np.array_equal(all_rows(tail, "validation"), windows_of(values, range(30, 40)))
    assert not np.array_equal(all_rows(tail, "validation"), all_rows(dataset, "validation"))


def test_a_validation_file_is_the_validation_split(tmp_path):
    train = np.arange(6 * WIDTH) % 200
    validation = (np.arange(3 * WIDTH) + 7) % 200
    train.astype(np.uint32).tofile(tmp_path / "train.bin")
    validation.astype(np.uint32).tofile(tmp_path / "valid.bin")
    source = DataSource(
        kind="tokens",
        path=str(tmp_path / "train.bin"),
        dtype="uint32",
        validation_path=str(tmp_path / "valid.bin"),
    )
    dataset = open_user_dataset("t", source, BLOCK, 256)
    assert (dataset.num_samples("train"), dataset.num_samples("validation")) == (6, 3)
    assert np.array_equal(all_rows(dataset, "train"), windows_of(train, range(6)))
    assert np.array_equal(all_rows(dataset, "validation"), windows_of(validation, range(3)))


@pytest.fixture
def prepared(tmp_path, bpe):
    """A directory prepared by `bpe` from jsonl documents, with a validation split of its own."""
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": d} for d in DOCUMENTS])
    valid = write_jsonl(tmp_path / "valid.jsonl", [{"text": d} for d in DOCUMENTS[:3]])
    prepare([train], tmp_path / "prepared", bpe, kind="jsonl", validation_inputs=[valid])
    return tmp_path / "prepared"


def test_a_prepared_directory_opens_as_tokens_with_its_validation_split(prepared, bpe):
    dataset = open_user_dataset(
        "p", DataSource(kind="tokens", path=str(prepared)), BLOCK, 320, DataHome(tokenizer=bpe)
    )
    assert dataset.rows.mode == "file"  # validation.bin, not carved out of train.bin
    train_ids, valid_ids = joined(bpe, DOCUMENTS), joined(bpe, DOCUMENTS[:3])
    assert dataset.num_samples("train") == len(train_ids) // WIDTH
    assert dataset.num_samples("validation") == len(valid_ids) // WIDTH
    assert np.array_equal(all_rows(dataset, "train"), windows_of(train_ids, range(len(train_ids) // WIDTH)))
    assert np.array_equal(
        all_rows(dataset, "validation"), windows_of(valid_ids, range(len(valid_ids) // WIDTH))
    )


@pytest.mark.parametrize("run_tokenizer", ["bytes", "another"])
def test_a_prepared_directory_of_another_tokenizer_is_refused_in_one_line(prepared, bpe, run_tokenizer):
    other = ByteTokenizer() if run_tokenizer == "bytes" else train_bpe(DOCUMENTS[:2], 300)
    with pytest.raises(DatasetError) as caught:
        open_user_dataset(
            "p", DataSource(kind="tokens", path=str(prepared)), BLOCK, 320, DataHome(tokenizer=other)
        )
    message = str(caught.value)
    assert "\n" not in message and message.startswith("dataset 'p': ")
    assert f"tokenised by {bpe.identity[:12]}" in message
    assert (other.identity[:12] or "UTF-8 bytes") in message
    if run_tokenizer == "bytes":  # the way forward: the command that prepares it with the run's (bytes)
        assert "rewind data prepare " in message and f"--out {prepared} --overwrite" in message
    else:  # a tokenizer with no file to prepare with (trained here): name the directory's
        assert "tokenizer.json" in message


def test_a_validation_path_beside_a_prepared_directory_is_used_or_refused(prepared, bpe, tmp_path):
    # (Before: silently ignored, the validation rows carved or read from the directory instead.)
    (np.arange(5 * WIDTH) % 300).astype(np.uint16).tofile(tmp_path / "held_out.bin")
    held_out = str(tmp_path / "held_out.bin")
    with pytest.raises(DatasetError) as caught:  # the directory has a validation split of its own
        open_user_dataset(
            "p",
            DataSource(kind="tokens", path=str(prepared), validation_path=held_out),
            BLOCK,
            320,
            DataHome(tokenizer=bpe),
        )
    assert "\n" not in str(caught.value) and "validation_path" in str(caught.value)
    train = write_jsonl(tmp_path / "t.jsonl", [{"text": d} for d in DOCUMENTS])
    prepare([train], tmp_path / "no_validation", bpe, kind="jsonl")
    source = DataSource(kind="tokens", path=str(tmp_path / "no_validation"), validation_path=held_out)
    dataset = open_user_dataset("p", source, BLOCK, 320, DataHome(tokenizer=bpe))
    assert dataset.num_samples("validation") == 5
    assert np.array_equal(all_rows(dataset, "validation"), windows_of(np.arange(5 * WIDTH) % 300, range(5)))
    ids = joined(bpe, DOCUMENTS)
    assert dataset.num_samples("train") == len(ids) // WIDTH  # every window of train.bin trains
    identity = dataset_identity("p", source, DataHome(tokenizer=bpe))
    assert [f.path for f in identity.validation_sources] == [held_out]


# --- documents --------------------------------------------------------------------------------------


def write_documents(tmp_path, kind: str) -> str:
    if kind == "text":
        folder = tmp_path / "texts"
        folder.mkdir()
        for i, document in enumerate(DOCUMENTS):
            (folder / f"{i:03d}.txt").write_text(document, encoding="utf-8")
        return str(folder / "*.txt")
    if kind == "jsonl":
        return write_jsonl(tmp_path / "docs.jsonl", [{"body": d, "n": i} for i, d in enumerate(DOCUMENTS)])
    pq.write_table(pa.table({"body": DOCUMENTS}), tmp_path / "docs.parquet", row_group_size=5)
    return str(tmp_path / "docs.parquet")


@pytest.mark.parametrize("kind", ["text", "jsonl", "parquet"])
def test_documents_are_tokenised_into_the_data_directory_once(tmp_path, bpe, kind, monkeypatch):
    path = write_documents(tmp_path, kind)
    source = DataSource(kind=kind, path=path, text_field="body", validation_fraction=0.1)
    data_dir = tmp_path / "run" / "data"
    dataset = open_user_dataset("docs", source, BLOCK, 320, DataHome(tokenizer=bpe, data_dir=str(data_dir)))
    out = prepared_in(data_dir, "docs")
    manifest = read_manifest(out)
    assert manifest.tokenizer == bpe.identity and manifest.input_kind == kind
    ids = joined(bpe, DOCUMENTS)
    assert np.fromfile(out / "train.bin", dtype=manifest.dtype).tolist() == ids
    num_windows = len(ids) // WIDTH
    carve = RowSplit(num_windows, "random", 0.1)
    assert np.array_equal(
        all_rows(dataset, "validation"),
        windows_of(ids, carve.rows("validation", np.arange(carve.num_validation))),
    )

    # Opened again (a resume: a new home, a new registry): the prepared directory is reused as it is.
    stamps = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    digest = manifest_hash(out)

    def no_tokenising(*args, **kwargs):
        raise AssertionError("documents tokenised again")

    monkeypatch.setattr(dataprep, "tokenise_split", no_tokenising)
    again = open_user_dataset("docs", source, BLOCK, 320, DataHome(tokenizer=bpe, data_dir=str(data_dir)))
    assert np.array_equal(all_rows(again, "train"), all_rows(dataset, "train"))
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == stamps and manifest_hash(out) == digest


def test_documents_without_a_data_directory_go_to_a_scratch_directory_removed_with_the_home(tmp_path):
    path = write_documents(tmp_path, "jsonl")
    home = DataHome()
    dataset = open_user_dataset(
        "docs", DataSource(kind="jsonl", path=path, text_field="body"), BLOCK, 256, home
    )
    scratch = os.path.dirname(dataset.path)  # where train.bin is
    assert os.path.isfile(os.path.join(scratch, "manifest.json"))
    ids = joined(ByteTokenizer(), DOCUMENTS)  # bytes: documents joined by "\n"
    assert dataset.num_samples("train") + dataset.num_samples("validation") == len(ids) // WIDTH
    del home, dataset
    gc.collect()
    assert not os.path.exists(scratch)


# --- prompt / response pairs ------------------------------------------------------------------------

PAIRS = [
    {"q": "What is two plus two?", "a": "Four."},
    {"q": "Name a colour.", "a": "Blue, like the sea on a clear day."},
    {"q": "A very long question " * 6 + "ends here?", "a": "Short."},
    {"q": "Say nothing.", "a": ""},
] * 5


def check_pair_rows(dataset, tokenizer, examples) -> None:
    """Every row: prompt + response + eos left-truncated to WIDTH, padded with pad_id, the loss on the
    response's tokens and the eos only."""
    tokens, masks = dataset.batch("train", np.arange(dataset.num_samples("train")))
    assert len(tokens) == len(examples)
    for row, mask, (prompt, response) in zip(tokens.numpy(), masks.numpy(), examples, strict=True):
        answer = [*tokenizer.encode(response), tokenizer.eos_id]
        ids = ([*tokenizer.encode(prompt), *answer])[-WIDTH:]
        assert row[: len(ids)].tolist() == ids
        assert (row[len(ids) :] == tokenizer.pad_id).all()
        targets = row[1:][mask]
        assert targets.tolist() == answer[-int(mask.sum()) :]
        assert mask.sum() == min(len(answer), len(ids) - 1) and targets[-1] == tokenizer.eos_id
        # Contiguous, ending at the last real token: nothing of the prompt or the padding is scored.
        where = np.flatnonzero(mask)
        assert where.tolist() == list(range(len(ids) - 1 - len(where), len(ids) - 1))


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_pairs_score_the_response_and_its_end_only(tmp_path, bpe, kind):
    if kind == "jsonl":
        path = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    else:
        path = str(tmp_path / "pairs.parquet")
        pq.write_table(pa.table({"q": [p["q"] for p in PAIRS], "a": [p["a"] for p in PAIRS]}), path)
    source = DataSource(
        kind=kind, path=path, prompt_field="q", response_field="a", validation_fraction=0.2, split="tail"
    )
    dataset = open_user_dataset("qa", source, BLOCK, 320, DataHome(tokenizer=bpe))
    assert isinstance(dataset, PairDataset) and dataset.has_answers
    assert (dataset.num_samples("train"), dataset.num_samples("validation")) == (16, 4)
    check_pair_rows(dataset, bpe, [(p["q"], p["a"]) for p in PAIRS[:16]])
    long_row, long_mask = dataset.sample("train", 2)
    # Left truncation keeps the end of the long question, the part the answer depends on.
    assert bpe.decode(long_row[long_mask.argmax() - 3 : long_mask.argmax() + 1].tolist()).endswith("here?")


def test_pairs_with_a_validation_file(tmp_path, bpe):
    train = write_jsonl(tmp_path / "train.jsonl", PAIRS[:4])
    valid = write_jsonl(tmp_path / "valid.jsonl", PAIRS[1:3])
    source = DataSource(kind="jsonl", path=train, prompt_field="q", response_field="a", validation_path=valid)
    dataset = open_user_dataset("qa", source, BLOCK, 320, DataHome(tokenizer=bpe))
    assert (dataset.num_samples("train"), dataset.num_samples("validation")) == (4, 2)
    check_pair_rows(dataset, bpe, [(p["q"], p["a"]) for p in PAIRS[:4]])
    first_valid = dataset.sample("validation", 0)[0]
    assert first_valid.tolist() == dataset.sample("train", 1)[0].tolist()


@settings(max_examples=80, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(st.lists(st.integers(1, 50), max_size=30), st.lists(st.integers(1, 50), max_size=30)),
        min_size=1,
        max_size=5,
    ),
    block_size=st.integers(1, 24),
    end_id=st.one_of(st.none(), st.just(99)),
)
def test_pack_pairs_truncates_left_pads_right_and_scores_the_answer(pairs, block_size, end_id):
    tokens, mask = pack_pairs(pairs, block_size, pad_id=0, end_id=end_id)
    assert tokens.shape == (len(pairs), block_size + 1) and mask.shape == (len(pairs), block_size)
    for row, row_mask, (prompt, response) in zip(tokens, mask, pairs, strict=True):
        answer = [*response, end_id] if end_id is not None else list(response)
        ids = ([*prompt, *answer])[-(block_size + 1) :]
        assert row[: len(ids)].tolist() == ids and not row[len(ids) :].any()
        num_scored = int(row_mask.sum())
        assert num_scored == min(len(answer), max(len(ids) - 1, 0))
        if num_scored:
            assert row[1:][row_mask].tolist() == answer[-num_scored:]
            assert row_mask[len(ids) - 2] and not row_mask[len(ids) - 1 :].any()


def test_an_empty_example_without_an_end_token_scores_nothing():
    # A jsonl row {"q": "", "a": ""} read as bytes (no end-of-text token): nothing to learn from it.
    # (Before: num_answer = min(0, len([]) - 1) = -1 made the mask slice [0:-1], 7 padding targets.)
    tokens, mask = pack_pairs([([], [])], 8, pad_id=0, end_id=None)
    assert not tokens.any()
    assert not mask.any()


# --- identities -------------------------------------------------------------------------------------


def sha256_of(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def test_identities_say_what_each_kind_reads(tmp_path, prepared, bpe):
    tokens = tmp_path / "t.bin"
    (np.arange(30 * WIDTH) % 256).astype(np.uint16).tofile(tokens)
    cheap, full = DataHome(tokenizer=bpe), DataHome(tokenizer=bpe, full_identity=True)
    source = DataSource(kind="tokens", path=str(tokens))
    quick = dataset_identity("t", source, cheap)
    whole = dataset_identity("t", source, full)
    assert quick.kind == "tokens" and quick.num_tokens == 30 * WIDTH and quick.tokenizer == ""
    assert [f.path for f in quick.sources] == [str(tokens)] and quick.sources[0].sha256 == ""
    assert (
        whole.sources[0].sha256 == sha256_of(tokens)
        and whole.sources[0].fingerprint == quick.sources[0].fingerprint
    )

    mine = dataset_identity("p", DataSource(kind="tokens", path=str(prepared)), cheap)
    manifest = read_manifest(prepared)
    assert mine.prepared == manifest_hash(prepared) and mine.tokenizer == bpe.identity
    assert [f.sha256 for f in mine.sources] == [
        manifest.splits["train"].sha256
    ]  # from the manifest, not re-read
    assert [f.sha256 for f in mine.validation_sources] == [manifest.splits["validation"].sha256]
    assert mine.num_tokens == sum(f.num_tokens for f in manifest.splits.values())

    docs = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in DOCUMENTS])
    text_source = DataSource(kind="jsonl", path=docs)
    home = DataHome(tokenizer=bpe, data_dir=str(tmp_path / "data"), full_identity=True)
    open_user_dataset("docs", text_source, BLOCK, 320, home)
    text = dataset_identity("docs", text_source, home)
    assert [(f.path, f.sha256) for f in text.sources] == [
        (docs, sha256_of(docs))
    ]  # the documents, not tokens
    assert (
        text.prepared == manifest_hash(prepared_in(tmp_path / "data", "docs"))
        and text.tokenizer == bpe.identity
    )

    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS)
    qa = dataset_identity(
        "qa", DataSource(kind="jsonl", path=pairs, prompt_field="q", response_field="a"), full
    )
    assert (
        [f.sha256 for f in qa.sources] == [sha256_of(pairs)]
        and qa.prepared == ""
        and qa.tokenizer == bpe.identity
    )


def test_the_stdlib_placeholder_is_the_standard_library(tmp_path):
    stdlib = sysconfig.get_paths()["stdlib"]
    assert DataHome().resolve("{stdlib}/json/*.py") == f"{stdlib}/json/*.py"
    assert (
        DataHome(base_dir=str(tmp_path)).resolve("{stdlib}/json/decoder.py") == f"{stdlib}/json/decoder.py"
    )
    assert DataHome(base_dir=str(tmp_path)).resolve("docs.jsonl") == str(tmp_path / "docs.jsonl")
    assert DataHome(base_dir=str(tmp_path)).resolve("s3://bucket/x.bin") == "s3://bucket/x.bin"
    source = DataSource(kind="text", path="{stdlib}/json/*.py", validation_fraction=0.1)
    dataset = open_user_dataset("py", source, BLOCK, 256, DataHome(data_dir=str(tmp_path / "data")))
    files = sorted(glob.glob(f"{stdlib}/json/*.py"))
    total = (
        sum(len(Path(p).read_bytes()) for p in files) + len(files) - 1
    )  # the files' bytes, "\n" between them
    assert dataset.num_samples("train") + dataset.num_samples("validation") == total // WIDTH


def test_relative_paths_are_taken_against_the_config_file(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "c.toml").write_text(
        """
[training]
tokens = [1024]
datasets = [[{ name = "a" }]]
[data.a]
kind = "tokens"
path = "data/a.bin"
validation_path = "../held/out.bin"
[data.b]
kind = "text"
path = "{stdlib}/json/*.py"
[data.c]
kind = "jsonl"
path = "memory://bucket/c.jsonl"
[data.d]
kind = "tokens"
path = "/abs/d.bin"
[tokenizer]
path = "tok/tokenizer.json"
[pretrained]
path = "../weights.safetensors"
"""
    )
    monkeypatch.chdir(tmp_path)  # anywhere but the config's folder
    config = load_config("configs/c.toml")
    assert config.data["a"].path == str(folder / "data" / "a.bin")
    assert config.data["a"].validation_path == str(tmp_path / "held" / "out.bin")
    assert config.data["b"].path == "{stdlib}/json/*.py"
    assert config.data["c"].path == "memory://bucket/c.jsonl"
    assert config.data["d"].path == "/abs/d.bin"
    assert config.tokenizer.path == str(folder / "tok" / "tokenizer.json")
    assert config.pretrained.path == str(tmp_path / "weights.safetensors")


# --- built-in tasks through a tokenizer -------------------------------------------------------------


@pytest.fixture(scope="module")
def task_bpe() -> Tokenizer:
    rows = [task_sample(name, "train", i, 64)[0] for name in ("reverse", "sort", "add") for i in range(40)]
    texts = [bytes(r.astype(np.uint8)).decode("ascii").rstrip("\0") for r in rows]
    return train_bpe(texts, 400)


def expected_answer(prompt: str) -> str:
    task, _, operand = prompt.partition(" ")
    if task == "rev":
        return operand[::-1]
    if task == "sort":
        return "".join(sorted(operand))
    a, b = operand.split("+")
    return str(int(a) + int(b))


@pytest.mark.parametrize("name", ["reverse", "sort", "add"])
def test_task_rows_through_a_tokenizer_score_exactly_the_encoded_answers(task_bpe, name):
    config = Config(
        architecture=ArchitectureSection(block_size=40, vocab_size=400),
        stages=[PretrainStage(tokens=4096, datasets=[Sampling(name=name)])],
    )
    dataset = DatasetRegistry(config, DataHome(tokenizer=task_bpe))[name]
    assert isinstance(dataset, BuiltinDataset) and dataset.has_answers
    num_examples = 0
    for split in ("train", "validation"):
        for index in range(12):
            tokens, mask = dataset.sample(split, index)
            assert tokens.max() < task_bpe.vocab_size
            # Walk the row: a prompt (unscored targets up to its "="), then its answer (scored), again.
            position, targets = 0, tokens[1:]
            scored = np.flatnonzero(mask)
            runs = np.split(scored, np.flatnonzero(np.diff(scored) != 1) + 1) if scored.size else []
            assert runs, "every row holds at least one example"
            for run in runs:
                prompt = task_bpe.decode(tokens[position : run[0] + 1].tolist())
                assert prompt.endswith("=")
                answer_ids = targets[run].tolist()
                want = expected_answer(prompt[:-1]) + "\n"
                assert answer_ids == task_bpe.encode(want), (prompt, task_bpe.decode(answer_ids))
                position = run[-1] + 2
                num_examples += 1
            assert not tokens[position:].any()  # then padding only
    assert num_examples >= 24


@pytest.mark.parametrize("name", ["../../outside", "a/b"])
def test_a_dataset_name_that_is_a_path_never_names_a_directory(tmp_path, name):
    """Documents are tokenised into RUN/data/<name>-<key>: a name that is a path would lead out of it."""
    (tmp_path / "doc.txt").write_text(DOCUMENTS[0])
    source = DataSource(kind="text", path=str(tmp_path / "doc.txt"))
    home = DataHome(data_dir=str(tmp_path / "run" / "data"))
    with pytest.raises(DatasetError, match="a dataset's name must be a plain name"):
        open_user_dataset(name, source, BLOCK, 256, home)
    assert not (tmp_path / "outside").exists() and not (tmp_path / "run").exists()
