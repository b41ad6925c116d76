"""What a new user's review of the data commands found, kept fixed: a failed start writes nothing, an export
and a pretrained start never pair weights with a tokenizer they did not learn, `rewind eval` reads only the
dataset it scores and writes nothing, `fork --set` paths are the user's, `verify --data` re-hashes the
pretrained weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engine.test_loop import one_line, one_torch_thread, run_cli
from tests.tools.test_data_runs import token_setup, train, write_config

DOCUMENTS = """
[tokenizer]
train_vocab_size = 300
[data.docs]
kind = "text"
path = "txt/*.txt"
"""


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def documents_setup(folder: Path, **config) -> Path:
    (folder / "txt").mkdir(parents=True, exist_ok=True)
    for i in range(3):
        words = " ".join(f"word{(i * 7 + j) % 23} line{j % 5}" for j in range(400))
        (folder / "txt" / f"{i}.txt").write_text(words + "\n", encoding="utf-8")
    path = write_config(folder, vocab_size=320, datasets='{ name = "docs" }', extra=DOCUMENTS, **config)
    path.write_text(path.read_text().replace("d_model = 32", 'd_model = 32\nmlp = "swiglu"'))  # (a Llama: --hf)
    return path


def train_ok(config: Path, run: Path) -> None:
    code, _, err = train(config, run)
    assert code == 0, err


def test_a_start_that_fails_on_its_data_writes_nothing(tmp_path):
    config = documents_setup(tmp_path)
    text = config.read_text() + '\n[data.qa]\nkind = "jsonl"\npath = "missing.jsonl"\nprompt_field = "q"\nresponse_field = "a"\n'
    config.write_text(text.replace('evaluations = []', 'evaluations = ["qa"]'))
    code, _, err = train(config, tmp_path / "run")
    assert code == 2 and one_line(err) and "missing.jsonl" in err
    assert not (tmp_path / "run").exists()  # the tokenizer was trained and the documents tokenised elsewhere


def test_an_export_refuses_a_tokenizer_file_the_run_did_not_record(tmp_path):
    config = documents_setup(tmp_path, steps=4)
    train_ok(config, tmp_path / "run")
    (tmp_path / "run" / "data" / "tokenizer.json").unlink()
    code, _, err = run_cli("export", tmp_path / "run", "--to", tmp_path / "w.safetensors", "--hf", tmp_path / "hf")
    assert code == 1 and one_line(err) and "not the tokenizer the run recorded (missing" in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "w.safetensors").exists()


def test_a_pretrained_start_keeps_the_tokenizer_its_weights_learned(tmp_path):
    config = documents_setup(tmp_path, steps=4)
    train_ok(config, tmp_path / "base")
    assert run_cli("export", tmp_path / "base", "--hf", tmp_path / "hf", "--to", tmp_path / "w.safetensors")[0] == 0
    base_tokenizer = json.loads((tmp_path / "base" / "data" / "tokenizer.json").read_text())
    # From the transformers directory, without a [tokenizer]: its tokenizer is adopted.
    tokens = token_setup(tmp_path / "t", vocab_size=320, steps=2)
    tokens.write_text(tokens.read_text().replace("d_model = 32", 'd_model = 32\nmlp = "swiglu"'))
    adopting = tokens.read_text().replace("[data.corpus]", '[pretrained]\npath = "../hf"\n[data.corpus]')
    tokens.write_text(adopting)
    code, _, err = train(tokens, tmp_path / "t" / "run")
    assert code == 0, err
    assert json.loads((tmp_path / "t" / "run" / "data" / "tokenizer.json").read_text()) == base_tokenizer
    # From the --to file, on UTF-8 bytes: refused (the file says which tokenizer its ids belong to).
    refusing = tokens.read_text().replace('path = "../hf"', 'path = "../w.safetensors"')
    tokens.write_text(refusing)
    code, _, err = train(tokens, tmp_path / "t" / "run2")
    assert code == 2 and one_line(err) and "was trained with tokenizer" in err
    assert not (tmp_path / "t" / "run2").exists()


def test_eval_reads_only_the_dataset_it_scores_and_writes_nothing(tmp_path):
    config = documents_setup(tmp_path, steps=4, block_size=24)
    text = config.read_text().replace('datasets = [[{ name = "docs" }]]', 'datasets = [[{ name = "docs", rate = 0.5 }, { name = "add", rate = 0.5 }]]')
    config.write_text(text)
    train_ok(config, tmp_path / "run")
    (tmp_path / "txt").rename(tmp_path / "gone")  # the documents' sources move away
    before = sorted(p.relative_to(tmp_path / "run") for p in (tmp_path / "run").rglob("*"))
    code, out, err = run_cli("eval", tmp_path / "run", "--dataset", "add")
    assert code == 0, err
    assert "accuracy" in out
    code, _, err = run_cli("eval", tmp_path / "run", "--dataset", "docs")
    assert code == 1 and one_line(err) and "dataset 'docs'" in err and f"verify --data {tmp_path / 'run'}" in err
    assert sorted(p.relative_to(tmp_path / "run") for p in (tmp_path / "run").rglob("*")) == before


def test_fork_set_paths_are_taken_from_where_the_user_stands(tmp_path, monkeypatch):
    config = token_setup(tmp_path, steps=8)
    train_ok(config, tmp_path / "run")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "corpus.bin").write_bytes((tmp_path / "corpus.bin").read_bytes())
    monkeypatch.chdir(tmp_path / "other")
    code, _, err = run_cli("fork", tmp_path / "run", tmp_path / "child", "--at-step", "4", "--set", 'data.corpus.path="corpus.bin"')
    assert code == 0, err
    from rewind.stores.runs import read_seq_events

    started = read_seq_events(str(tmp_path / "child"))[0][1]
    assert started.config.data["corpus"].path == str(tmp_path / "other" / "corpus.bin")


def test_verify_data_rehashes_the_pretrained_weights(tmp_path):
    config = token_setup(tmp_path / "a", steps=4)
    train_ok(config, tmp_path / "a" / "run")
    assert run_cli("export", tmp_path / "a" / "run", "--to", tmp_path / "w.safetensors")[0] == 0
    child = token_setup(tmp_path / "b", steps=4)
    child.write_text(child.read_text().replace("[data.corpus]", '[pretrained]\npath = "../w.safetensors"\n[data.corpus]'))
    train_ok(child, tmp_path / "b" / "run")
    assert run_cli("verify", tmp_path / "b" / "run", "--data")[0] == 0
    other = ("--to", tmp_path / "w.safetensors", "--overwrite")
    assert run_cli("export", tmp_path / "b" / "run", *other)[0] == 0  # other weights now
    code, out, _ = run_cli("verify", tmp_path / "b" / "run", "--data")
    assert code == 1 and "data: pretrained:" in out
