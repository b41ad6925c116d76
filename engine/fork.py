"""Forking: a new run that starts from another run's checkpoint, usually under a changed config.

The child is an ordinary run directory that owns copies of the checkpoints it starts from, so the
parent can go on (or be deleted) without breaking it. Its log begins

    RunStarted(config=child's, parent=ForkOrigin(run, step, checkpoint, config_hash))
    RunResumed(checkpoint=C, restored=<the parent's control state at C>)      (absent when forking at step 0)
    ConfigChanged(config=child's)                                            (only if the config differs)

which is the same shape an in-place `rewind train --fork` leaves, so resuming, replaying and diffing a
child need nothing special. Nothing is written to the parent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import msgspec

from rewind.engine.loop import Parts, load_checkpoint
from rewind.engine.session import (
    REWIND_VERSION,
    RunError,
    continuation_problem,
    make_parts,
    open_datasets,
    prepare_directory,
)
from rewind.states.config import Config, config_hash
from rewind.states.events import (
    CheckpointCommitted,
    CheckpointDeleted,
    ConfigChanged,
    ForkOrigin,
    RunResumed,
    RunStarted,
)
from rewind.states.fold import IllegalTransition, fold
from rewind.states.history import SeqEvent, anchor_end, config_in_force, is_superseded, superseded_ranges
from rewind.states.state import State
from rewind.stores.checkpoints import CheckpointError, CheckpointStore
from rewind.stores.eventlog import EventLog
from rewind.stores.runs import read_seq_events

replace = msgspec.structs.replace


@dataclass(frozen=True)
class ForkPoint:
    """Where in the parent a fork starts: the checkpoint ("" = the parent's start), its step, the
    parent's control state and config in force there."""

    checkpoint: str
    step: int
    state: State
    config: Config


def fork_point(records: list[SeqEvent], at_step: int, store: CheckpointStore) -> ForkPoint:
    """The last checkpoint at or before `at_step` that is effective, not deleted and intact on disk.

    A checkpoint is anchored by its CheckpointCommitted record or by a RunResumed that restarted from
    it (the first checkpoint of a fork is only ever named by the latter)."""
    ranges = superseded_ranges(records)
    deleted = {e.checkpoint for s, e in records if isinstance(e, CheckpointDeleted) and not is_superseded(s, ranges)}
    for i in range(len(records) - 1, 0, -1):
        seq, event = records[i]
        if not (isinstance(event, CheckpointCommitted | RunResumed) and event.checkpoint and event.step <= at_step):
            continue
        if is_superseded(seq, ranges) or event.checkpoint in deleted:
            continue
        end = anchor_end(records, i)  # with the config change that may follow a resume
        state = fold(e for _, e in records[:end])
        ref = state.last_checkpoint
        if ref is None or ref.checkpoint != event.checkpoint or store.verify(ref.checkpoint, ref.files):
            continue  # damaged or missing on disk: an older one is still a faithful starting point
        # Ranges only ever supersede what follows a restore point, so none reaches back past this
        # effective anchor: the prefix's own effective records are the full log's.
        return ForkPoint(event.checkpoint, event.step, state, config_in_force(records[:end]))
    started = records[0][1]
    assert isinstance(started, RunStarted)
    if started.parent is not None and started.parent.checkpoint:
        # A fork's own history begins at its fork point: "its start" would be weights it never had.
        raise RunError(
            f"--at-step {at_step}: this run is a fork of {started.parent.run} at step {started.parent.step} and "
            "has no intact checkpoint at or before that step; fork its parent instead"
        )
    # The start as it stands now: a crash before the first checkpoint restarts from scratch, maybe
    # under a changed config (RunResumed(checkpoint="") then ConfigChanged).
    starts = [i for i, (s, e) in enumerate(records) if isinstance(e, RunResumed) and not e.checkpoint]
    starts = [i for i in starts if not is_superseded(records[i][0], ranges)] or [0]
    end = anchor_end(records, starts[-1])
    return ForkPoint("", 0, fold(e for _, e in records[:end]), config_in_force(records[:end]))


def _run_identity(run_dir: str) -> str:
    return run_dir if "://" in run_dir else str(Path(run_dir).resolve())


def _copy_checkpoint(parent: CheckpointStore, child: CheckpointStore, ref) -> None:
    """Re-write the parent's checkpoint into the child through the durable write path. Same tensors and
    metadata give the same bytes, hence the same name and hashes, which is checked."""
    manifest = parent.load_manifest(ref.checkpoint)
    groups = parent.load(ref.checkpoint, ref.files)
    written = child.write(manifest.step, groups, manifest.meta)
    if written.name != ref.checkpoint or written.files != dict(ref.files):
        raise RunError(f"copying checkpoint {ref.checkpoint} gave {written.name}: the copy is not faithful", 1)


def open_fork(
    parent_dir: str, at_step: int, config_of_child, child_dir: str, *, metrics: bool = True
) -> tuple[Parts, State, ForkPoint]:
    """Create the child run and return it ready to drive (log open and locked in parts.log).

    `config_of_child(parent_config) -> Config` makes the child's config from the parent's config in
    force at the fork point (e.g. by applying --set overrides); it may raise ConfigError."""
    records = read_seq_events(parent_dir)
    if not records or not isinstance(records[0][1], RunStarted):
        raise RunError(f"{parent_dir}: the event log is empty or does not start with RunStarted", 1)
    last_step = fold(e for _, e in records).step
    if not 0 <= at_step <= last_step:
        raise RunError(f"--at-step {at_step}: {parent_dir} has reached step {last_step} (choose 0..{last_step})")
    parent_store = CheckpointStore(parent_dir)
    point = fork_point(records, at_step, parent_store)
    config = config_of_child(point.config)
    child_hash = config_hash(config)
    origin = ForkOrigin(
        run=_run_identity(parent_dir), step=point.step, checkpoint=point.checkpoint, config_hash=point.state.config_hash
    )
    started = RunStarted(
        step=0,
        tokens=0,
        config=config,
        config_hash=child_hash,
        rewind_version=REWIND_VERSION,
        parent=origin,
        num_threads=point.state.num_threads,  # the parent's: an unchanged fork must compute the same bits
    )
    preamble = [started]
    if point.checkpoint:
        state = point.state
        copied = {point.checkpoint} | ({state.reference.checkpoint} if state.reference else set())
        live = [c for c in state.live_checkpoints if c.checkpoint in copied]
        restored = replace(state, live_checkpoints=live, resumes=[], parent_run=origin.run, stopped_reason="")
        preamble.append(
            RunResumed(
                step=state.step,
                tokens=state.tokens,
                checkpoint=point.checkpoint,
                superseded_first_seq=1,
                superseded_last_seq=0,
                restored=restored,
                config_hash=state.config_hash,
            )
        )
        if child_hash != state.config_hash:
            preamble.append(
                ConfigChanged(
                    step=state.step, tokens=state.tokens, config=config, config_hash=child_hash,
                    previous_hash=state.config_hash,
                )
            )
    if point.checkpoint and (problem := continuation_problem(point.config, config)):
        raise RunError(f"cannot fork {parent_dir} at step {point.step}: {problem}")
    try:  # every check before the child directory is touched
        state = fold(preamble)
    except IllegalTransition as exc:
        raise RunError(f"cannot fork {parent_dir} at step {point.step}: {exc.reason}") from None
    datasets = open_datasets(config)
    prepare_directory(child_dir)
    log = EventLog.open(child_dir, "w")
    try:
        if any(True for _ in log.records()):
            raise RunError(f"{child_dir}: already holds a run; fork into a new directory")
        child_store = CheckpointStore(child_dir)
        try:
            for ref in state.live_checkpoints:  # before the log names them
                _copy_checkpoint(parent_store, child_store, ref)
        except CheckpointError as exc:
            raise RunError(f"{parent_dir}: cannot copy its checkpoint: {exc}", 1) from None
        for event in preamble:
            log.append(event)
        log.commit()
        parts = make_parts(config, child_dir, log, metrics, datasets)
        if point.checkpoint:
            load_checkpoint(parts, state)
        if parts.metrics is not None:
            parts.metrics.rebuild(child_dir, preamble)
        return parts, state, point
    except BaseException:
        log.close()
        raise

