"""Forking: a new run that starts from another run's checkpoint, usually under a changed config.

The child is an ordinary run directory that owns copies of the checkpoints it starts from, so the
parent can go on (or be deleted) without breaking it. Its log begins

    RunStarted(config=child's, parent=ForkOrigin(run, step, checkpoint, config_hash))
    RunResumed(checkpoint=C, seed=<the parent's control state at C>)          (absent when forking at step 0)
    ConfigChanged(config=child's)                                            (only if the config differs)

which is the same shape an in-place `rewind train --fork` leaves, so resuming, replaying and diffing a
child need nothing special. Nothing is written to the parent. Where the child starts, under which config,
and its first records are decided and built as every entry's are (rewind.engine.run.entry.enter); here
the child's directory is written.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from rewind.engine.data.rundata import copy_run_data
from rewind.engine.run.entry import ENTRY_ERRORS, enter, one_line
from rewind.engine.run.journal import Journal
from rewind.engine.run.loop import Run, record
from rewind.engine.run.parts import RunError
from rewind.engine.run.session import metrics_for, prepare_directory
from rewind.states.config import Config
from rewind.states.entry import Fork
from rewind.states.fold import fold
from rewind.states.history import RestorePoint
from rewind.states.state import State
from rewind.stores.checkpoints import CheckpointStore
from rewind.stores.eventlog import EventLog
from rewind.stores.rollouts import RolloutError, read_rollouts, write_rollouts
from rewind.stores.trunks import TrunkStore


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
    entered = enter(Fork(at_step, config_of_child, num_threads), parent_dir, base_dir=base_dir)
    if entered.note:
        note(entered.note)
    point, parent_config, home = entered.entry.point, entered.entry.logged, entered.home
    assert point is not None and parent_config is not None and home is not None and entered.parts is not None
    config, preamble = entered.entry.config, entered.records
    parts, state = entered.parts, fold(preamble)
    parent_store = CheckpointStore(parent_dir)
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
        except ENTRY_ERRORS as exc:  # the parent's files, read again to be copied: said as an entry says them
            raise one_line(exc, parent_dir, None) from None
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
