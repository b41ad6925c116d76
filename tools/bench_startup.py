"""`rewind bench startup`: a restart's time to its first step, over a new process's `import torch`.

A restart is `rewind resume RUN --max-steps 1` of the tiny example (examples/tiny.toml) in a new
process, from a run directory that holds a checkpoint: the interpreter, imports, opening the log,
loading the checkpoint, building the model and optimizer, one step, then the stop (a checkpoint and a
record: a few hundredths of the whole here). The whole process is timed, so the figure bounds restart to
first step from above. The baseline is a new process that imports torch, which no restart avoids; the
goal is <= 1.5.

A second baseline says what any torch trainer pays before rewind does anything: a new process that
imports torch and builds one `torch.optim` optimizer, whose constructor imports torch._dynamo (torch
2.x's `torch._disable_dynamo`; it costs about as much as torch itself, and imports triton where it is
installed). resume / floor is rewind's own part.

Each repeat times the three processes one after the other, so a shared machine's load moves them
together, and the bench reports each ratio's range.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rewind.states.events import RunResumed
from rewind.stores.runs import read_records

RATIO_GOAL = 1.5
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiny.toml"
PREPARED_STEPS = 10  # a run stopped by --max-steps checkpoints where it stops
IMPORT_TORCH = "import torch"
OPTIMIZER = "import torch; torch.optim.AdamW([torch.zeros(1, requires_grad=True)])"


def rewind_command(*args: str) -> list[str]:
    """`rewind ARGS...` in a new process of this interpreter, as a user runs it."""
    return [sys.executable, "-m", "rewind.tools.cli", *args]


def timed(command: list[str]) -> float:
    """The wall time of `command` in seconds; a failure is an error, with the end of what it said."""
    began = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip()[-500:]}")
    return seconds


def prepare(run_dir: Path) -> None:
    """The tiny example's first PREPARED_STEPS steps: a run directory with a checkpoint to restart from."""
    train = ["train", str(EXAMPLE), "--run-dir", str(run_dir), "--no-progress"]
    timed(rewind_command(*train, "--max-steps", str(PREPARED_STEPS)))


def restart(prepared: Path, run_dir: Path) -> float:
    """Seconds of `rewind resume --max-steps 1` on a fresh copy of `prepared`, checked to have resumed
    from a checkpoint and taken one step (a restart that started over would time something else)."""
    shutil.copytree(prepared, run_dir)
    seconds = timed(rewind_command("resume", str(run_dir), "--max-steps", "1", "--no-progress"))
    events = [record.event for record in read_records(run_dir)]
    resumed = [event for event in events if isinstance(event, RunResumed)]
    if len(resumed) != 1 or events[-1].step != PREPARED_STEPS + 1:
        raise RuntimeError(f"{run_dir}: the restart did not resume at step {PREPARED_STEPS} and take one step")
    return seconds


def run_startup_bench(quick: bool = False) -> dict:
    """Restart, `import torch` and the optimizer floor, in new processes, once (quick) or five times."""
    if not EXAMPLE.is_file():
        raise FileNotFoundError(2, "bench startup needs the checkout's examples (not installed)", str(EXAMPLE))
    repeats = 1 if quick else 5
    torch_s, floor_s, resume_s = [], [], []
    with tempfile.TemporaryDirectory(prefix="rewind-bench-startup-") as scratch:
        prepared = Path(scratch) / "prepared"
        prepare(prepared)
        for k in range(repeats):
            torch_s.append(timed([sys.executable, "-c", IMPORT_TORCH]))
            floor_s.append(timed([sys.executable, "-c", OPTIMIZER]))
            resume_s.append(restart(prepared, Path(scratch) / f"restart-{k}"))
    ratios = [round(r / t, 3) for r, t in zip(resume_s, torch_s, strict=True)]
    floor_ratios = [round(f / t, 3) for f, t in zip(floor_s, torch_s, strict=True)]
    own_ratios = [round(r / f, 3) for r, f in zip(resume_s, floor_s, strict=True)]
    return {
        "example": f"examples/{EXAMPLE.name}: resume at step {PREPARED_STEPS}, --max-steps 1",
        "baseline": f'python -c "{IMPORT_TORCH}"',
        "floor": f'python -c "{OPTIMIZER}"',
        "repeats": repeats,
        "import_torch_s": [round(s, 3) for s in torch_s],
        "floor_s": [round(s, 3) for s in floor_s],
        "resume_s": [round(s, 3) for s in resume_s],
        "ratios": ratios,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_goal": RATIO_GOAL,
        "floor_ratio_min": min(floor_ratios),
        "floor_ratio_max": max(floor_ratios),
        "resume_over_floor_min": min(own_ratios),
        "resume_over_floor_max": max(own_ratios),
    }
