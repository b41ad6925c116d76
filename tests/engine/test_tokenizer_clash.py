"""Datasets prepared with different tokenizers: the error gives the command that makes them share one, and
that command does (issue 32: the old hint, set `[tokenizer] path` to the other one, only moved the clash)."""

from __future__ import annotations

import json
import shlex

import pytest

from rewind.engine.data.dataprep import prepare
from rewind.engine.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from rewind.engine.data.tokenizer_clash import (
    GUIDE,
    MAX_FILES_SHOWN,
    prepare_again,
    tokenised_by_another,
    tokenizers_differ,
)
from rewind.stores.datamanifest import read_manifest

BOOKS = ["The cat sat on the mat.", "The dog sat on the log.", "A bird sang on the wire."] * 4
WEB = ["lorem ipsum dolor sit amet", "consectetur adipiscing elit", "sed do eiusmod tempor"] * 4


@pytest.fixture
def two_corpora(tmp_path):
    """Two corpora, each prepared with a tokenizer trained on itself (as --train-tokenizer does)."""
    (tmp_path / "books.txt").write_text("\n".join(BOOKS), encoding="utf-8")
    (tmp_path / "web.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in WEB), encoding="utf-8")
    (tmp_path / "held.jsonl").write_text(json.dumps({"body": "sit amet elit"}) + "\n", encoding="utf-8")
    books, web = tmp_path / "prepared" / "books", tmp_path / "prepared" / "web"
    prepare([str(tmp_path / "books.txt")], books, train_bpe(BOOKS, 280), kind="text")
    prepare([str(tmp_path / "web.jsonl")], web, train_bpe(WEB, 270), kind="jsonl", text_field="body",
            validation_inputs=[str(tmp_path / "held.jsonl")])
    return tmp_path, books, web


def command_of(message: str) -> list[str]:
    """The rewind arguments of the command a message ends with."""
    words = shlex.split(message[message.rindex(": rewind data prepare ") + 2 :])
    assert words[0] == "rewind"
    return words[1:]


def test_the_message_names_both_tokenizers_and_the_command_that_shares_the_first(two_corpora, rewind_cli):
    root, books, web = two_corpora
    first, second = read_manifest(books).tokenizer, read_manifest(web).tokenizer
    message = tokenizers_differ({"books": str(books), "web": str(web)})
    assert message == (
        f"the prepared datasets come with different tokenizers ('books': {first[:12]}, 'web': {second[:12]}), and a "
        f"run reads every dataset with one ({GUIDE}): prepare 'web' again with the tokenizer of 'books': "
        f"rewind data prepare {root / 'web.jsonl'} --validation {root / 'held.jsonl'} --text-field body "
        f"--out {web} --tokenizer {books} --overwrite"
    )
    # The command does what the message says: both directories hold the first's ids now.
    exit_code, _, err = rewind_cli(*command_of(message))
    assert exit_code == 0, err
    assert read_manifest(web).tokenizer == first and read_manifest(web).splits["validation"].num_documents == 1
    assert read_manifest(web).text_field == "body" and read_manifest(books).tokenizer == first


def test_the_weights_tokenizer_is_the_one_kept(two_corpora, rewind_cli):
    root, books, web = two_corpora
    weights = root / "model" / "tokenizer.json"
    weights.parent.mkdir()
    tokenizer = train_bpe(BOOKS + WEB, 300)
    weights.write_text(tokenizer.to_json(), encoding="utf-8")
    message = tokenizers_differ({"books": str(books), "web": str(web)}, (tokenizer.identity, str(weights)))
    assert message.startswith(
        f"the pretrained weights and the prepared datasets come with different tokenizers (the weights': "
        f"{tokenizer.identity[:12]}, 'books': "
    )
    assert ": prepare 'books' and 'web' again with the pretrained weights' tokenizer: rewind data prepare " in message
    commands = message[message.index(": rewind data prepare ") + 2 :].split(" && ")
    assert len(commands) == 2 and all(f"--tokenizer {weights} --overwrite" in c for c in commands)
    for command in commands:
        assert rewind_cli(*shlex.split(command)[1:])[0] == 0
    assert read_manifest(books).tokenizer == read_manifest(web).tokenizer == tokenizer.identity


def test_a_dataset_tokenised_by_another_than_the_run_gets_the_command_for_the_runs(two_corpora, rewind_cli):
    _, books, web = two_corpora
    run_tokenizer = load_tokenizer(books / "tokenizer.json")  # the run's: [tokenizer] path, as a user sets it
    message = tokenised_by_another("web", str(web), read_manifest(web), run_tokenizer)
    assert message.startswith(
        f"dataset 'web': {web} was tokenised by {read_manifest(web).tokenizer[:12]}, the run's tokenizer is "
        f"{run_tokenizer.identity[:12]}, and a run reads every dataset with one ({GUIDE}): prepare it with the run's: "
    )
    assert message.endswith(f"--out {web} --tokenizer {books / 'tokenizer.json'} --overwrite")
    assert rewind_cli(*command_of(message))[0] == 0
    assert read_manifest(web).tokenizer == run_tokenizer.identity

    # A run on UTF-8 bytes: prepared as bytes (no --tokenizer).
    message = tokenised_by_another("books", str(books), read_manifest(books), ByteTokenizer())
    assert "the run's tokenizer is UTF-8 bytes" in message and message.endswith(f"--out {books} --overwrite")
    assert rewind_cli(*command_of(message))[0] == 0 and read_manifest(books).tokenizer == ""

    # A tokenizer the run trains at its start has no file yet: name the directory's instead.
    trained = train_bpe(WEB, 290)
    message = tokenised_by_another("web", str(web), read_manifest(web), trained)
    assert f'set [tokenizer] path = "{web}/tokenizer.json" in place of train_vocab_size' in message


def test_the_command_keeps_kind_and_names_many_files_as_info_lists_them(tmp_path):
    for i in range(MAX_FILES_SHOWN + 1):
        (tmp_path / f"part{i}.data").write_text(f"document {i}", encoding="utf-8")
    prepare([str(tmp_path / "part0.data")], tmp_path / "one", kind="text")
    command = prepare_again(str(tmp_path / "one"), read_manifest(tmp_path / "one"), None)
    assert command == f"rewind data prepare {tmp_path / 'part0.data'} --out {tmp_path / 'one'} --overwrite"

    (tmp_path / "a b.txt").write_text("one", encoding="utf-8")  # a name the shell would split: quoted
    (tmp_path / "doc.jsonl").write_text('{"text": "a line"}\n', encoding="utf-8")
    prepare([str(tmp_path / "a b.txt"), str(tmp_path / "doc.jsonl")], tmp_path / "mixed", kind="text")
    command = prepare_again(str(tmp_path / "mixed"), read_manifest(tmp_path / "mixed"), str(tmp_path / "t.json"))
    assert shlex.split(command) == [
        "rewind", "data", "prepare", str(tmp_path / "a b.txt"), str(tmp_path / "doc.jsonl"), "--kind", "text",
        "--out", str(tmp_path / "mixed"), "--tokenizer", str(tmp_path / "t.json"), "--overwrite",
    ]  # fmt: skip

    prepare([str(tmp_path / "*.data")], tmp_path / "many", kind="text")
    command = prepare_again(str(tmp_path / "many"), read_manifest(tmp_path / "many"), None)
    assert command == (
        f"rewind data prepare INPUTS... --out {tmp_path / 'many'} --overwrite (the {MAX_FILES_SHOWN + 1} files "
        f"`rewind data info {tmp_path / 'many'}` lists)"
    )
