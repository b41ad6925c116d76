"""docs/data_prepare.md's commands run as written, in a temporary directory on small generated corpora, and
its configs train: the first example, and each way "Several corpora, one tokenizer" gives to one tokenizer.

Every `rewind` line of a ```sh block runs in-process (`rewind.tools.cli.main`) from the directory that holds
the inputs its globs name; a ```toml block that follows is the run's config, trained for two steps."""

from __future__ import annotations

import hashlib
import json
import random
import shlex

import pytest

from rewind.stores.datamanifest import read_manifest
from rewind.stores.runs import read_seq_events
from tests.docs.readme_figures import REPO
from tests.docs.test_snippets import Block, fenced_blocks

DOC = REPO / "docs" / "data_prepare.md"
SECTION = "## Several corpora, one tokenizer"

# Words each corpus is written in: different enough for two tokenizers trained apart to differ.
WORDS = {
    "books": "the cat sat on the mat while a dog slept by the warm fire",
    "web": "click here to read more about our latest offers and free shipping",
    "corpus": "a small model reads these lines and learns which word comes next",
}


def section_blocks(heading: str | None) -> list[Block]:
    """The fenced blocks under `heading` up to the next `## ` (None: before the first `## `)."""
    lines = DOC.read_text().splitlines()
    start = 0 if heading is None else lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return [block for block in fenced_blocks(DOC) if start < block.line <= end]


def commands(block: Block) -> list[list[str]]:
    assert block.lang == "sh", f"{block.where}: not a shell block"
    lines = [shlex.split(line) for line in block.text.splitlines() if line.strip()]
    assert lines and all(words[0] == "rewind" for words in lines), f"{block.where}: {block.text}"
    return [words[1:] for words in lines]


def write_inputs(root, argv: list[str]) -> None:
    """Two jsonl files for each glob (or one for each file name) a command names, in its corpus's words."""
    for word in argv:
        if not word.endswith(".jsonl"):
            continue
        words = next((w for name, w in WORDS.items() if word.startswith(name)), WORDS["corpus"]).split()
        names = [word.replace("*", f"part-{i}") for i in range(2)] if "*" in word else [word]
        for name in names:
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            draw = random.Random(f"{name}")
            lines = [" ".join(draw.choices(words, k=12)) for _ in range(200)]
            path.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines), encoding="utf-8")


def run_block(block: Block, root, rewind_cli) -> None:
    for argv in commands(block):
        write_inputs(root, argv)
        code, _, err = rewind_cli(*argv)
        assert code == 0, f"{block.where}: rewind {shlex.join(argv)}: {err}"


def train(config_text: str, root, rewind_cli) -> str:
    """Train the config for two steps; the sha256 of the tokenizer the run recorded."""
    (root / "run.toml").write_text(config_text, encoding="utf-8")
    code, _, err = rewind_cli("train", "run.toml", "--run-dir", "run", "--max-steps", "2", "--no-progress")
    assert code == 0, err
    started = read_seq_events(str(root / "run"))[0][1]
    assert hashlib.sha256((root / "run" / "data" / "tokenizer.json").read_bytes()).hexdigest() == started.tokenizer
    return started.tokenizer


def test_the_first_example_prepares_the_directory_it_describes_and_trains(tmp_path, monkeypatch, rewind_cli):
    monkeypatch.chdir(tmp_path)
    prepare, config = section_blocks(None)
    run_block(prepare, tmp_path, rewind_cli)
    listing = next(b for b in section_blocks("## The prepared directory") if b.lang == "")
    listed = [line.split()[0].removeprefix("DIR/") for line in listing.text.splitlines() if line.startswith("DIR/")]
    assert sorted(p.name for p in (tmp_path / "prepared" / "corpus").iterdir()) == sorted(listed)
    # The example's fragment, with a stage that reads its dataset and room for its tokenizer's ids.
    stage = '\n[[stages]]\ntokens = 2048\ndatasets = [{ name = "corpus" }]\n'
    tokenizer = train(f"[architecture]\nvocab_size = 8192\n{config.text}{stage}", tmp_path, rewind_cli)
    assert tokenizer == read_manifest(tmp_path / "prepared" / "corpus").tokenizer


@pytest.mark.parametrize("way", [0, 1], ids=["the-first-corpus-tokenizer", "one-trained-on-all"])
def test_each_way_to_one_tokenizer_prepares_corpora_that_one_run_trains_on(tmp_path, monkeypatch, rewind_cli, way):
    monkeypatch.chdir(tmp_path)
    blocks = section_blocks(SECTION)
    assert [b.lang for b in blocks] == ["sh", "sh", "toml"], [b.where for b in blocks]
    run_block(blocks[way], tmp_path, rewind_cli)
    books, web = read_manifest(tmp_path / "prepared" / "books"), read_manifest(tmp_path / "prepared" / "web")
    shared = books.tokenizer
    assert shared and web.tokenizer == shared
    if way == 1:  # trained on both corpora: the tokenizer of the directory of both
        assert read_manifest(tmp_path / "prepared" / "all").tokenizer == shared
        assert {s.path.split("/")[-2] for s in read_manifest(tmp_path / "prepared" / "all").sources} == {"books", "web"}
    assert train(blocks[2].text, tmp_path, rewind_cli) == shared
    started = read_seq_events(str(tmp_path / "run"))[0][1]
    assert set(started.data) == {"books", "web"}


def test_each_corpus_with_a_tokenizer_of_its_own_gives_two_tokenizers(tmp_path, monkeypatch, rewind_cli):
    """What the section starts from: the same corpora prepared each with --train-tokenizer differ."""
    monkeypatch.chdir(tmp_path)
    first = commands(section_blocks(SECTION)[0])
    apart = [first[0], [*first[1][: first[1].index("--tokenizer")], "--train-tokenizer", "8192"]]
    for argv in apart:
        write_inputs(tmp_path, argv)
        assert rewind_cli(*argv)[0] == 0
    books, web = read_manifest(tmp_path / "prepared" / "books"), read_manifest(tmp_path / "prepared" / "web")
    assert books.tokenizer and web.tokenizer and books.tokenizer != web.tokenizer
