"""`rewind bench resume`: what opening a run costs before any tensor loads, at 10k and 1M steps.

Two synthetic runs are written through the stores API (`rewind.stores.synthetic`), the large one with
1,000 resumes. For each, resume's bookkeeping is timed as a resume does it: take the writer's lock and
recover the log, fold it (from the newest state snapshot the log vouches for: `fold_log(..., vouched=
True)`), and find the restore point. The log and snapshots are those today's engine leaves: each
CheckpointCommitted carries the digest of the state before it, and the snapshot of that state is
written at every checkpoint up to 1,000 steps before the log's end, so what is left to fold is those
steps. `cold` is the same open of the run as written with no digest and no snapshot (a run written
before digests, or with its snapshots deleted), which folds everything once. `tail_ratio` = warm
t(1M) / t(10k): a resume that costs its tail, not its log, keeps it near 1. The readers' figures
(`rewind state --at-step`, `rewind log --steps` in the middle of the large run) are printed beside them.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import msgspec

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
        folded = fold_log(log, run_dir, vouched=True)  # and folds it (engine.run.entry.read_log)
        point_of(folded.state)
    return time.perf_counter() - started, len(folded.tail)


TAIL_STEPS = 1_000  # steps since the snapshot: a crash between two checkpoints 1,000 steps apart
_COMMIT_EVERY = 1_000  # records


def _as_the_engine_writes_it(source: str, run_dir: str) -> None:
    """Copy the synthetic log of `source` into `run_dir` as today's engine writes it: each
    CheckpointCommitted carrying the digest of the fold before it, and at every checkpoint up to
    TAIL_STEPS before the end the snapshot of that state (the store thins the older ones to one per
    band), as a run that crashed just before its next checkpoint leaves them: resuming has a real
    tail to fold."""
    with EventLog.open(source) as log:
        events = [r.event for r in log.records()]
    end_step = events[-1].step
    state, config, previous = State(), None, None
    with EventLog.open(run_dir, "w") as log:
        for seq, event in enumerate(events):
            if isinstance(event, CheckpointCommitted):
                event = msgspec.structs.replace(event, state_sha256=snapshots.state_digest(state, config))
                if event.step <= end_step - TAIL_STEPS:
                    snapshots.write(run_dir, snapshots.make(seq - 1, previous, state, config))
            log.append(event)
            if seq % _COMMIT_EVERY == _COMMIT_EVERY - 1:
                log.commit()
            state, previous = apply(state, event), event
            if isinstance(event, RunStarted | ConfigChanged):
                config = event.config
        log.commit()


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
    source, run_dir = str(root / f"{name}-before-digests"), str(root / name)
    written = write_synthetic_run(source, num_steps, num_resumes=num_resumes)
    cold, _ = _open_and_fold(source)
    _as_the_engine_writes_it(source, run_dir)
    shutil.rmtree(source, ignore_errors=True)
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
