"""Forking: a new run that starts from another run's checkpoint, usually under a changed config.

The child is an ordinary run directory that owns copies of the checkpoints it starts from, so the
parent can go on (or be deleted) without breaking it. Its log begins

    RunStarted(config=child's, parent=ForkOrigin(run, step, checkpoint, config_hash))
    RunResumed(checkpoint=C, seed=<the parent's control state at C>)          (absent when forking at step 0)
    ConfigChanged(config=child's)                                            (only if the config differs)

which is the same shape an in-place `rewind train --fork` leaves, so resuming, replaying and diffing a
child need nothing special. Nothing is written to the parent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from rewind.engine.data.rundata import (
    DATA_ERRORS,
    DataChanged,
    copy_run_data,
    identities,
    read_only_home,
    replace_config_data,
)
from rewind.engine.model.placement import PlacementError
from rewind.engine.run.assemble import assemble, enter_site
from rewind.engine.run.journal import Journal
from rewind.engine.run.loop import Run, record
from rewind.engine.run.parts import RunError
from rewind.engine.run.session import REWIND_VERSION, metrics_for, prepare_directory
from rewind.states.check_continuation import change_problem
from rewind.states.config import Config
from rewind.states.entry import (
    EntryRefused,
    choose_point,
    fork_records,
    site_of,
)
from rewind.states.events import ForkOrigin, RunStarted
from rewind.states.fold import fold
from rewind.states.history import RestorePoint, SeqEvent, config_in_force, effective, restore_points
from rewind.states.state import State
from rewind.stores.checkpoints import CheckpointError, CheckpointStore
from rewind.stores.eventlog import EventLog
from rewind.stores.rollouts import RolloutError, read_rollouts, write_rollouts
from rewind.stores.runs import read_seq_events
from rewind.stores.trunks import TrunkStore
from rewind.stores.trust import RecordChecker


def fork_point(records: list[SeqEvent], at_step: int, store: CheckpointStore) -> tuple[RestorePoint, Config]:
    """The last restore point at or before `at_step` whose checkpoint is live and intact on disk, the
    frozen stacks' files it names included (an older one is still a faithful starting point when a
    newer one is damaged: the checkpoint taken before a growth, at the same step as the one after it,
    needs none of the files the growth froze), or the run's start; and the config in force there."""
    records = effective(records)  # the points index into these
    points = restore_points(records)
    live = {c.checkpoint for c in fold(e for _, e in records).live_checkpoints}  # not deleted by retention since
    held = [p for p in points if p.checkpoint and p.state.last_checkpoint and p.state.last_checkpoint.checkpoint in live]
    while (point := choose_point(held, at_or_before=at_step)) is not None:
        ref = point.state.last_checkpoint
        assert ref is not None
        if not store.verify(ref.checkpoint, ref.files) and _trunks_intact(store, ref.checkpoint):
            return point, config_in_force(records[: point.index])
        held = [p for p in held if p is not point]  # damaged or missing on disk
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
    start = [p for p in points if not p.checkpoint][-1]
    return start, config_in_force(records[: start.index])


def _trunks_intact(store: CheckpointStore, name: str) -> bool:
    """Whether every frozen stack's file checkpoint `name` names (RUN/trunks/<sha256>) is there and
    hashes to its name."""
    trunks = TrunkStore(store.run_dir)
    try:
        named = store.load_manifest(name).meta.get("trunks", {})
        if not isinstance(named, dict):
            return False
        for digest in named.values():
            trunks.read(digest)
    except CheckpointError:
        return False
    return True


def _run_identity(run_dir: str) -> str:
    return run_dir if "://" in run_dir else str(Path(run_dir).resolve())


def _copy_rollouts(parent_dir: str, child_dir: str, record) -> None:
    """The rollout file `record` names, read (checked against its hash) and written into the child: the
    same tensors make the same bytes, so the same name."""
    tensors, metadata = read_rollouts(parent_dir, record.path, record.sha256)
    if write_rollouts(child_dir, tensors, metadata) != (record.path, record.sha256):
        raise RolloutError(f"copying {record.path} gave other bytes: the copy is not faithful")


def _copy_checkpoint(parent: CheckpointStore, child: CheckpointStore, ref) -> None:
    """Re-write the parent's checkpoint into the child through the durable write path. Same tensors and
    metadata give the same bytes, hence the same name and hashes, which is checked."""
    manifest = parent.load_manifest(ref.checkpoint)
    groups = parent.load(ref.checkpoint, ref.files)
    # Frozen stacks' weights live beside the checkpoints (stores.trunks): first, so the copy never
    # names a file the child lacks.
    parent_trunks, child_trunks = TrunkStore(parent.run_dir), TrunkStore(child.run_dir)
    for digest in manifest.meta.get("trunks", {}).values():
        parent_trunks.copy_to(child_trunks, digest)
    written = child.write(manifest.step, groups, manifest.meta, format_version=manifest.format_version)
    if written.name != ref.checkpoint or written.files != dict(ref.files):
        raise RunError(f"copying checkpoint {ref.checkpoint} gave {written.name}: the copy is not faithful", 1)


def open_fork(
    parent_dir: str,
    at_step: int,
    config_of_child,
    child_dir: str,
    *,
    metrics: bool = True,
    num_threads: int = 0,
    note: Callable[[str], None] = lambda line: None,
    base_dir: str | None = None,
) -> tuple[Run, State, RestorePoint, Config]:
    """Create the child run and return it ready to drive (log open and locked in run.journal).

    `config_of_child(parent_config) -> Config` makes the child's config from the parent's config in
    force at the fork point (e.g. by applying --set overrides); it may raise ConfigError. The child
    records the parent's CPU thread count there, or `num_threads` (> 0: the user's --threads); what the
    user should know about it goes to `note`. `base_dir`: the directory of the child's config file
    (`rewind fork --config FILE`), where its grpo reward modules are looked for first
    (DataHome.base_dir; None: the working directory alone)."""
    records = read_seq_events(parent_dir)
    if not records or not isinstance(records[0][1], RunStarted):
        raise RunError(f"{parent_dir}: the event log is empty or does not start with RunStarted", 1)
    checker = RecordChecker()  # the parent's log is untrusted input like any other
    for seq, event in records:
        checker.check(seq, event)
    last_step = fold(e for _, e in records).step
    if not 0 <= at_step <= last_step:
        raise RunError(f"--at-step {at_step}: {parent_dir} has reached step {last_step} (choose 0..{last_step})")
    parent_store = CheckpointStore(parent_dir)
    point, parent_config = fork_point(records, at_step, parent_store)
    config = config_of_child(parent_config)
    at = point.state
    origin = ForkOrigin(
        run=_run_identity(parent_dir), step=at.step, checkpoint=point.checkpoint, config_hash=at.config_hash
    )
    # The parent's tokenizer, and its data as it recorded it (a dataset the child declares as the parent
    # did must be unchanged); documents are tokenised into a scratch directory, copied into the child's
    # with its checkpoints: nothing is written to the parent.
    parent_state = point.state  # what the parent recorded of its data as of the fork point
    if problem := change_problem(parent_config, config, point):
        raise RunError(f"cannot fork {parent_dir} at step {point.state.step}: {problem}")
    try:
        home = dataclasses.replace(read_only_home(parent_dir, parent_state), base_dir=base_dir)
        recorded = identities(config, home, parent_state.data, parent_config)
        data = {"data": recorded, "tokenizer": home.tokenizer.identity}
        preamble = fork_records(records[0][1], point, parent_config, config, origin, num_threads, data, REWIND_VERSION)
        # The live objects for the child's config, from the parent's checkpoint, before the child's
        # directory is touched (a checkpoint that does not load must leave nothing behind).
        site = site_of(point.state, reading=True)  # the parent's kernels, device and thread count there
        _, message = enter_site(config, site, num_threads)
        unchanged = replace_config_data(config, parent_config)
        built = assemble(config, parent_dir, fold(preamble[:2]), home, recorded=unchanged, checked=parent_state)
    except EntryRefused as exc:
        raise RunError(f"cannot fork {parent_dir} at step {point.state.step}: {exc}") from None
    except DataChanged as exc:
        raise RunError(f"cannot fork {parent_dir}: {exc}; its data changed since it recorded it", 1) from None
    except DATA_ERRORS as exc:
        raise RunError(f"cannot fork {parent_dir}: {exc}") from None
    except CheckpointError as exc:
        raise RunError(f"{parent_dir}: cannot load its checkpoint {point.checkpoint}: {exc}", 1) from None
    except PlacementError as exc:
        raise RunError(str(exc)) from None
    if message:
        note(message)
    parts, state = built.parts, fold(preamble)
    child_store = CheckpointStore(child_dir)
    parts = dataclasses.replace(parts, run_dir=child_dir, store=child_store)
    prepare_directory(child_dir)
    log = EventLog.open(child_dir, "w")
    try:
        if any(True for _ in log.records()):
            raise RunError(f"{child_dir}: already holds a run; fork into a new directory")
        try:
            for ref in state.live_checkpoints:  # before the log names them
                _copy_checkpoint(parent_store, child_store, ref)
            if state.rollouts is not None:  # the window's batch the child's next updates read
                _copy_rollouts(parent_dir, child_dir, state.rollouts)
            copy_run_data(home, config, parent_dir, child_dir)
        except CheckpointError as exc:
            raise RunError(f"{parent_dir}: cannot copy its checkpoint: {exc}", 1) from None
        except RolloutError as exc:
            raise RunError(f"{parent_dir}: cannot copy its rollout batch: {exc}", 1) from None
        run = Run(parts, Journal(log, metrics_for(child_dir, metrics), config.logging.report_interval))
        if run.journal.metrics is not None:
            run.journal.metrics.resume(-1, 0)
        state = State()
        for event in preamble:  # a config change rebuilds the live objects for the child's config
            state = record(run, state, event)
        return run, state, point, parent_config
    except BaseException:
        log.close()
        raise
