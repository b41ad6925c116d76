"""`rewind bench startup`: a restart's time to its first step, over a new process's `import torch`.

A restart is `rewind resume RUN --max-steps 1` of the tiny example (examples/tiny.toml) in a new
process, from a run directory that holds a checkpoint: the interpreter, imports, opening the log,
loading the checkpoint, building the model and optimizer, one step, then the stop (a checkpoint and a
record: measured, under 1% of the whole). The whole process is timed, so the figure bounds restart to
first step from above. The baseline is a new process that imports torch, which no restart avoids; the
goal is <= 1.5.

rewind builds its optimizer without `torch.optim.Optimizer` (engine/model/optimizer.py: whose methods import
torch._dynamo, about as much again as torch) and never imports FSDP2's modules in a one-process run, so
what a restart adds to `import torch` is its own work.

Each repeat times the two processes one after the other, so a shared machine's load moves them
together, and the bench reports each ratio's range. Wall time is what a user waits for and what the
goal is about; each process's CPU time (user + system) is reported too, as the same ratios: a machine
whose other jobs keep every core busy stretches wall times by whatever share they leave, CPU times far
less.
"""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rewind.states.events import RunResumed
from rewind.stores.runs import read_records

RATIO_GOAL = 1.5
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny.toml"
PREPARED_STEPS = 10  # a run stopped by --max-steps checkpoints where it stops
IMPORT_TORCH = "import torch"


@dataclass(frozen=True)
class Timing:
    wall_s: float
    cpu_s: float  # user + system time of the process (and of any children it waited for)


def rewind_command(*args: str) -> list[str]:
    """`rewind ARGS...` in a new process of this interpreter, as a user runs it."""
    return [sys.executable, "-m", "rewind.tools.cli", *args]


def timed(command: list[str]) -> Timing:
    """How long `command` took; a failure is an error, with the end of what it said. One child at a
    time: the CPU time is what this process's reaped children used meanwhile."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    wall_s = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Timing(wall_s, cpu_s)


def prepare(run_dir: Path) -> None:
    """The tiny example's first PREPARED_STEPS steps: a run directory with a checkpoint to restart from."""
    train = ["train", str(EXAMPLE), "--run-dir", str(run_dir), "--no-progress"]
    timed(rewind_command(*train, "--max-steps", str(PREPARED_STEPS)))


def restart(prepared: Path, run_dir: Path) -> Timing:
    """`rewind resume --max-steps 1` on a fresh copy of `prepared`, checked to have resumed from a
    checkpoint and taken one step (a restart that started over would time something else)."""
    shutil.copytree(prepared, run_dir)
    timing = timed(rewind_command("resume", str(run_dir), "--max-steps", "1", "--no-progress"))
    events = [record.event for record in read_records(run_dir)]
    resumed = [event for event in events if isinstance(event, RunResumed)]
    if len(resumed) != 1 or events[-1].step != PREPARED_STEPS + 1:
        raise RuntimeError(
            f"{run_dir}: the restart did not resume at step {PREPARED_STEPS} and take one step"
        )
    return timing


def _ratios(name: str, over: list[Timing], under: list[Timing]) -> dict:
    """`name`: the repeat-by-repeat ratios of wall times, and their range; `name`_cpu: of CPU times."""
    walls = [round(a.wall_s / b.wall_s, 3) for a, b in zip(over, under, strict=True)]
    cpus = [round(a.cpu_s / b.cpu_s, 3) for a, b in zip(over, under, strict=True)]
    return {
        name: walls,
        f"{name}_range": [min(walls), max(walls)],
        f"{name}_cpu_range": [min(cpus), max(cpus)],
    }


def run_startup_bench(quick: bool = False) -> dict:
    """Restart and `import torch`, in new processes, once (quick) or five times."""
    if not EXAMPLE.is_file():
        raise FileNotFoundError(
            2, "bench startup needs the checkout's examples (not installed)", str(EXAMPLE)
        )
    repeats = 1 if quick else 5
    torch_t, resume_t = [], []
    with tempfile.TemporaryDirectory(prefix="rewind-bench-startup-") as scratch:
        prepared = Path(scratch) / "prepared"
        prepare(prepared)
        for k in range(repeats):
            torch_t.append(timed([sys.executable, "-c", IMPORT_TORCH]))
            resume_t.append(restart(prepared, Path(scratch) / f"restart-{k}"))
    return {
        "example": f"examples/{EXAMPLE.name}: resume at step {PREPARED_STEPS}, --max-steps 1",
        "baseline": f'python -c "{IMPORT_TORCH}"',
        "repeats": repeats,
        "import_torch_s": [round(t.wall_s, 3) for t in torch_t],
        "resume_s": [round(t.wall_s, 3) for t in resume_t],
        "ratio_goal": RATIO_GOAL,
        **_ratios("ratios", resume_t, torch_t),  # the goal's figure: restart / import torch
    }
