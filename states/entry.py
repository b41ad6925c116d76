"""Entering a run at a restore point under a config: what a start, a resume, a fork (in place or into a
new directory), a replay and the read-only opens (sample, eval, export) decide before the engine builds
anything. Pure: the engine supplies what it measured (where this process computes, the data's
identities) and assembles the live objects for the decision (rewind.engine.run.assemble).

The rules, stated once: a run's tokenizer is fixed when it starts; the records an entry appends are
RunStarted, or RunResumed (+ ConfigChanged when the config differs), each checked by the fold before
anything is written; the data's identities go on record with a config change only in runs that record
them ("data_identity"); a run computes where its record says (`Site`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from rewind.states.config import Config
from rewind.states.config_identity import config_hash
from rewind.states.events import ConfigChanged, Event, ForkOrigin, RunResumed, RunStarted
from rewind.states.fold import IllegalTransition, apply, fold, seed_of
from rewind.states.history import RestorePoint, SeqEvent, restore_points
from rewind.states.state import State, reference_to_restore


class EntryRefused(Exception):
    """The run cannot be entered as asked. exit_code: 2 for the request or config, 1 for the run's state."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Site:
    """Where a run computes, as its record says: what an entry adopts before its first tensor. `reading`:
    an entry that only reads the run (replay, sample) goes on on the CPU where the recorded CUDA is
    missing; one that trains is refused there instead."""

    cpu_capability: str
    device: str
    num_threads: int
    reading: bool = False


def site_of(state: State, *, reading: bool = False, num_threads: int | None = None) -> Site:
    """The site `state` records (`num_threads`: the count of the restore point a resume goes on from)."""
    threads = state.num_threads if num_threads is None else num_threads
    return Site(state.cpu_capability, state.device, threads, reading)


def checkpoint_points(records: Sequence[SeqEvent]) -> list[RestorePoint]:
    """Every restore point a checkpoint makes, once per checkpoint, as of where it was made (a later
    resume from it and a config change there are in what follows), in log order."""
    points: dict[str, RestorePoint] = {}
    for point in restore_points(records):
        if point.checkpoint:
            points.setdefault(point.checkpoint, point)
    return list(points.values())


def choose_point(
    points: Sequence[RestorePoint],
    *,
    name: str | None = None,
    step: int | None = None,
    at_or_before: int | None = None,
    first: bool = False,
) -> RestorePoint | None:
    """The one way an entry chooses where it starts among `points` (in log order; what the caller can
    use: live, on disk, intact): the checkpoint called `name`, or one made at `step`, or any at or
    before step `at_or_before`; of those that qualify, the last (`first`: the earliest). None: none does."""
    qualifying = [
        p
        for p in points
        if (name is None or p.checkpoint == name)
        and (step is None or p.state.step == step)
        and (at_or_before is None or p.state.step <= at_or_before)
    ]
    if not qualifying:
        return None
    return qualifying[0] if first else qualifying[-1]


def tokenizer_problem(old: Config, new: Config) -> str:
    """Why a run of `old` cannot go on under `new` for its tokenizer ("" if it can)."""
    if old.tokenizer == new.tokenizer:
        return ""
    return (
        "tokenizer: a run's tokenizer is fixed when it starts (its token ids are what the weights learned; "
        "a fork keeps its parent's); start a new run for another tokenizer"
    )


@dataclass(frozen=True)
class Computed:
    """What the engine measured of where this process computes, for the records that say it."""

    device: str
    world_size: int
    num_threads: int


def resume_records(
    current: State,
    point: RestorePoint,
    end_seq: int,
    computed: Computed,
    changed_to: Config | None = None,
    data: dict | None = None,
) -> tuple[Event, ...]:
    """The records a resume from `point` appends to a log that ends at `end_seq` and folds to `current`:
    RunResumed, and ConfigChanged to `changed_to` (a fork in place; `data`: the identities a run that
    records them puts on record with it). Checked by the fold: EntryRefused when it refuses them."""
    resumed = RunResumed(
        step=point.state.step,
        tokens=point.state.tokens,
        checkpoint=point.checkpoint,
        superseded_first_seq=point.seq + 1,
        superseded_last_seq=end_seq,
        config_hash=point.state.config_hash,
        device=computed.device,
        world_size=computed.world_size,
        num_threads=computed.num_threads,
    )
    try:
        after = apply(current, resumed)
        if changed_to is None:
            return (resumed,)
        change = _change(after, changed_to, data if current.behaviours.data_identity else None)
        apply(after, change)
        return resumed, change
    except IllegalTransition as exc:
        # The new config cannot go on from here (2, a config problem); the log's own resume cannot (1).
        what, code = ("fork in place", 2) if changed_to is not None else ("resume", 1)
        raise EntryRefused(f"cannot {what}: {exc}", code) from None


def fork_records(
    started: RunStarted,
    point: RestorePoint,
    parent_config: Config,
    config: Config,
    origin: ForkOrigin,
    num_threads: int,
    data: dict | None,
    version: str,
) -> tuple[Event, ...]:
    """The log a fork of the run that `started` begins, at the parent's restore `point` (where
    `parent_config` is in force) under `config` with release `version`: RunStarted naming the parent
    (its compute site, behaviours and pretrained weights), then,
    from a checkpoint, RunResumed seeded with the parent's control state and ConfigChanged when the
    config differs (`data`: the identities, in a run that records them). The child holds only the
    checkpoints a restart needs: the fork point's and the reference's (none while a refresh is due)."""
    state = point.state
    extra = {} if data is None or not started.behaviours.data_identity else data
    child = RunStarted(
        step=0,
        tokens=0,
        config=config,
        config_hash=config_hash(config),
        rewind_version=version,
        parent=origin,
        # The parent's: an unchanged fork must compute the same bits (unless the user chose speed).
        num_threads=num_threads or state.num_threads,
        cpu_capability=state.cpu_capability,
        device=state.device,  # where the parent computed: a fork under compute.device = "auto" goes on there
        world_size=state.world_size,
        features=list(
            started.features
        ),  # and the parent's behaviours (a run of an older release: its old ones)
        pretrained=state.pretrained,
        **extra,
    )
    records: list[Event] = [child]
    if point.checkpoint:
        held = msgspec.structs.replace(state, reference=reference_to_restore(state))
        copied = {point.checkpoint} | ({held.reference.checkpoint} if held.reference else set())
        live = [c for c in held.live_checkpoints if c.checkpoint in copied]
        records.append(
            RunResumed(
                step=held.step,
                tokens=held.tokens,
                checkpoint=point.checkpoint,
                superseded_first_seq=1,
                superseded_last_seq=0,
                config_hash=held.config_hash,
                seed=seed_of(msgspec.structs.replace(held, live_checkpoints=live)),
            )
        )
        if config_hash(parent_config) != child.config_hash:
            records.append(_change(held, config, extra or None))
    try:
        fold(records)
    except IllegalTransition as exc:
        raise EntryRefused(exc.reason) from None
    return tuple(records)


def _change(state: State, config: Config, data: dict | None) -> ConfigChanged:
    return ConfigChanged(
        step=state.step,
        tokens=state.tokens,
        config=config,
        config_hash=config_hash(config),
        previous_hash=state.config_hash,
        **(data or {}),
    )
