"""The README and the guide under docs/ cannot drift: every figure and worked example they quote is
re-derived here.

Dry runs and config errors are re-run and compared on every machine. Demo figures depend on the kind
of machine (see tests/docs/make_readme_figures.py): README.md and the pages under docs/ together must
quote exactly the figure files, and on the kind of machine that made them the demo is trained again and
must reproduce them bit for bit.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.docs.readme_figures import FIGURES_DIR, REPO, machine_fingerprint, marked_blocks, marked_pages
from tests.engine.test_loop import run_cli

# (page, kind, argument, content) of every marked block of README.md and of every page under docs/.
BLOCKS = marked_pages()


def test_the_readme_and_the_guide_mark_their_figures_and_examples():
    kinds = {kind for _, kind, _, _ in BLOCKS}
    assert kinds == {"figure", "output"}, kinds
    quoted = {name for _, kind, name, _ in BLOCKS if kind == "figure"}
    on_disk = {f"docs/figures/{p.name}" for p in FIGURES_DIR.glob("*.txt")}
    assert quoted == on_disk, "every figure file is quoted (README.md, docs/), and only those"
    assert {page for page, _, _, _ in BLOCKS} > {"README.md"}, "the pages under docs/ are read too"


def test_a_marker_without_a_block_names_its_page_and_line():
    with pytest.raises(ValueError, match=r"^docs/x\.md line 2: a marker must be followed by a fenced block"):
        marked_blocks("text\n<!-- figure: docs/figures/state.txt -->\nnot a fence\n", "docs/x.md")


@pytest.mark.parametrize("name", sorted({arg for _, kind, arg, _ in BLOCKS if kind == "figure"}))
def test_a_figure_block_is_exactly_its_file(name):
    blocks = [(page, content) for page, kind, arg, content in BLOCKS if kind == "figure" and arg == name]
    expected = (REPO / name).read_text()
    for page, content in blocks:
        assert content == expected, f"{page}'s block for {name} differs from the file: regenerate or re-paste"


@pytest.mark.parametrize("command", sorted({arg for _, kind, arg, _ in BLOCKS if kind == "output"}))
def test_an_output_block_is_what_the_command_prints(command, monkeypatch):
    words = shlex.split(command)
    assert words[0] == "rewind"
    monkeypatch.chdir(REPO)
    _, out, err = run_cli(*words[1:])
    printed = f"$ {command}\n{out}{err}"
    for page, kind, arg, content in BLOCKS:
        if kind == "output" and arg == command:
            assert content == printed, f"{page}: the block for `{command}` is not what it prints"


@pytest.mark.slow
def test_the_demo_reproduces_its_figures_on_the_machine_kind_that_made_them(tmp_path):
    recorded = json.loads((FIGURES_DIR / "machine.json").read_text())
    here = machine_fingerprint()
    differing = {k: (recorded.get(k), v) for k, v in here.items() if recorded.get(k) != v}
    if differing:
        pytest.skip(f"the figures were made on another kind of machine (recorded, here): {differing}")
    run = tmp_path / "abcd"
    command = [
        sys.executable,
        "-m",
        "rewind.tools.cli",
        "train",
        "examples/abcd.toml",
        "--run-dir",
        str(run),
        "--no-progress",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")}
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr
    final = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name[0].isdigit())[-1]
    assert final == recorded["final_checkpoint"], (
        "the same code on the same kind of machine must give the same weights"
    )
    table = (FIGURES_DIR / "demo_table.txt").read_text().splitlines()[2:]
    summary = json.loads(
        subprocess.run(
            [sys.executable, "-m", "rewind.tools.cli", "timeline", str(run), "--json"],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout
    )
    scores = {str(row["stage"]): row["evaluation"] for row in summary["stages"]}
    scores["(start)"] = summary["evaluation_before_training"]  # the baseline row
    assert len(table) == 5
    for line in table:
        cells = line.split()  # the row's name, then the KL run's three columns
        expected = [float(c) for c in cells[1:4]]
        assert [round(scores[cells[0]][t], 3) for t in ("reverse", "sort", "add")] == expected
