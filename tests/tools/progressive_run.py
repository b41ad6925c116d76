"""examples/progressive.toml, shortened (25 steps a stage, 8 evaluation rows), trained once per test
session: a GELU model grown to 4 stacks whose final checkpoint has an NF4 trunk of three stacks training
through LoRA adapters (ranks 8, 4, 2) under a float stack. About 10 s of CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES
from tests.engine.test_loop import run_cli

SHORTENED = ("training.tokens=[6400,6400,6400,6400]", "training.eval_samples=8")


def progressive_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.getbasetemp()
    run, done = base / "progressive-run", base / "progressive-run.done"
    if not done.exists():
        shutil.rmtree(run, ignore_errors=True)  # a previous attempt that failed half way
        sets = [part for override in SHORTENED for part in ("--set", override)]
        code, _, err = run_cli("train", EXAMPLES / "progressive.toml", "--run-dir", run, "--no-progress", *sets)
        assert code == 0, err
        done.touch()
    return run
