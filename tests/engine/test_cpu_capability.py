"""A run records the CPU kernels torch computed with (AVX2, AVX512, ...), and resume computes with them.

Torch dispatches each op to kernels for the best instruction set the CPU has, and kernels of different
widths sum floats in different orders: the same run on an AVX2 and on an AVX512 machine ends with
different bits (measured here: different final checkpoints). A run resumed on another kind of machine
would silently stop being the run it was. So RunStarted records the capability, and resume, fork and
replay ask torch for it (ATEN_CPU_CAPABILITY, read once, at the first kernel) before any tensor is
computed; where the CPU lacks it, the user is warned that the bits will differ from there on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rewind.engine.model import placement
from rewind.states.events import RunStarted
from rewind.stores.runs import read_seq_events
from tests.conftest import EXAMPLES
from tests.engine.test_loop import SHORT

REPO = Path(__file__).resolve().parents[2]
HERE = torch.backends.cpu.get_cpu_capability()
OTHER = "AVX2"  # narrower than the default of any machine this test runs the comparison on


def _train(run: Path, *extra: str, capability: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["OMP_NUM_THREADS"] = "1"
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability.lower()
    sets = [part for override in SHORT for part in ("--set", override)]
    command = [sys.executable, "-m", "rewind.tools.cli", "train", str(EXAMPLES / "tiny.toml"), "--run-dir", str(run)]
    return subprocess.run(
        [*command, "--no-progress", *sets, *extra], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    final = sorted(p for p in (run / "checkpoints").iterdir() if p.name[0].isdigit())[-1]
    return load_file(final / "model.safetensors")


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(HERE in ("DEFAULT", OTHER), reason=f"this CPU's default kernels are {HERE}: nothing to compare")
def test_a_run_resumed_on_a_machine_with_wider_kernels_computes_with_the_ones_it_started_with(tmp_path):
    native, narrow, resumed = tmp_path / "native", tmp_path / "narrow", tmp_path / "resumed"
    # Both in fresh processes, alike but for the kernels: in this process, flags an earlier test left in
    # torch could make the two differ for another reason than the kernels.
    for run, capability in ((native, None), (narrow, OTHER)):
        done = _train(run, capability=capability)
        assert done.returncode == 0, done.stderr
    started = read_seq_events(narrow)[0][1]
    assert isinstance(started, RunStarted) and started.cpu_capability == OTHER
    assert read_seq_events(native)[0][1].cpu_capability == HERE
    # What is at stake: the kernels change the bits.
    assert not _equal(_final_weights(native), _final_weights(narrow))

    # Started with the narrow kernels, stopped, resumed by a process whose default is the wide ones.
    first = _train(resumed, "--max-steps", "4", capability=OTHER)
    assert first.returncode == 0, first.stderr
    second = _train(resumed, capability=None)
    assert second.returncode == 0 and "resuming" in second.stderr, second.stderr
    assert "differ" not in second.stderr  # the recorded kernels were there to adopt: no warning
    assert _equal(_final_weights(resumed), _final_weights(narrow))


def test_kernels_that_cannot_be_adopted_are_a_warning_not_a_silent_change(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    with pytest.warns(placement.CapabilityChanged, match="started with AVX512 CPU kernels and this process computes with AVX2"):
        placement.adopt_cpu_capability("AVX512")
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx512"  # asked for, in case torch had not chosen yet
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        placement.adopt_cpu_capability("")  # a run of a release that did not record them: nothing known
        assert "ATEN_CPU_CAPABILITY" not in os.environ
        placement.adopt_cpu_capability("AVX2")  # the kernels this process has: no warning
