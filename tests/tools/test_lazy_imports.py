"""What each command imports, in a fresh interpreter: the read-only commands never torch (a plot alone
brings matplotlib), and a restart only the libraries its run uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rewind.stores import trunks
from rewind.stores.activations import ActivationCache, CacheSpec
from tests.conftest import EXAMPLES, REPO
from tests.engine.test_loop import run_cli, train_args

# `rewind ARGS...` in this interpreter, then (last line on stderr) its exit code and which of the
# modules named by the environment's PROBE_MODULES it loaded.
PROBE = """
import json, os, sys
from rewind.tools.cli import main
code = main(sys.argv[1:])
watched = os.environ["PROBE_MODULES"].split(",")
print(json.dumps({"code": code, "loaded": [m for m in watched if m in sys.modules]}), file=sys.stderr)
"""
HEAVY = ("torch", "matplotlib")
# What a run of the tiny example does not use. (triton is left out: torch imports it by itself where
# it is installed, when an optimizer's constructor imports torch._dynamo.)
UNUSED_BY_TINY = ("peft", "bitsandbytes", "transformers", "zarr")
# Every post-training module (the sampler, rewards, rollouts, the dpo/grpo/distill steps): a pretraining
# run's stage kinds never ask for them (rewind.engine.step.kinds imports a kind's spec on first use).
POSTTRAIN_MODULES = tuple(
    f"rewind.engine.posttrain.{p.stem}" for p in sorted((REPO / "engine" / "posttrain").glob("*.py")) if p.stem != "__init__"
)


def probe(args: list[str], watched: tuple[str, ...], timeout: int = 300) -> dict:
    env = {**os.environ, "PROBE_MODULES": ",".join(watched)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stderr.strip().splitlines()[-1])


READ_ONLY = {
    "state": ["state", "{run}"],
    "state --json": ["state", "{run}", "--json"],
    "state --at-step": ["state", "{run}", "--at-step", "5"],
    "log": ["log", "{run}"],
    "log --json": ["log", "{run}", "--json"],
    "timeline": ["timeline", "{run}"],
    "timeline --json": ["timeline", "{run}", "--json"],
    "diff": ["diff", "{run}", "{run}"],
    "verify": ["verify", "{run}"],
    "schedule": ["schedule", str(EXAMPLES / "tiny.toml")],
}


@pytest.mark.parametrize("name", list(READ_ONLY))
def test_a_read_only_command_imports_neither_torch_nor_matplotlib(name, straight):
    args = [arg.format(run=straight) for arg in READ_ONLY[name]]
    assert probe(args, HEAVY) == {"code": 0, "loaded": []}


@pytest.mark.parametrize("command", ["timeline", "schedule"])
def test_a_plot_asked_for_brings_matplotlib_and_still_no_torch(command, straight, tmp_path):
    target = straight if command == "timeline" else EXAMPLES / "tiny.toml"
    out = tmp_path / "plot.png"
    assert probe([command, str(target), "--plot", str(out)], HEAVY) == {"code": 0, "loaded": ["matplotlib"]}
    assert out.stat().st_size > 0


def test_trunk_files_and_activation_caches_are_read_without_torch(tmp_path):
    """What `verify` (a frozen stack's weights file) and `state` (the trunk cache's status line) read
    of a grown run, read in a fresh interpreter: no torch, and no zarr for the trunk file."""
    data, digest = trunks.serialize({"w": torch.arange(6, dtype=torch.float32)})
    trunks.TrunkStore(tmp_path).write(data, digest)
    spec = CacheSpec(num_rows=4, seq_len=2, width=3, dtype="bfloat16", rows_per_chunk=2)
    cache = ActivationCache.create(str(tmp_path / "cache.zarr"), spec)
    cache.write_chunk(0, torch.ones(2, 2, 3, dtype=torch.bfloat16))
    cache.flush()
    code = (
        "import json, sys\n"
        "from rewind.stores.trunks import TrunkStore\n"
        f"TrunkStore({str(tmp_path)!r}).read({digest!r})\n"
        "after_trunk = [m for m in ('torch', 'zarr') if m in sys.modules]\n"
        "from rewind.stores.activations import cache_status\n"
        f"status = cache_status({str(tmp_path / 'cache.zarr')!r})\n"
        "print(json.dumps([after_trunk, status, 'torch' in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [[], "partial (1 of 2 chunks)", False]


@pytest.mark.slow
def test_a_restart_of_the_tiny_example_imports_none_of_what_it_does_not_use(tmp_path):
    run = tmp_path / "run"
    code, _, err = run_cli(*train_args(run, "--max-steps", "3"))
    assert code == 0, err
    # torch is watched too: the probe sees what a restart does import.
    watched = ("torch", *UNUSED_BY_TINY, *POSTTRAIN_MODULES)
    assert len(POSTTRAIN_MODULES) > 10
    loaded = probe(["resume", str(run), "--max-steps", "1", "--no-progress"], watched)
    assert loaded == {"code": 0, "loaded": ["torch"]}
