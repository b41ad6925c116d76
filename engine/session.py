"""Opening a run directory: start a new run, or resume one by replaying its log.

Resume never guesses: the log is folded, the restore point is the last committed checkpoint that is
still effective, and a RunResumed event records what was superseded. A config whose hash differs from
the run's is refused unless the caller forks (then a ConfigChanged event records the new config).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rewind.engine.datasets import DatasetError, DatasetRegistry
from rewind.engine.loop import Parts, build_model, load_checkpoint
from rewind.engine.step import build_optimizer
from rewind.states.config import Config, config_differences, config_hash
from rewind.states.events import ConfigChanged, RunResumed, RunStarted
from rewind.states.fold import apply, fold
from rewind.states.history import config_in_force, effective, restore_point
from rewind.states.schedule import Schedule
from rewind.states.state import State
from rewind.stores.checkpoints import CheckpointStore
from rewind.stores.eventlog import EventLog
from rewind.stores.metrics import MetricsProjection

REWIND_VERSION = "0.1.0"


class RunError(Exception):
    """A run cannot be started or resumed as asked. exit_code: 2 usage/config, 1 state of the run."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


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


def open_run(
    config: Config, run_dir: str, *, fork: bool = False, metrics: bool = True, datasets: DatasetRegistry | None = None
) -> tuple[Parts, State, str]:
    """Returns (parts, state, how) with how in {"started", "resumed", "finished"}. The log stays open
    (and locked) in parts.log; the caller closes it."""
    prepare_directory(run_dir)
    datasets = open_datasets(config, datasets)
    log = EventLog.open(run_dir, "w")
    try:
        records = [(r.seq, r.event) for r in log.records()]
        if records:
            return _resume(config, run_dir, log, records, fork=fork, metrics=metrics, datasets=datasets)
        return _start(config, run_dir, log, metrics=metrics, datasets=datasets)
    except BaseException:
        log.close()
        raise


def open_datasets(config: Config, datasets: DatasetRegistry | None = None) -> DatasetRegistry:
    """Open every dataset the config names now, so a bad one fails before any log is touched."""
    try:
        datasets = datasets or DatasetRegistry(config)
        for mixture in config.training.datasets:
            for sampling in mixture:
                datasets[sampling.name]
        for name in config.training.evaluations:
            datasets[name]
    except DatasetError as exc:
        raise RunError(str(exc)) from None
    return datasets


def make_parts(config: Config, run_dir: str, log: EventLog, metrics: bool, datasets: DatasetRegistry) -> Parts:
    model = build_model(config)
    optimizer = build_optimizer(model, config)
    return Parts(
        config=config,
        schedule=Schedule(config),
        model=model,
        optimizer=optimizer,
        datasets=datasets,
        log=log,
        store=CheckpointStore(run_dir),
        metrics=MetricsProjection(run_dir) if metrics and "://" not in run_dir else None,
        param_names={p: n for n, p in model.named_parameters()},
    )


def _start(config: Config, run_dir: str, log: EventLog, *, metrics: bool, datasets) -> tuple[Parts, State, str]:
    schedule = Schedule(config)
    if schedule.num_steps == 0:
        raise RunError(
            f"the run has no steps: {schedule.total_tokens} tokens in all, one step takes {schedule.tokens_per_step}"
        )
    started = RunStarted(
        step=0,
        tokens=0,
        config=config,
        config_hash=config_hash(config),
        rewind_version=REWIND_VERSION,
        num_threads=torch.get_num_threads(),
    )
    state = apply(State(), started)
    log.append(started)
    log.commit()
    parts = make_parts(config, run_dir, log, metrics, datasets)
    if parts.metrics is not None:
        parts.metrics.rebuild(run_dir, [started])
    return parts, state, "started"


def _resume(config, run_dir, log, records, *, fork: bool, metrics: bool, datasets) -> tuple[Parts, State, str]:
    current = fold(e for _, e in records)
    logged_config = config_in_force(records)
    if current.finished:
        return make_parts(logged_config, run_dir, log, metrics, datasets), current, "finished"
    new_hash = config_hash(config)
    if new_hash != current.config_hash and not fork:
        changes = config_differences(logged_config, config)
        shown = "; ".join(changes[:4]) + (f"; and {len(changes) - 4} more" if len(changes) > 4 else "")
        raise RunError(
            f"{run_dir}: the config differs from the run's ({shown}); pass --fork to continue under the new config"
        )
    point = restore_point(records)
    last_seq = records[-1][0]
    resumed = RunResumed(
        step=point.state.step,
        tokens=point.state.tokens,
        checkpoint=point.checkpoint,
        superseded_first_seq=point.seq + 1,
        superseded_last_seq=last_seq,
        restored=point.state,
        config_hash=point.state.config_hash,
    )
    state = apply(current, resumed)
    log.append(resumed)
    if new_hash != state.config_hash:
        if point.checkpoint and (problem := continuation_problem(logged_config, config)):
            raise RunError(f"{run_dir}: {problem}")
        change = ConfigChanged(
            step=state.step, tokens=state.tokens, config=config, config_hash=new_hash, previous_hash=state.config_hash
        )
        try:
            state = apply(state, change)
        except Exception as exc:  # IllegalTransition: the new config cannot continue this run
            raise RunError(f"{run_dir}: cannot fork in place: {exc}") from None
        log.append(change)
        logged_config = config
    log.commit()
    parts = make_parts(logged_config, run_dir, log, metrics, datasets)
    # With the resume on record and the lock held, checkpoint directories no live event names are
    # garbage by construction: half-written ones, ones written after the restore point (never
    # acknowledged, since the restore point is the last committed checkpoint), retention deletions
    # the dead process did not finish.
    parts.store.remove_orphans(c.checkpoint for c in state.live_checkpoints)
    if point.checkpoint:
        load_checkpoint(parts, state)
    if parts.metrics is not None:
        all_records = [(r.seq, r.event) for r in log.records()]
        parts.metrics.rebuild(run_dir, [e for _, e in effective(all_records)])
    return parts, state, "resumed"
