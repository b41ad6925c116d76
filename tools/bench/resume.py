"""`rewind bench resume`: what opening a run costs before any tensor loads, at 10k and 1M steps.

Two synthetic runs are written through the stores API (`rewind.stores.synthetic`), the large one with
1,000 resumes. For each, resume's bookkeeping is timed: take the writer's lock and recover the log,
fold it (from the newest state snapshot that agrees with the log), and find the restore point. The
snapshots are those a real run leaves at its checkpoints, the newest 1,000 steps before the log's
end, so what is left to fold is those steps; `cold` is the same open with no snapshot at all (a run written by rewind 0.1, or with its
snapshots deleted), which folds everything once. `tail_ratio` = warm t(1M) / t(10k): a resume that
costs its tail, not its log, keeps it near 1. The readers' figures (`rewind state --at-step`, `rewind
log --steps` in the middle of the large run) are printed beside them.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from rewind.states.events import CheckpointCommitted, ConfigChanged, RunStarted
from rewind.states.fold import apply
from rewind.states.history import point_of
from rewind.states.state import State
from rewind.stores import snapshots
from rewind.stores.eventlog import EventLog
from rewind.stores.folding import fold_log, fold_to
from rewind.stores.synthetic import write_synthetic_run


def _open_and_fold(run_dir: str) -> tuple[float, int]:
    started = time.perf_counter()
    with EventLog.open(run_dir, "w", check="tail") as log:  # as resume opens it
        folded = fold_log(log, run_dir)
        point_of(folded.state)
    return time.perf_counter() - started, len(folded.tail)


TAIL_STEPS = 1_000  # steps since the snapshot: a crash between two checkpoints 1,000 steps apart


def _snapshots_as_the_engine_leaves_them(run_dir: str) -> None:
    """One fold over the log, writing a snapshot at every checkpoint up to TAIL_STEPS before the end
    (the store thins the older ones to one per band), as a run that crashed just before its next
    checkpoint leaves them: resuming has a real tail to fold."""
    with EventLog.open(run_dir) as log:
        records = [(r.seq, r.event) for r in log.records()]
    end_step = records[-1][1].step
    state, config = State(), None
    for seq, event in records:
        state = apply(state, event)
        if isinstance(event, RunStarted | ConfigChanged):
            config = event.config
        if isinstance(event, CheckpointCommitted) and event.step <= end_step - TAIL_STEPS:
            snapshots.write(run_dir, snapshots.make(seq, event, state, config))


def _reader_figures(run_dir: str, repeats: int) -> dict:
    """What the read-side tools pay in the middle of the run: `rewind state --at-step` and
    `rewind log --steps`, from the nearest snapshot and the segments that hold the steps."""
    with EventLog.open(run_dir) as log:
        middle = fold_log(log, run_dir).state.step // 2
        state_times, log_times = [], []
        for _ in range(repeats):
            started = time.perf_counter()
            fold_to(log, run_dir, at_step=middle)
            state_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            list(log.records_in_steps(middle, middle + 2, effective=True))
            log_times.append(time.perf_counter() - started)
    return {"state_at_middle_s": min(state_times), "log_steps_middle_s": min(log_times)}


def _measure(root: Path, name: str, num_steps: int, num_resumes: int, repeats: int) -> dict:
    run_dir = str(root / name)
    written = write_synthetic_run(run_dir, num_steps, num_resumes=num_resumes)
    cold, _ = _open_and_fold(run_dir)
    _snapshots_as_the_engine_leaves_them(run_dir)
    warm = [_open_and_fold(run_dir) for _ in range(repeats)]
    return {
        **_reader_figures(run_dir, repeats),
        "num_records": written["num_records"],
        "num_resumes": num_resumes,
        "cold_s": cold,
        "warm_s": min(t for t, _ in warm),
        "tail_records": warm[0][1],
    }


def run_resume_bench(
    quick: bool = False, tmpdir: str | None = None, repeats: int = 3, sizes: tuple[int, int] | None = None
) -> dict:
    small_steps, large_steps = sizes or (10_000, 100_000 if quick else 1_000_000)
    root = Path(tempfile.mkdtemp(prefix="rewind-bench-resume-", dir=tmpdir))
    try:
        small = _measure(root, "small", small_steps, 10, repeats)
        large = _measure(root, "large", large_steps, min(1_000, large_steps // 10), repeats)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {
        "small_num_steps": small_steps,
        "large_num_steps": large_steps,
        "large_num_records": large["num_records"],
        "large_num_resumes": large["num_resumes"],
        "small_warm_s": small["warm_s"],
        "large_warm_s": large["warm_s"],
        "large_cold_s": large["cold_s"],
        "large_tail_records": large["tail_records"],
        "large_state_at_middle_s": large["state_at_middle_s"],
        "large_log_steps_middle_s": large["log_steps_middle_s"],
        "tail_ratio": large["warm_s"] / small["warm_s"],
        "goal_tail_ratio": 3.0,
        "goal_large_warm_s": 2.0,
        "goal_large_reader_s": 2.0,
    }
