"""One part of `rewind bench gpu`, in a process of its own:

    python -m rewind.tools.bench.gpu_part PART --device cuda|cpu --work DIR
    python -m rewind.tools.bench.gpu_part probe

A part writes what it has measured to DIR/progress.json after every figure and check (a Recorder), so
that when its budget runs out and it is killed, what it finished is kept. `probe` prints, as JSON, what
the machine offers: torch's version, whether CUDA is usable, the device's name.

`--device cpu` is a part's CPU form: the same code at sizes a CPU finishes in seconds, so that the
check cannot rot between GPU runs (tests/tools/bench/test_gpu.py runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
from pathlib import Path

import msgspec

from rewind.tools.bench.gpu_schema import Check, Goal, Progress

PROGRESS_FILE = "progress.json"
# The repository root (the package's own directory): where tests/ and examples/ are in a checkout.
ROOT = Path(__file__).resolve().parents[2]
# part -> (module, function(recorder, device, work_dir)); the modules import torch when they run.
PART_FUNCTIONS = {
    "gpu_tests": ("rewind.tools.bench.gpu_pytest", "gpu_tests_part"),
    "kernels": ("rewind.tools.bench.gpu_compute", "kernels_part"),
    "mfu": ("rewind.tools.bench.gpu_compute", "mfu_part"),
    "exactness": ("rewind.tools.bench.gpu_runs", "exactness_part"),
    "progressive": ("rewind.tools.bench.gpu_runs", "progressive_part"),
    "fsdp": ("rewind.tools.bench.gpu_runs", "fsdp_part"),
}


class Recorder:
    """A part's progress, rewritten whole (temporary file, then rename) after every change."""

    def __init__(self, work: Path):
        self.path = work / PROGRESS_FILE
        self.progress = Progress()
        self._write()

    def doing(self, what: str) -> None:
        self.progress.doing = what
        self._write()

    def figures(self, **values: object) -> None:
        self.progress.figures.update(msgspec.to_builtins(values))
        self._write()

    def check(self, name: str, passed: bool, detail: str = "") -> bool:
        self.progress.checks.append(Check(name=name, passed=bool(passed), detail=detail))
        self._write()
        return bool(passed)

    def goal(self, name: str, value: float, target: float, direction: str) -> None:
        met = value <= target if direction == "<=" else value >= target
        self.progress.goals.append(Goal(name=name, value=value, target=target, direction=direction, met=met))
        self._write()

    def skip(self, why: str) -> None:
        self.progress.skipped = why
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(self.progress))
        os.replace(tmp, self.path)


def read_progress(work: Path) -> Progress | None:
    """What a part wrote last; None when it wrote nothing readable (it died before its first write)."""
    try:
        return msgspec.json.decode((work / PROGRESS_FILE).read_bytes(), type=Progress)
    except (OSError, msgspec.ValidationError, msgspec.DecodeError):
        return None


def process_tree(pid: int) -> list[int]:
    """pid and every process under it (Linux /proc): collected before any is killed, since an orphan is
    re-parented and lost from the tree (torchrun's ranks, for one, live in process groups of their own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        pending.extend(children.get(current, []))
    return tree


def kill_tree(pid: int) -> None:
    """SIGKILL pid and everything it started, as a job scheduler (or the OOM killer of a whole job) would."""
    for member in process_tree(pid):
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.kill(member, signal.SIGKILL)


def probe() -> dict:
    import torch

    usable = torch.cuda.is_available()
    return {
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "cuda": usable,
        "device_name": torch.cuda.get_device_name(0) if usable else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rewind.tools.bench.gpu_part")
    parser.add_argument("part", choices=(*PART_FUNCTIONS, "probe"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cpu")
    parser.add_argument("--work", type=Path, help="the part's directory (progress.json, its runs)")
    args = parser.parse_args(argv)
    if args.part == "probe":
        print(json.dumps(probe()))
        return 0
    if args.work is None:
        parser.error("--work is required for a part")
    recorder = Recorder(args.work)
    module, function = PART_FUNCTIONS[args.part]
    getattr(importlib.import_module(module), function)(recorder, args.device, args.work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
