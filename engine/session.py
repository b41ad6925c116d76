"""Opening a run directory: start a new run, or resume one from its log.

Resume never guesses: the log is folded, the restore point is the fold's own anchor (the last committed
checkpoint that is still effective, or the start), and a RunResumed event records what it supersedes.
The live objects are built from the folded state before anything is written. A config that differs
from the run's is refused unless the caller forks in place (then a ConfigChanged records the new one).
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

import torch

from rewind.engine.datasets import DatasetRegistry
from rewind.engine.journal import Journal
from rewind.engine.loop import Run, record
from rewind.engine.parts import RunError, build_parts, fresh_parts, open_datasets
from rewind.states.config import Config, config_differences, config_hash
from rewind.states.events import ConfigChanged, RunResumed, RunStarted
from rewind.states.fold import IllegalTransition, apply
from rewind.states.history import point_of, skip_ranges
from rewind.states.schedule import Schedule
from rewind.states.state import State
from rewind.stores.checkpoints import CheckpointStore
from rewind.stores.eventlog import EventLog
from rewind.stores.folding import fold_log, save_snapshot
from rewind.stores.metrics import MetricsProjection

__all__ = ["REWIND_VERSION", "RunError", "adopt_threads", "open_datasets", "open_run"]

try:
    REWIND_VERSION = metadata.version("rewind")
except metadata.PackageNotFoundError:  # running from a checkout that was never installed
    REWIND_VERSION = "0+unknown"


def prepare_directory(run_dir: str) -> None:
    if "://" in run_dir:
        return  # object stores: nothing to create up front
    path = Path(run_dir)
    if path.exists() and not path.is_dir():  # mkdir(exist_ok=True) would only say "File exists"
        raise RunError(f"{run_dir}: not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunError(f"{run_dir}: cannot create the run directory ({exc.strerror})") from None
    if not path.is_dir():
        raise RunError(f"{run_dir}: not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise RunError(f"{run_dir}: the run directory is not writable")


def adopt_threads(num_threads: int) -> str:
    """Compute with the run's recorded CPU thread count (resume, fork, replay). Returns a note for the
    user when that differs from this process's default, else ""."""
    before = torch.get_num_threads()
    if num_threads <= 0 or num_threads == before:
        return ""
    torch.set_num_threads(num_threads)
    return f"computing with {num_threads} CPU thread(s) as the run was started (this process had {before}): bit for bit"


def continuation_problem(old: Config, new: Config) -> str:
    """Why a run cannot go on from a checkpoint of `old` under `new` ("" if it can): the architecture
    fields that give the weights their shapes must stay. Dropout, RoPE base and the like may change."""
    def shaping(config: Config) -> dict:
        a = config.architecture
        return {"vocab_size": a.vocab_size, "num_layers": a.num_layers, "d_model": a.d_model,
                "d_ff": a.d_ff or 4 * a.d_model, "norm": a.norm}

    before, after = shaping(old), shaping(new)
    changed = [f"architecture.{k} ({before[k]} -> {after[k]})" for k in before if before[k] != after[k]]
    if not changed:
        return ""
    return f"{', '.join(changed)} cannot change when continuing from a checkpoint: the weights have other shapes"


def config_mismatch(run_dir: str, logged: Config, new: Config) -> str:
    """"" when `new` is the run's config; else the refusal, naming what differs. Identity is computed
    by this code from both configs (never a hash an older release wrote), so a release that adds a
    field with a default does not strand a run."""
    if config_hash(logged) == config_hash(new):
        return ""
    changes = config_differences(logged, new)
    shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
    return (
        f"{run_dir}: the config differs from the run's ({shown or 'no field differs in value'}); "
        "pass --fork to continue under the new config"
    )


def metrics_for(run_dir: str, enabled: bool) -> MetricsProjection | None:
    return MetricsProjection(run_dir) if enabled and "://" not in run_dir else None


def open_run(
    config: Config, run_dir: str, *, fork: bool = False, metrics: bool = True, datasets: DatasetRegistry | None = None
) -> tuple[Run, State, str]:
    """Returns (run, state, how) with how in {"started", "resumed", "finished"}. The log stays open
    (and locked) in run.journal; the caller closes it."""
    prepare_directory(run_dir)
    datasets = open_datasets(config, datasets)
    # "tail": the writer trusts sealed segments whose index checks out, so a resume reads the tail;
    # damage further back is found by whoever reads it (`rewind verify` reads everything).
    log = EventLog.open(run_dir, "w", check="tail")
    try:
        journal = Journal(log, None, config.logging.report_interval)
        if log.next_seq:
            return _resume(config, run_dir, journal, fork=fork, metrics=metrics, datasets=datasets)
        return _start(config, run_dir, journal, metrics=metrics, datasets=datasets)
    except BaseException:
        log.close()
        raise


def _start(config: Config, run_dir: str, journal: Journal, *, metrics: bool, datasets) -> tuple[Run, State, str]:
    schedule = Schedule(config)
    if schedule.num_steps == 0:
        raise RunError(
            f"the run has no steps: {schedule.total_tokens} tokens in all, one step takes {schedule.tokens_per_step}"
        )
    run = Run(fresh_parts(config, run_dir, datasets), journal)  # built before the first record
    started = RunStarted(
        step=0,
        tokens=0,
        config=config,
        config_hash=config_hash(config),
        rewind_version=REWIND_VERSION,
        num_threads=torch.get_num_threads(),
    )
    journal.metrics = metrics_for(run_dir, metrics)
    if journal.metrics is not None:
        journal.metrics.resume(-1, 0)  # a directory left by a start that died before its first record
    return run, record(run, State(), started), "started"


def _resume(config, run_dir, journal: Journal, *, fork: bool, metrics: bool, datasets) -> tuple[Run, State, str]:
    # From the newest snapshot that agrees with the log and with its checkpoint's manifest.
    folded = fold_log(journal.log, run_dir, CheckpointStore(run_dir))
    current, logged_config = folded.state, folded.config
    if not current.started:
        raise RunError(f"{run_dir}: the event log does not start with RunStarted", 1)
    if current.finished:
        return Run(fresh_parts(logged_config, run_dir, datasets), journal), current, "finished"
    refusal = config_mismatch(run_dir, logged_config, config)
    if refusal and not fork:
        raise RunError(refusal)
    point = point_of(current)
    if refusal and point.checkpoint and (problem := continuation_problem(logged_config, config)):
        raise RunError(f"{run_dir}: {problem}")
    # Built for the config the run goes on under (the new one when forking in place, so that the old
    # config's datasets, perhaps moved since, are never opened), from the restore point's tensors.
    run = Run(build_parts(config if refusal else logged_config, run_dir, point.state, datasets), journal)
    resumed = RunResumed(
        step=point.state.step,
        tokens=point.state.tokens,
        checkpoint=point.checkpoint,
        superseded_first_seq=point.seq + 1,
        superseded_last_seq=folded.end_seq,
        config_hash=point.state.config_hash,
    )
    change = None
    if refusal:
        state_after = apply(current, resumed)
        change = ConfigChanged(
            step=state_after.step,
            tokens=state_after.tokens,
            config=config,
            config_hash=config_hash(config),
            previous_hash=state_after.config_hash,
        )
        try:  # every check before the first record
            apply(state_after, change)
        except IllegalTransition as exc:
            raise RunError(f"{run_dir}: cannot fork in place: {exc}") from None
    journal.metrics = metrics_for(run_dir, metrics)
    if journal.metrics is not None:
        _catch_up_metrics(journal.metrics, journal.log, folded, point.seq, point.state.step)
    state = record(run, current, resumed)
    if change is not None:
        state = record(run, state, change)  # its effect rebuilds the live objects for the new config
    save_snapshot(run_dir, state, change or resumed, run.parts.config)
    journal.report_interval = run.parts.config.logging.report_interval
    # With the resume on record and the lock held, checkpoint directories no live event names are
    # garbage by construction: half-written ones, ones written after the restore point (never
    # acknowledged, since the restore point is the last committed checkpoint), retention deletions
    # the dead process did not finish.
    run.parts.store.remove_orphans(c.checkpoint for c in state.live_checkpoints)
    return run, state, "resumed"


def _catch_up_metrics(projection: MetricsProjection, log: EventLog, folded, through_seq: int, step: int) -> None:
    """Keep the projection of what the restore point keeps, and add what a crash kept from it: the
    records after the last one projected, which are in the tail unless the projection lags far."""
    kept = projection.resume(through_seq, step + 1)
    start = -1 if kept is None else kept
    if start >= folded.snapshot_seq:
        missing = iter(folded.tail)
    else:
        missing = ((r.seq, r.event) for r in log.records(start_seq=start + 1, stop_seq=through_seq + 1))
    for seq, event in skip_ranges(missing, log.superseded_ranges()):
        if start < seq <= through_seq:
            projection.observe(seq, event)
    projection.flush()
