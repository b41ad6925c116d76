"""`rewind bench threads`: the tiny example's wall time beside CPU-bound competitors, over its time alone.

Each repeat runs `rewind train examples/tiny.toml` in a fresh process (interpreter, imports, training:
what a user waits for), first alone, then while two CPU-bound processes (pure-Python loops with a
deadline, killed as soon as the run ends) compete for the cores. The ratio of the two wall times is the
figure; the goal is <= 2.0. On a 2-core machine three runnable processes get 2/3 of a core each, so a
run cannot do much better than 1.5. The run computes with what the command chooses by itself (its CPU
threads and their wait policy: rewind.tools.cpu_threads; a new run's count: rewind.states.cpu_threads,
one thread for the tiny example's small steps; OMP_NUM_THREADS caps it, OMP_WAIT_POLICY replaces the
wait policy). Beside it the same example computed with every core the process may use (`--threads`),
what a run whose steps keep them busy does: the figure for many threads woken hundreds of times a step
on a machine other jobs keep busy (`all_cores`).

A shared machine's other jobs move both sides of a ratio, so the bench repeats it and reports the range.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rewind.states.events import RunStarted
from rewind.stores.runs import read_records
from rewind.tools.cpu_threads import usable_cores

RATIO_GOAL = 2.0
NUM_COMPETITORS = 2
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny.toml"

# A CPU-bound competitor that ends by itself (argv[1]: seconds) even if the bench dies before killing it.
COMPETITOR = (
    "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"
)


def train_command(run_dir: Path, max_steps: int | None, threads: int = 0) -> list[str]:
    """`rewind train` of the tiny example into `run_dir`, as a user runs it (a new process); `threads` > 0:
    with that many CPU threads (--threads)."""
    command = [
        sys.executable,
        "-m",
        "rewind.tools.cli",
        "train",
        str(EXAMPLE),
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]
    command += ["--threads", str(threads)] if threads > 0 else []
    return command + (["--max-steps", str(max_steps)] if max_steps is not None else [])


def timed(command: list[str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of `command`, a new process; a failure is an error, with the end of
    what it said. The CPU time is the process's own (user + system, over all its threads)."""
    began = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with proc.stderr:  # type: ignore[union-attr]
        err = proc.stderr.read()  # type: ignore[union-attr]
    _, status, usage = os.wait4(proc.pid, 0)  # reaped here, for its resource usage
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}: {err.strip()[-500:]}")
    return seconds, usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def competitors(count: int, seconds: float) -> Iterator[list[subprocess.Popen]]:
    """`count` CPU-bound processes for at most `seconds`, killed (and reaped) when the block ends."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", COMPETITOR, str(seconds)]))
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def measure(command_for: Callable[[Path], list[str]], scratch: Path, *, repeats: int) -> dict:
    """Each repeat: the command alone, then beside NUM_COMPETITORS competitors, each in a new directory
    under `scratch` (`command_for(directory)`: alone-K, contended-K). The competitors' deadline is ten
    times the alone time plus a minute: they outlive the contended run unless it is more than ten times
    slower, and never the bench by much."""
    alone, contended = [], []
    for k in range(repeats):
        alone.append(timed(command_for(scratch / f"alone-{k}")))
        with competitors(NUM_COMPETITORS, 10 * alone[-1][0] + 60):
            contended.append(timed(command_for(scratch / f"contended-{k}")))
    ratios = [round(c[0] / a[0], 3) for a, c in zip(alone, contended, strict=True)]
    return {
        "competitors": NUM_COMPETITORS,
        "repeats": repeats,
        "alone_s": [round(wall, 3) for wall, _ in alone],
        "contended_s": [round(wall, 3) for wall, _ in contended],
        # The CPU time the run itself used: about the same beside competitors unless idle threads spin.
        "alone_cpu_s": [round(cpu, 3) for _, cpu in alone],
        "contended_cpu_s": [round(cpu, 3) for _, cpu in contended],
        "ratios": ratios,
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_goal": RATIO_GOAL,
    }


def recorded_threads(run_dir: Path) -> int:
    """The CPU thread count a run recorded when it started (what the command chose, or was told)."""
    started = read_records(run_dir)[0].event
    assert isinstance(started, RunStarted)
    return started.num_threads


def run_threads_bench(quick: bool = False) -> dict:
    """The tiny example (quick: its first 20 steps, once) alone and beside two competitors, three times,
    with the threads it chooses and then with every core (when that is more)."""
    if not EXAMPLE.is_file():
        raise FileNotFoundError(
            2, "bench threads needs the checkout's examples (not installed)", str(EXAMPLE)
        )
    max_steps, repeats = (20, 1) if quick else (None, 3)
    cores = usable_cores()
    with tempfile.TemporaryDirectory(prefix="rewind-bench-threads-") as scratch:
        result = measure(lambda run_dir: train_command(run_dir, max_steps), Path(scratch), repeats=repeats)
        threads = recorded_threads(Path(scratch) / "alone-0")
        if cores > threads:
            every = Path(scratch) / "all-cores"
            every.mkdir()
            all_cores = measure(lambda run_dir: train_command(run_dir, max_steps, cores), every, repeats=repeats)
            result["all_cores"] = {"threads": cores, **all_cores}
    steps = f" (its first {max_steps} steps)" if max_steps is not None else ""
    return {"example": f"examples/{EXAMPLE.name}{steps}", "threads": threads, **result}
