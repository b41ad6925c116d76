"""`rewind bench resume`: what opening a run costs before any tensor loads, at 10k and 1M steps.

Two synthetic runs are written through the stores API (`rewind.stores.synthetic`), the large one with
1,000 resumes. For each, resume's bookkeeping is timed: take the writer's lock and recover the log,
fold it (from the newest state snapshot that agrees with the log), and find the restore point. The
snapshot is the one a real run leaves at a checkpoint, here 1,000 steps before the log's end, so what
is left to fold is those steps; `cold` is the same open with no snapshot at all (a run written by rewind 0.1, or with its
snapshots deleted), which folds everything once. `tail_ratio` = warm t(1M) / t(10k): a resume that
costs its tail, not its log, keeps it near 1.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from rewind.states.events import CheckpointCommitted, event_tag
from rewind.states.fold import fold
from rewind.states.history import config_in_force, point_of
from rewind.stores import snapshots
from rewind.stores.eventlog import EventLog
from rewind.stores.folding import fold_log
from rewind.stores.synthetic import write_synthetic_run


def _open_and_fold(run_dir: str) -> tuple[float, int]:
    started = time.perf_counter()
    with EventLog.open(run_dir, "w", check="tail") as log:  # as resume opens it
        folded = fold_log(log, run_dir)
        point_of(folded.state)
    return time.perf_counter() - started, len(folded.tail)


TAIL_STEPS = 1_000  # steps since the snapshot: a crash between two checkpoints 1,000 steps apart


def _snapshot_before_the_tail(run_dir: str) -> None:
    """What the engine leaves at a checkpoint, TAIL_STEPS before the log's end (so that resuming has a
    real tail to fold, as after a crash just before the next checkpoint)."""
    with EventLog.open(run_dir) as log:
        records = [(r.seq, r.event) for r in log.records()]
    end_step = records[-1][1].step
    last = max(
        i for i, (_, e) in enumerate(records) if isinstance(e, CheckpointCommitted) and e.step <= end_step - TAIL_STEPS
    )
    prefix = records[: last + 1]
    state = fold(e for _, e in prefix)
    snapshots.write(run_dir, prefix[-1][0], event_tag(prefix[-1][1]), state, config_in_force(prefix))


def _measure(root: Path, name: str, num_steps: int, num_resumes: int, repeats: int) -> dict:
    run_dir = str(root / name)
    written = write_synthetic_run(run_dir, num_steps, num_resumes=num_resumes)
    cold, _ = _open_and_fold(run_dir)
    _snapshot_before_the_tail(run_dir)
    warm = [_open_and_fold(run_dir) for _ in range(repeats)]
    return {
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
        "tail_ratio": large["warm_s"] / small["warm_s"],
        "goal_tail_ratio": 3.0,
        "goal_large_warm_s": 2.0,
    }
