"""Issue 32, point 8, as a user meets it: two corpora each prepared with `--train-tokenizer`, one run on both.

The run is refused in one line that gives the `rewind data prepare` command sharing one tokenizer (not
`[tokenizer] path` set to the other one, which only moved the clash), nothing is written, and once that
command has run the same run trains."""

from __future__ import annotations

import json
import shlex

from rewind.stores.datamanifest import read_manifest

CONFIG = """
[architecture]
vocab_size = 512
block_size = 16
d_model = 32
num_heads = 2
num_layers = 1

[training]
batch_size = 4

[data.books]
kind = "tokens"
path = "prepared/books"

[data.web]
kind = "tokens"
path = "prepared/web"

[[stages]]
tokens = 1024
datasets = [{ name = "books", rate = 0.5 }, { name = "web", rate = 0.5 }]
"""


def corpora(root, rewind_cli) -> None:
    for name, words in (("books", "the cat sat on a mat by the fire"), ("web", "click here for free offers today")):
        lines = [" ".join(words.split()[i % 4 :] + words.split()[: i % 4]) + f" {i}" for i in range(300)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines), encoding="utf-8")
        code, _, err = rewind_cli("data", "prepare", f"{name}.jsonl", "--out", f"prepared/{name}", "--train-tokenizer", "400")
        assert code == 0, err
    assert read_manifest(root / "prepared/books").tokenizer != read_manifest(root / "prepared/web").tokenizer


def refused_with_a_command(root, rewind_cli) -> list[str]:
    code, out, err = rewind_cli("train", "run.toml", "--run-dir", "run", "--max-steps", "1", "--no-progress")
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, err
    assert not (root / "run").exists()  # nothing written
    line = lines[0]
    assert "[tokenizer] path to" not in line and 'docs/data_prepare.md, "Several corpora, one tokenizer"' in line
    return shlex.split(line[line.rindex(": rewind data prepare ") + 2 :])[1:]


def test_two_corpora_with_their_own_tokenizers_are_refused_with_the_command_that_shares_one(
    tmp_path, monkeypatch, rewind_cli
):
    monkeypatch.chdir(tmp_path)
    corpora(tmp_path, rewind_cli)
    (tmp_path / "run.toml").write_text(CONFIG, encoding="utf-8")
    command = refused_with_a_command(tmp_path, rewind_cli)
    books = tmp_path / "prepared" / "books"
    assert command == ["data", "prepare", str(tmp_path / "web.jsonl"), "--out", str(tmp_path / "prepared" / "web"),
                       "--tokenizer", str(books), "--overwrite"]  # fmt: skip
    assert rewind_cli(*command)[0] == 0
    code, _, err = rewind_cli("train", "run.toml", "--run-dir", "run", "--max-steps", "1", "--no-progress")
    assert code == 0, err


def test_naming_one_of_them_as_the_runs_tokenizer_is_refused_with_the_command_for_the_other(
    tmp_path, monkeypatch, rewind_cli
):
    # What the old hint said to do: [tokenizer] path = the first's. The second is then the clash.
    monkeypatch.chdir(tmp_path)
    corpora(tmp_path, rewind_cli)
    named = tmp_path / "prepared" / "books" / "tokenizer.json"
    (tmp_path / "run.toml").write_text(f'[tokenizer]\npath = "{named}"\n{CONFIG}', encoding="utf-8")
    command = refused_with_a_command(tmp_path, rewind_cli)
    assert command == ["data", "prepare", str(tmp_path / "web.jsonl"), "--out", str(tmp_path / "prepared" / "web"),
                       "--tokenizer", str(named), "--overwrite"]  # fmt: skip
    assert rewind_cli(*command)[0] == 0
    code, _, err = rewind_cli("train", "run.toml", "--run-dir", "run", "--max-steps", "1", "--no-progress")
    assert code == 0, err
