"""The README cannot drift: every figure and worked example it quotes is re-derived here.

Dry runs and config errors are re-run and compared on every machine. Demo figures depend on the kind
of machine (see tests/docs/make_readme_figures.py): the README must quote exactly the figure files, and
on the kind of machine that made them the demo is trained again and must reproduce them bit for bit.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from tests.docs.readme_figures import FIGURES_DIR, README, REPO, machine_fingerprint, marked_blocks
from tests.engine.test_loop import run_cli

BLOCKS = marked_blocks(README.read_text())


def test_the_readme_marks_its_figures_and_examples():
    kinds = {kind for kind, _, _ in BLOCKS}
    assert kinds == {"figure", "output"}, kinds
    quoted = {name for kind, name, _ in BLOCKS if kind == "figure"}
    on_disk = {f"docs/figures/{p.name}" for p in FIGURES_DIR.glob("*.txt")}
    assert quoted == on_disk, "every figure file is quoted, and only those"


@pytest.mark.parametrize("name", sorted({arg for kind, arg, _ in BLOCKS if kind == "figure"}))
def test_a_figure_block_is_exactly_its_file(name):
    blocks = [content for kind, arg, content in BLOCKS if kind == "figure" and arg == name]
    expected = (REPO / name).read_text()
    for content in blocks:
        assert content == expected, f"README's block for {name} differs from the file: regenerate or re-paste"


@pytest.mark.parametrize("command", sorted({arg for kind, arg, _ in BLOCKS if kind == "output"}))
def test_an_output_block_is_what_the_command_prints(command, monkeypatch):
    words = shlex.split(command)
    assert words[0] == "rewind"
    monkeypatch.chdir(REPO)
    _, out, err = run_cli(*words[1:])
    printed = f"$ {command}\n{out}{err}"
    for kind, arg, content in BLOCKS:
        if kind == "output" and arg == command:
            assert content == printed


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
