"""Opening a run directory to train: start a new run, or resume one from its log.

Resume never guesses: the log is folded, the restore point is the fold's own anchor (the last committed
checkpoint that is still effective, or the start), and a RunResumed event records what it supersedes.
A config that differs from the run's is refused unless the caller forks in place (then a ConfigChanged
records the new one). All of that is decided and built, before anything is written, the way every entry
is (rewind.engine.run.entry.enter); here the log is then opened for writing and the opening recorded.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rewind.engine.data.rundata import publish_run_data
from rewind.engine.model.ranks import Failure, first_failure, is_writer, shared_event
from rewind.engine.run.entry import REWIND_VERSION, Entered, enter
from rewind.engine.run.journal import FollowerJournal, Journal
from rewind.engine.run.loop import Run, record
from rewind.engine.run.parts import Parts, RunError
from rewind.states.config import Config
from rewind.states.entry import Train
from rewind.states.events import Event
from rewind.states.history import skip_ranges
from rewind.states.state import State
from rewind.stores import snapshots
from rewind.stores.checkpoints import ORPHANED_DIR
from rewind.stores.eventlog import EventLog
from rewind.stores.folding import FoldedLog, save_snapshot
from rewind.stores.fsio import filesystem
from rewind.stores.metrics import MetricsProjection

__all__ = ["REWIND_VERSION", "RunError", "open_run"]


def check_directory(run_dir: str) -> None:
    """Refuse a run directory that could never be written, before anything is read or built."""
    if "://" in run_dir:
        return
    path = Path(run_dir)
    if path.exists() and not path.is_dir():  # mkdir(exist_ok=True) would only say "File exists"
        raise RunError(f"{run_dir}: not a directory")
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        raise RunError(f"{run_dir}: the run directory is not writable")


def prepare_directory(run_dir: str) -> None:
    if "://" in run_dir:
        return  # object stores: nothing to create up front
    check_directory(run_dir)
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunError(f"{run_dir}: cannot create the run directory ({exc.strerror})") from None
    if not path.is_dir():
        raise RunError(f"{run_dir}: not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise RunError(f"{run_dir}: the run directory is not writable")


def metrics_for(run_dir: str, enabled: bool) -> MetricsProjection | None:
    """The metrics projection of a run on a local filesystem (a path or a file:// URL). Object stores
    get none: TensorBoard's writer appends to local files; the summary says so and `rewind export
    tensorboard` rebuilds them anywhere from the log."""
    return MetricsProjection(run_dir) if enabled and filesystem(run_dir).is_local else None


def open_run(
    config: Config | None,
    run_dir: str,
    *,
    fork: bool = False,
    metrics: bool = True,
    threads: int = 0,
    note: Callable[[str], None] = lambda line: None,
    base_dir: str | None = None,
) -> tuple[Run, State, str]:
    """Returns (run, state, how) with how in {"started", "resumed", "finished"}. The log stays open
    (and locked) in run.journal; the caller closes it. `config` None: the config the run logged
    (`rewind resume`); `fork`: go on under a config that differs (rewind.states.entry.Train). `base_dir`:
    the config file's directory, where reward modules are looked for first (DataHome.base_dir; None: the
    working directory alone).

    CPU threads: a new run computes with this process's count, a resume with the run's; `threads` > 0
    (the user's --threads) with that many instead. Either is recorded (RunStarted / RunResumed), and
    what the user should know about it (a count adopted, bits that may differ) goes to `note`.

    In two phases, so that a start or resume that fails leaves the directory as it was: the log is
    read (no lock, nothing written), every check made and the live objects built; only then is the
    log opened for writing (which takes the lock and cuts a torn tail) and the opening records appended."""
    check_directory(run_dir)
    failure: BaseException | None = None
    try:  # read, decided, its site adopted (and the process group joined), built: nothing written
        opening = _Opening.of(enter(Train(config, fork, threads), run_dir, base_dir=base_dir))
        if opening.how == "resumed" and opening.note:  # (a start records its count; nothing to say)
            note(opening.note)
    except RunError as exc:
        failure = exc
    # Every process of a sharded run read the log before rank 0 writes to it; they go on together or not at all.
    together(failure)
    if not is_writer():
        together(None)  # rank 0 opening the log for writing
        return opening.carry_out(FollowerJournal(), metrics=False)
    try:
        prepare_directory(run_dir)
        # "tail": the writer trusts sealed segments whose index checks out, so a resume reads the tail;
        # damage further back is found by whoever reads it (`rewind verify` reads everything).
        log = EventLog.open(run_dir, "w", check="tail")
    except BaseException as exc:
        together(exc)
        raise
    together(None)
    try:
        _check_unchanged(run_dir, log, opening.end_seq)
        journal = Journal(log, None, opening.parts.config.logging.report_interval)
        return opening.carry_out(journal, metrics)
    except BaseException:
        log.close()
        raise


def together(failure: BaseException | None) -> None:
    """Raise `failure`; in a sharded run, every rank raises the failure of the lowest rank that failed
    (as a RunError with its message and exit code), so all stop together and with one message."""
    shared = first_failure(None if failure is None else Failure(str(failure), getattr(failure, "exit_code", 1)))
    if shared is None:
        return
    if failure is not None:
        raise failure  # its own, whatever its type (the command reports each as it always has)
    raise RunError(shared.message, shared.exit_code)


@dataclass
class _Opening:
    """What the read phase decided, with the live objects built: `carry_out` only records it."""

    run_dir: str
    how: str  # "started", "resumed" or "finished"
    parts: Parts
    end_seq: int  # the log's last record when it was read (-1: no log yet)
    state: State = field(default_factory=State)
    events: tuple[Event, ...] = ()  # the opening records, in order
    folded: FoldedLog | None = None
    restore_seq: int = -1
    restore_step: int = 0
    note: str = ""  # what the user should know of the thread count

    @classmethod
    def of(cls, entered: Entered) -> _Opening:
        entry, point = entered.entry, entered.entry.point
        assert entered.parts is not None
        return cls(
            entry.run, entry.how, entered.parts, entry.end_seq, entry.state, entered.records, entered.folded,
            point.seq if point is not None else -1, point.state.step if point is not None else 0, entered.note,
        )  # fmt: skip

    def carry_out(self, journal: Journal | FollowerJournal, metrics: bool) -> tuple[Run, State, str]:
        """Record the opening (rank 0 writes it; the other ranks of a sharded run apply rank 0's events)."""
        run = Run(self.parts, journal)
        if self.how == "finished":
            return run, self.state, "finished"
        writes = isinstance(journal, Journal)
        if writes:
            journal.metrics = metrics_for(self.run_dir, metrics)
        if self.how == "started":
            if writes:
                publish_run_data(self.parts.datasets.home, self.parts.config, self.run_dir)  # now, with the lock held
                if journal.metrics is not None:
                    journal.metrics.resume(-1, 0)  # a directory left by a start that died before its first record
            return run, record(run, State(), shared_event(self.events[0] if writes else None)), "started"
        assert self.folded is not None
        if writes:
            if journal.metrics is not None:
                _catch_up_metrics(journal.metrics, journal.log, self.folded, self.restore_seq, self.restore_step)
            snapshots.discard_after(self.run_dir, journal.log.next_seq - 1)  # caches of records now gone
        state = self.state
        for event in self.events:  # a ConfigChanged's effect rebuilds the live objects for the new config
            state = record(run, state, shared_event(event if writes else None))
        journal.report_interval = run.parts.config.logging.report_interval
        if not writes:
            return run, state, "resumed"
        save_snapshot(self.run_dir, state, self.events[-1], run.parts.config)
        # With the resume on record and the lock held, the store's own temporaries are debris; any other
        # directory no live event names is kept, moved aside: it may be a checkpoint whose record was lost.
        _, moved = run.parts.store.set_aside_orphans(c.checkpoint for c in state.live_checkpoints)
        if moved:
            warnings.warn(OrphansSetAside(self.run_dir, moved), stacklevel=2)
        return run, state, "resumed"


class OrphansSetAside(UserWarning):
    """Resume moved checkpoints the log does not name under checkpoints/orphaned/ (kept, not deleted)."""

    def __init__(self, run_dir: str, names: list[str]):
        super().__init__(
            f"{run_dir}: {len(names)} checkpoint(s) the log does not name moved to "
            f"checkpoints/{ORPHANED_DIR}/ (kept; delete them when no longer wanted): {', '.join(names)}"
        )
        self.names = names


def _check_unchanged(run_dir: str, log: EventLog, end_seq: int) -> None:
    """The log, now locked, still ends where it did when it was read (a torn tail cut off apart)."""
    if log.next_seq - 1 != end_seq:
        raise RunError(f"{run_dir}: another process wrote to the run while it was being opened; try again", 1)


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
