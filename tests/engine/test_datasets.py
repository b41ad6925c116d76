"""Built-in tasks (content, masks, splits) and user datasets (token files, JSONL) with their errors."""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.engine.data import datasets as datasets_module
from rewind.engine.data.datasets import DatasetError
from rewind.engine.data.registry import DatasetRegistry, open_dataset
from rewind.engine.data.tasks import TASK_NAMES, task_sample
from rewind.engine.data.userdata import DataHome
from rewind.states.config import BUILTIN_DATASETS, ArchitectureSection, Config, DataSource

# The carving of runs started before random validation splits: the last windows are validation.
TAIL = DataHome(default_split="tail")

BLOCK = 64


def make_config(block_size: int = BLOCK, vocab_size: int = 256, **data: DataSource) -> Config:
    return Config(architecture=ArchitectureSection(block_size=block_size, vocab_size=vocab_size), data=data)


def text_of(tokens: np.ndarray) -> str:
    return bytes(tokens.astype(np.uint8)).decode("ascii")


def expected_answer(prompt: str) -> str:
    task, _, operand = prompt.partition(" ")
    if task == "rev":
        return operand[::-1]
    if task == "sort":
        return "".join(sorted(operand))
    assert task == "add"
    a, b = operand.split("+")
    return str(int(a) + int(b))


def examples(tokens: np.ndarray) -> list[tuple[str, str]]:
    """(prompt, answer) per line of a packed task row; the answer without its newline."""
    lines = text_of(tokens).rstrip("\0").split("\n")
    assert lines[-1] == "", "a row ends with a complete example"
    return [(prompt, answer) for prompt, _, answer in (line.partition("=") for line in lines[:-1])]


def scored_text(tokens: np.ndarray, loss_mask: np.ndarray) -> str:
    """The row's targets as text, "_" where the loss mask is off."""
    return "".join(chr(tokens[t + 1]) if loss_mask[t] else "_" for t in range(len(loss_mask)))


def test_builtin_registry_matches_config_names():
    assert TASK_NAMES == BUILTIN_DATASETS
    assert set(DatasetRegistry(make_config())) == set(BUILTIN_DATASETS)


@pytest.mark.parametrize("name", TASK_NAMES)
def test_task_rows_are_deterministic_and_well_formed(name):
    tokens, loss_mask = task_sample(name, "train", 17, BLOCK)
    again_tokens, again_mask = task_sample(name, "train", 17, BLOCK)
    assert np.array_equal(tokens, again_tokens) and np.array_equal(loss_mask, again_mask)
    assert tokens.dtype == np.int64 and tokens.shape == (BLOCK + 1,)
    assert loss_mask.dtype == np.bool_ and loss_mask.shape == (BLOCK,)
    assert tokens.max() < 128
    assert not np.array_equal(tokens, task_sample(name, "train", 18, BLOCK)[0])
    if name == "grammar":
        assert loss_mask.all() and (tokens > 0).all()


@pytest.mark.parametrize("name", ["reverse", "sort", "add"])
@pytest.mark.parametrize("split", ["train", "validation"])
def test_task_answers_are_correct_and_only_answers_are_scored(name, split):
    for index in range(40):
        tokens, loss_mask = task_sample(name, split, index, BLOCK)
        found = examples(tokens)
        assert found, "a row holds at least one example"
        for prompt, answer in found:
            assert answer == expected_answer(prompt)
        # Scored: each answer and its newline. Unscored: prompts, their "=", and the padding.
        packed = "".join("_" * (len(prompt) + 1) + answer + "\n" for prompt, answer in found)
        expected = packed[1:] + "_" * (BLOCK + 1 - len(packed))
        assert scored_text(tokens, loss_mask) == expected
        assert (tokens[len(packed) :] == 0).all()


@pytest.mark.parametrize("name", ["reverse", "sort", "add"])
def test_validation_inputs_never_appear_in_train(name):
    def prompts(split: str, count: int) -> set[str]:
        return {p for i in range(count) for p, _ in examples(task_sample(name, split, i, BLOCK)[0])}

    validation = prompts("validation", 256)
    assert len(validation) > 100
    assert not validation & prompts("train", 2000)


def test_grammar_splits_differ_and_text_looks_like_sentences():
    train = text_of(task_sample("grammar", "train", 0, 256)[0])
    validation = text_of(task_sample("grammar", "validation", 0, 256)[0])
    assert train != validation
    assert train[0].isupper() and ". " in train


def test_grammar_has_a_few_hundred_words():
    words = set()
    for index in range(300):
        text = text_of(task_sample("grammar", "train", index, 256)[0])
        words.update(w.strip('.,?"').lower() for w in text.split()[:-1])
    assert len(words) > 250


def test_builtin_dataset_sizes_and_batch():
    dataset = open_dataset("add", make_config())
    assert dataset.num_samples("train") == 2**20 and dataset.num_samples("validation") == 256
    assert open_dataset("grammar", make_config()).num_samples("train") == 2**31 - 1
    tokens, loss_mask = dataset.batch("validation", [3, 1])
    assert tokens.dtype == torch.long and tokens.shape == (2, BLOCK + 1)
    assert loss_mask.dtype == torch.bool and loss_mask.shape == (2, BLOCK)
    assert torch.equal(tokens[1], torch.from_numpy(dataset.sample("validation", 1)[0]))
    with pytest.raises(IndexError):
        dataset.sample("validation", 256)
    with pytest.raises(ValueError, match="split"):
        dataset.num_samples("test")


def test_builtin_task_needs_room_for_one_example():
    with pytest.raises(DatasetError, match=r"'sort'.*block_size"):
        open_dataset("sort", make_config(block_size=8))
    with pytest.raises(DatasetError, match="vocab_size"):
        open_dataset("grammar", make_config(vocab_size=64))


def write_tokens(path, values, dtype="uint16") -> None:
    np.asarray(values, dtype=dtype).tofile(path)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows_and_splits(tmp_path, dtype):
    path = tmp_path / "tokens.bin"
    values = np.arange(10 * 9 + 5) % 250  # 10 windows of 9 tokens, plus a dropped partial window
    write_tokens(path, values, dtype)
    source = DataSource(kind="tokens", path=str(path), dtype=dtype, validation_fraction=0.2)
    dataset = open_dataset("mine", make_config(block_size=8, toks=source, mine=source), TAIL)
    assert (dataset.num_samples("train"), dataset.num_samples("validation")) == (8, 2)
    tokens, loss_mask = dataset.sample("train", 3)
    assert np.array_equal(tokens, values[27:36]) and tokens.dtype == np.int64 and loss_mask.all()
    assert np.array_equal(dataset.sample("validation", 0)[0], values[72:81])  # the last windows
    batch_tokens, batch_mask = dataset.batch("validation", np.array([1, 0]))
    assert torch.equal(batch_tokens, torch.from_numpy(np.stack([values[81:90], values[72:81]])))
    assert batch_mask.shape == (2, 8) and batch_mask.all()


def test_jsonl_round_trip_and_relative_path(tmp_path):
    documents = ["Hello, wörld!", "second document " * 5, "third"]
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(documents)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines[:2]) + "\n\n" + lines[2] + "\n", encoding="utf-8")
    source = DataSource(kind="jsonl", path="docs.jsonl", validation_fraction=0.25)
    dataset = open_dataset("docs", make_config(block_size=7, docs=source), DataHome(base_dir=str(tmp_path), default_split="tail"))
    stream = "\n".join(documents).encode("utf-8")
    num_windows = len(stream) // 8
    assert dataset.num_samples("train") + dataset.num_samples("validation") == num_windows
    rows = [dataset.sample("train", i)[0] for i in range(dataset.num_samples("train"))]
    rows += [dataset.sample("validation", i)[0] for i in range(dataset.num_samples("validation"))]
    assert bytes(np.concatenate(rows).astype(np.uint8)) == stream[: num_windows * 8]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"text": "ok ok ok ok ok"}\n{"body": "no text"}\n', r"docs\.jsonl:2: no 'text' field"),
        ('{"text": "ok ok ok ok ok"}\n{"text": \n', r"docs\.jsonl:2: not valid JSON"),
        ('["text"]\n', r"docs\.jsonl:1: a JSON list, not an object"),
        ('{"text": 5}\n', r"docs\.jsonl:1: field 'text' is int"),
        ("", "no documents"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path, content, match):
    (tmp_path / "docs.jsonl").write_text(content)
    source = DataSource(kind="jsonl", path=str(tmp_path / "docs.jsonl"))
    with pytest.raises(DatasetError, match=match):
        open_dataset("docs", make_config(block_size=4, docs=source))


def test_token_file_errors(tmp_path):
    def opened(values, block_size=8, vocab_size=256, name="t.bin", fraction=0.5):
        path = tmp_path / name
        if values is not None:
            write_tokens(path, values)
        source = DataSource(kind="tokens", path=str(path), validation_fraction=fraction)
        return open_dataset("toks", make_config(block_size, vocab_size, toks=source), TAIL)

    with pytest.raises(DatasetError, match=r"'toks'.*t\.bin: file not found"):
        opened(None)
    with pytest.raises(DatasetError, match="too small"):
        opened(np.arange(8))  # fewer tokens than one window
    with pytest.raises(DatasetError, match=r"too small: .* 0 for validation"):
        opened(np.arange(9 * 10), fraction=0.05)  # 10 windows, 5% of them rounds down to none
    with pytest.raises(DatasetError, match="too small"):
        opened([])
    with pytest.raises(DatasetError, match=r"token id 300 is outside architecture\.vocab_size 256"):
        opened([*range(17), 300])
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DatasetError, match="not a multiple of 2"):
        opened(None, name="odd.bin")
    (tmp_path / "folder.bin").mkdir()
    with pytest.raises(DatasetError, match=r"folder\.bin: is a directory"):
        opened(None, name="folder.bin")


def test_unreadable_file(tmp_path, monkeypatch):
    path = tmp_path / "secret.jsonl"
    path.write_text('{"text": "x"}\n')

    real_open = os.open

    def refuse(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    # chmod 0 does not stop root (CI containers), so refuse the open itself (user files are opened
    # through os.open, as regular files only: stores.fsio.open_regular).
    monkeypatch.setattr(os, "open", refuse)
    source = DataSource(kind="jsonl", path=str(path))
    with pytest.raises(DatasetError, match=r"secret\.jsonl: cannot read: Permission denied"):
        open_dataset("docs", make_config(docs=source))


def test_large_files_are_vocab_checked_as_rows_are_read(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets_module, "EAGER_VOCAB_CHECK_TOKENS", 0)
    values = np.arange(9 * 4) % 100
    values[30] = 1000
    write_tokens(tmp_path / "t.bin", values)
    source = DataSource(kind="tokens", path=str(tmp_path / "t.bin"), validation_fraction=0.5)
    dataset = open_dataset("toks", make_config(8, 256, toks=source), TAIL)  # opens: not scanned yet
    assert dataset.sample("train", 0)[0].max() < 256
    with pytest.raises(DatasetError, match="token id 1000"):
        dataset.batch("validation", [1])


def test_unknown_dataset_and_registry_cache(tmp_path):
    config = make_config(missing=DataSource(kind="tokens", path=str(tmp_path / "nope.bin")))
    with pytest.raises(DatasetError, match="'nothing': unknown"):
        open_dataset("nothing", config)
    registry = DatasetRegistry(config)
    assert "missing" in registry and "nothing" not in registry  # membership opens nothing
    assert registry["grammar"] is registry["grammar"]
    with pytest.raises(KeyError):
        registry["nothing"]
    with pytest.raises(DatasetError, match="file not found"):
        registry["missing"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=20, max_size=200), st.integers(1, 6))
def test_token_windows_partition_the_file(values, block_size):
    # Property: train rows, then validation rows, read back the file's full windows in order.
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "t.bin")
        write_tokens(path, values)
        source = DataSource(kind="tokens", path=path, validation_fraction=0.5)
        try:
            dataset = open_dataset("t", make_config(block_size, 256, t=source), TAIL)
        except DatasetError:
            assert len(values) // (block_size + 1) < 2
            return
        rows = [
            dataset.sample(s, i)[0] for s in ("train", "validation") for i in range(dataset.num_samples(s))
        ]
        window = block_size + 1
        assert np.array_equal(np.concatenate(rows), np.asarray(values)[: len(rows) * window])
        assert len(rows) == len(values) // window
