"""Every snippet in README.md and docs/**/*.md is what it claims to be, so a doc example cannot drift.

- A ```toml block is parsed (tomllib) and loaded by rewind's own reader (`loads_config`, pure: no file is
  opened) as what it shows: a whole config when it has stages and other sections, else a fragment (a
  `[[stages]]` record, a `[data.NAME]` or `[architecture]` table, ...) placed into a minimal config: two
  pretrain stages first, and one more after its last stage when that stage fades into a next one.
- A command line (every line of a ```bash / ```sh / ```console block, and a `$ ` line in any block) that
  runs rewind (`rewind ...`, `.venv/bin/rewind ...`, `python -m rewind ...`, `torchrun ... -m rewind ...`)
  parses with the CLI's own parser: its command and every option exist, its values have their types.
- A ```python block compiles.

A failure names the file and the line of the block's opening fence.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import tomllib
from pathlib import Path
from typing import NamedTuple

import pytest

from rewind.states.config import ConfigError
from rewind.states.config_reading import loads_config, multiline_table_hint
from rewind.tools.cli import build_parser
from tests.docs.readme_figures import REPO, doc_pages

DOCS = doc_pages()  # README.md and every page under docs/, subfolders included
SHELL = {"bash", "sh", "shell", "console"}
_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")

# What a fragment is placed into: stages for a [[stages]] record to follow (its index is then 2, so
# rules about stage 0 and "the stage before" apply as in a real curriculum) and for `[[growth]]` to name.
BASE = """
[[stages]]
tokens = 5120
datasets = [{ name = "grammar" }]

[[stages]]
tokens = 5120
datasets = [{ name = "reverse" }]
"""
AFTER = """
[[stages]]
tokens = 5120
datasets = [{ name = "sort" }]
"""


class Block(NamedTuple):
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, with its language ("" when none)."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence = opening.group(1)
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), None)
        assert end is not None, f"{path.relative_to(REPO)}:{i + 1}: a fenced block that is never closed"
        blocks.append(Block(path, i + 1, opening.group(2).lower(), "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return blocks


BLOCKS = [block for path in DOCS for block in fenced_blocks(path)]


def in_a_config(text: str) -> str:
    """The TOML text to load for a block: itself when it is a whole config, else the fragment placed into
    the minimal config."""
    raw = tomllib.loads(text)
    if "stages" in raw and set(raw) - {"stages"}:
        return text
    stages = raw.get("stages", [])
    # A stage that gives `overlap` (0.0 too) is one with a next stage.
    fades_on = bool(stages) and "overlap" in stages[-1]
    # The fragment's own tables follow the base's stages; a stage after it goes last, as its own record.
    return BASE + "\n" + text + ("\n" + AFTER if fades_on else "")


def rewind_argv(words: list[str]) -> list[str] | None:
    """The arguments rewind gets from one command's words, or None when the command is not rewind."""
    if not words:
        return None
    if Path(words[0]).name == "rewind":
        return words[1:]
    if "-m" in words and Path(words[0]).name.startswith(("python", "torchrun")):
        at = words.index("-m")
        if words[at + 1 : at + 2] == ["rewind"]:
            return words[at + 2 :]
    return None


def command_lines(block: Block) -> list[str]:
    """A block's command lines: every line of a shell block, a `$ ` line of any other (prompt stripped);
    a line ending in a backslash continues on the next."""
    lines, joined = [], ""
    for line in block.text.splitlines():
        if block.lang not in SHELL and not joined and not line.startswith("$ "):
            continue
        line = line[2:] if line.startswith("$ ") and not joined else line
        joined += line
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        if joined.strip():
            lines.append(joined.strip())
        joined = ""
    return lines


def rewind_commands(line: str) -> list[list[str]]:
    """The rewind invocations in one shell line (commands joined by &&, ||, ; or |)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, words = [], []
    for token in [*lexer, ";"]:
        if token and set(token) <= set(";&|"):
            if (argv := rewind_argv(words)) is not None:
                commands.append(argv)
            words = []
        else:
            words.append(token)
    return commands


def parse_problem(argv: list[str]) -> str:
    """What rewind's parser says about `argv` ("" when it parses)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            return err.getvalue().strip() or f"exit {exc.code}"
    return ""


TOML_BLOCKS = [b for b in BLOCKS if b.lang == "toml"]
COMMAND_BLOCKS = [b for b in BLOCKS if command_lines(b)]
PYTHON_BLOCKS = [b for b in BLOCKS if b.lang == "python"]


def test_the_docs_have_snippets_of_every_kind_checked_here():
    assert len(TOML_BLOCKS) >= 10 and len(COMMAND_BLOCKS) >= 10 and PYTHON_BLOCKS
    assert any(rewind_commands(line) for b in COMMAND_BLOCKS for line in command_lines(b))


@pytest.mark.parametrize("block", TOML_BLOCKS, ids=[b.where for b in TOML_BLOCKS])
def test_a_toml_block_is_valid_toml_and_loads_as_a_config(block):
    try:
        text = in_a_config(block.text)
    except tomllib.TOMLDecodeError as exc:
        hint = multiline_table_hint(block.text, str(exc))
        pytest.fail(
            f"{block.where}: the ```toml block is not valid TOML: {exc}{hint} (line 1: the block's first)"
        )
    try:
        loads_config(text, source=block.where)
    except ConfigError as exc:
        pytest.fail(f"{block.where}: the ```toml block does not load as a config: " + "; ".join(exc.problems))


@pytest.mark.parametrize("block", COMMAND_BLOCKS, ids=[b.where for b in COMMAND_BLOCKS])
def test_every_rewind_command_of_a_block_parses_with_the_cli(block):
    problems = [
        f"{' '.join(argv)!r}: {problem}"
        for line in command_lines(block)
        for argv in rewind_commands(line)
        if (problem := parse_problem(argv))
    ]
    assert not problems, f"{block.where}: rewind commands its parser refuses: {problems}"


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.where for b in PYTHON_BLOCKS])
def test_a_python_block_compiles(block):
    try:
        compile(block.text, block.where, "exec")
    except SyntaxError as exc:
        pytest.fail(f"{block.where}: the ```python block does not compile: {exc}")


@pytest.mark.parametrize(
    ("snippet", "expected"),
    [
        ('[[stages]]\ngrpo = { group_size = 4,\n  kl_beta = 0.1 }\n', r"is not valid TOML: .*write a \[stages\.grpo\] table instead"),
        ('[[stages]]\nstrategy = "grpo"\ntokens = 1\ndatasets = [{ name = "sort" }]\ngrpo = { group = 4 }\n',
         "does not load"),
        ("[optimization]\nlr = -1.0\n", "does not load"),
    ],
    ids=["multi-line inline table", "unknown key", "bad value"],
)  # fmt: skip
def test_a_broken_toml_block_fails_naming_its_file_and_line(snippet, expected):
    block = Block(REPO / "docs" / "x.md", 7, "toml", snippet)
    with pytest.raises(pytest.fail.Exception, match=rf"^docs/x\.md:7: the ```toml block {expected}"):
        test_a_toml_block_is_valid_toml_and_loads_as_a_config(block)


def test_a_command_the_cli_refuses_fails_naming_its_file_and_line():
    text = "rewind train examples/tiny.toml --run-dir r && rewind trian x  # typo\n.venv/bin/rewind log r --tipe X\n"
    block = Block(REPO / "README.md", 12, "bash", text)
    with pytest.raises(AssertionError, match=r"^README\.md:12: rewind commands its parser refuses") as info:
        test_every_rewind_command_of_a_block_parses_with_the_cli(block)
    assert "'trian x'" in str(info.value) and "'log r --tipe X'" in str(info.value)
    assert "tiny.toml" not in str(info.value)
    fine = Block(REPO / "README.md", 3, "", "$ python -m rewind schedule a.toml --json\nrewind nonsense\n")
    test_every_rewind_command_of_a_block_parses_with_the_cli(fine)  # an output line is not a command
