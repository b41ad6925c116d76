"""examples/posttrain.toml made small for the command tests: its four stages (pretrain, sft, dpo, grpo
with kl_beta 0.02) in 2 + 4 + 2 + 6 steps, a few seconds on one thread."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import EXAMPLES
from tests.engine.test_loop import run_cli

POSTTRAIN = EXAMPLES / "posttrain.toml"
SMALL = [
    "--set", "stages[0].tokens=2048", "--set", "stages[1].tokens=4096",
    "--set", "stages[2].tokens=2048", "--set", "stages[3].tokens=6144",
]  # fmt: skip


def train_small_posttrain(run: Path, *args: str) -> Path:
    """Train (or go on training) the small example into `run`; `args`: more of `rewind train`'s options."""
    code, _, err = run_cli("train", POSTTRAIN, "--run-dir", run, "--no-progress", *SMALL, *args)
    assert code == 0, err
    return run
