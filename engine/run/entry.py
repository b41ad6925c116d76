"""Entering a run, carried out: the one way a start, a resume (or a fork in place), a fork into a new run,
a replay and the read-only opens (sample, eval, export) go in.

`enter` reads the run's log once (`read_log`), asks the pure decision (rewind.states.entry.decide) where
the entry goes on from, under which config and where it computes, joins the process group and adopts
that site (rewind.engine.run.assemble.enter_site), opens the data and builds the live objects (or, for a
read, the checkpoint's model alone), and says what the entry appends (rewind.states.opening). Nothing is
written here: a start or resume records its records in rewind.engine.run.session, a fork in
rewind.engine.run.fork. `enter` is also the one place where what an entry can raise (a refusal, data
that changed, a checkpoint that does not load, a device this machine lacks, a damaged log) becomes a
one-line RunError with its exit code (`one_line`), for every command.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec
import torch

from rewind.engine.data.rundata import (
    DATA_ERRORS,
    DataChanged,
    check_data,
    home_of,
    identities,
    open_registry,
    read_only_home,
    replace_config_data,
    start_home,
)
from rewind.engine.data.tokenizer import TokenizerError
from rewind.engine.data.userdata import DataHome
from rewind.engine.model.checkpoint_model import load_model
from rewind.engine.model.placement import PlacementError, device_record, join_process_group
from rewind.engine.run.assemble import adopt_site, assemble, enter_site
from rewind.engine.run.parts import Parts, RunError, fresh_parts, open_datasets
from rewind.states.entry import Ask, Entry, EntryRefused, LogView, ReadCheckpoint, Train, decide
from rewind.states.events import Event, RunStarted
from rewind.states.fold import fold
from rewind.states.history import RestorePoint, config_in_force, effective
from rewind.states.opening import Computed, opening_records
from rewind.states.state import State
from rewind.stores.checkpoints import CheckpointError, CheckpointStore
from rewind.stores.eventlog import EventLog, LogError, LogNotFoundError
from rewind.stores.folding import FoldedLog, fold_log
from rewind.stores.lock import LogLockedError
from rewind.stores.orphans import LogEnd, lost_record_problems
from rewind.stores.rollouts import RolloutError
from rewind.stores.trunks import TrunkStore

try:
    REWIND_VERSION = metadata.version("rewind")
except metadata.PackageNotFoundError:  # running from a checkout that was never installed
    REWIND_VERSION = "0+unknown"


@dataclass
class Entered:
    """An entry carried out, nothing written yet: the decision, what it appends (`records`), the live
    objects it computes with (`parts`; a read: the checkpoint's `model`), its data home, what the user
    should know of its thread count (`note`), and what was read of the log (`view`; a resume's `folded`,
    whose tail the metrics' catch-up reads)."""

    entry: Entry
    view: LogView
    records: tuple[Event, ...] = ()
    parts: Parts | None = None
    model: Any = None  # rewind.engine.model.model.GPT, for sample and eval
    home: DataHome | None = None
    note: str = ""
    folded: FoldedLog | None = None


class RunTokenizerError(Exception):
    """The run's own tokenizer file (RUN/data/tokenizer.json) does not read: the run's state, not its config."""


# What an entry can raise that is a line for the user, not a bug: `one_line` says each.
ENTRY_ERRORS = (
    RunError, EntryRefused, DataChanged, RunTokenizerError, *DATA_ERRORS, PlacementError, CheckpointError,
    RolloutError, LogError,
)  # fmt: skip


def enter(ask: Ask, run: str, *, base_dir: str | None = None) -> Entered:
    """Carry out `ask` on run `run` (a fork: the parent) up to what it appends; RunError, one line, for
    anything that stops it. `base_dir`: the config file's directory, where reward modules are looked for
    first (DataHome.base_dir; None: the working directory alone)."""
    entry: Entry | None = None
    try:
        with read_log(run, history=not isinstance(ask, Train)) as (view, folded, log):
            entry = decide(ask, view, intact=lambda point: _intact(CheckpointStore(run), point))
            if entry.how == "resumed":
                _check_nothing_lost(entry, folded, log)
            return _carry_out(entry, view, folded, base_dir)
    except ENTRY_ERRORS as exc:
        if isinstance(exc, LogLockedError):
            raise
        raise one_line(exc, run, entry) from None


def one_line(exc: BaseException, run: str, entry: Entry | None) -> RunError:
    """The one line (and exit code) an entry's failure `exc` is for the user."""
    if isinstance(exc, RunError):
        return exc
    if isinstance(exc, EntryRefused):
        return RunError(str(exc), exc.exit_code)
    if isinstance(exc, DataChanged):
        return RunError(
            f"{run}: {exc}; the run's data changed under it (`rewind verify --data {run}`)", 1
        )
    if isinstance(exc, CheckpointError):
        named = f" {entry.point.checkpoint}" if entry is not None and entry.point is not None else ""
        return RunError(f"{run}: cannot load checkpoint{named}: {exc}", 1)
    if isinstance(exc, RolloutError | LogError):  # the run's own files: damaged, or not what they say
        return RunError(f"{run}: {exc}", 1)
    if isinstance(exc, RunTokenizerError):
        return RunError(f"{run}: the run's tokenizer: {exc}", 1)
    return RunError(str(exc), 2)  # the config names data or a device that is not what it says


def _run_home(run: str, state: State, *, base_dir: str | None = None, read_only: bool = False) -> DataHome:
    """The data home of an existing run (rewind.engine.data.rundata.home_of, or read_only_home)."""
    try:
        return read_only_home(run, state) if read_only else home_of(run, state, base_dir=base_dir)
    except TokenizerError as exc:
        raise RunTokenizerError(str(exc)) from None


@contextlib.contextmanager
def read_log(run: str, *, history: bool) -> Iterator[tuple[LogView, FoldedLog | None, EventLog | None]]:
    """The one reader of a run's log for an entry, read-only (no lock, nothing written; a live run is
    fine), open while the caller decides: every record (`history`: a fork, a replay and the reads search
    the run's history), else the fold from the newest snapshot the log vouches for (a resume needs only
    the fold's restore anchor: rewind.stores.folding.fold_log), with that fold."""
    try:
        log = EventLog.open(run)
    except LogNotFoundError:
        log = None
    if log is None:
        yield LogView(run, found=False), None, None
        return
    with log:
        if not log.next_seq:  # a start that died before its first record
            yield LogView(run), None, log
        elif history:
            records = [(r.seq, r.event) for r in log.records()]  # each admitted (rewind.stores.trust)
            if not records or not isinstance(records[0][1], RunStarted):  # refused by the decision
                yield LogView(run, end_seq=records[-1][0] if records else -1), None, log
                return
            state = fold(e for _, e in records)
            view = LogView(run, True, state, config_in_force(records), records[-1][0], effective(records))
            yield view, None, log
        else:
            folded = fold_log(log, run, CheckpointStore(run))
            yield LogView(run, True, folded.state, folded.config, folded.end_seq), folded, log


def _check_nothing_lost(entry: Entry, folded: FoldedLog | None, log: EventLog | None) -> None:
    """A resume goes on only from a log that holds every record it acknowledged (rewind.stores.orphans)."""
    assert folded is not None and log is not None and entry.point is not None
    current, run = entry.state, entry.run
    end = LogEnd(folded.end_seq, current.step, lambda: max((r.event.step for r in log.records()), default=0))
    live = [c.checkpoint for c in current.live_checkpoints]
    interval = folded.config.logging.report_interval
    lost = lost_record_problems(CheckpointStore(run), live, entry.point.checkpoint, end, interval)
    if lost:
        raise RunError(
            f"{run}: the event log lost acknowledged records, nothing was changed ({lost[0]}; "
            f"`rewind verify {run}` lists what is missing)",
            1,
        )


def _carry_out(entry: Entry, view: LogView, folded: FoldedLog | None, base_dir: str | None) -> Entered:
    run, point, ask = entry.run, entry.point, entry.ask
    if entry.how == "finished":  # nothing to compute: the live objects of its config, for the caller to close
        if entry.compute is not None:
            join_process_group(entry.compute)  # (a sharded run's model is placed in its group)
        home = _run_home(run, entry.state, base_dir=base_dir)
        return Entered(entry, view, parts=fresh_parts(entry.config, run, open_datasets(entry.config, home)))
    if isinstance(ask, ReadCheckpoint):
        return _read(entry, view)
    threads = getattr(ask, "threads", 0)
    placement, note = enter_site(entry.config, entry.site, threads, join=entry.compute)
    home = _home(entry, base_dir)
    computed = Computed(
        device_record(placement.device), placement.world_size, torch.get_num_threads(),
        torch.backends.cpu.get_cpu_capability(),
    )  # fmt: skip
    # The data the run recorded is checked (cheaply) before anything is built: a dataset the new config
    # declares differently is a change on record (ConfigChanged's identities), not a surprise. Built for
    # the config the entry goes on under (so that the old config's datasets, perhaps moved since, are
    # never opened), from the restore point's tensors.
    logged = entry.logged or entry.config
    recorded = replace_config_data(entry.config, logged)
    checked = entry.state if entry.how == "resumed" else point.state if point is not None else None
    if entry.how == "forked":  # the child is built from its first records: the parent's state, seeded
        data, parent = _data(entry, home), _run_identity(run)
        records = opening_records(entry, computed, data=data, parent=parent, version=REWIND_VERSION)
        built = assemble(entry.config, run, fold(records[:2]), home, recorded=recorded, checked=checked)
    else:
        at = point.state if point is not None else None
        built = assemble(entry.config, run, at, home, recorded=recorded, checked=checked)
        records = opening_records(
            entry, computed, data=_data(entry, home), pretrained=built.pretrained, version=REWIND_VERSION
        )
    return Entered(entry, view, records, built.parts, home=home, note=note, folded=folded)


def _home(entry: Entry, base_dir: str | None) -> DataHome:
    """Where the entry reads its data: a start's is decided now; a resume's and a replay's is the run's;
    a fork's is the parent's, read-only (documents tokenised into a scratch directory)."""
    if entry.how == "started":
        return start_home(entry.config, entry.run, base_dir=base_dir)
    if entry.how == "resumed":
        return _run_home(entry.run, entry.state, base_dir=base_dir)
    assert entry.point is not None
    if entry.how == "forked":
        return dataclasses.replace(_run_home(entry.run, entry.point.state, read_only=True), base_dir=base_dir)
    return _run_home(entry.run, entry.point.state)


def _data(entry: Entry, home: DataHome) -> dict | None:
    """The data's identities as they go on record: a start's; a fork's (those declared as the parent did
    keep the parent's identity); a resume's only with a config change, in a run that records them."""
    if entry.how == "started":
        return {"data": identities(entry.config, home), "tokenizer": home.tokenizer.identity}
    point = entry.point
    assert point is not None
    if entry.how == "forked" or (entry.changed and entry.state.behaviours.data_identity):
        before = point.state if entry.how == "forked" else entry.state
        return {
            "data": identities(entry.config, home, before.data, entry.logged),
            "tokenizer": home.tokenizer.identity,
        }
    return None


def _read(entry: Entry, view: LogView) -> Entered:
    """Sample and eval: the site adopted and the checkpoint's model loaded, as a resume from it would
    build it (the layout of its restore point, the config in force there); export: nothing to compute."""
    point = entry.point
    assert point is not None
    if entry.site is None:
        return Entered(entry, view)
    note = adopt_site(entry.site)
    ref = next(c for c in entry.state.live_checkpoints if c.checkpoint == point.checkpoint)
    model = load_model(entry.config, CheckpointStore(entry.run), ref.checkpoint, ref.files, point.state.layout)[0]
    return Entered(entry, view, model=model, note=note)


def open_checkpoint_data(entered: Entered, name: str):
    """The run's datasets and tokenizer as the run reads them at the entered checkpoint (eval's): dataset
    `name`'s data is checked against the run's record first (one line, exit 1, when it changed; the
    others are not looked at). Nothing is written to the run: documents it never tokenised go to a
    scratch directory."""
    entry = entered.entry
    point = entry.point
    assert point is not None
    try:
        home = _run_home(entry.run, point.state, read_only=True)
        scored = msgspec.structs.replace(entry.config, data={k: v for k, v in entry.config.data.items() if k == name})
        if changes := check_data(scored, point.state, home):
            raise DataChanged(changes)
        return open_registry(entry.config, home), home.tokenizer
    except ENTRY_ERRORS as exc:
        raise one_line(exc, entry.run, entry) from None


def _intact(store: CheckpointStore, point: RestorePoint) -> bool:
    """Whether the checkpoint of `point` is whole on disk: its files hash as the log recorded, and so do
    the frozen stacks' files it names (RUN/trunks/<sha256>)."""
    ref = point.state.last_checkpoint
    assert ref is not None
    if store.verify(ref.checkpoint, ref.files):
        return False
    trunks = TrunkStore(store.run_dir)
    try:
        named = store.load_manifest(ref.checkpoint).meta.get("trunks", {})
        if not isinstance(named, dict):
            return False
        for digest in named.values():
            trunks.read(digest)
    except CheckpointError:
        return False
    return True


def _run_identity(run: str) -> str:
    """How a fork's child names its parent: the resolved path, or the URL of a run on an object store."""
    return run if "://" in run else str(Path(run).resolve())
