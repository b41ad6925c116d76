"""What an entry into a run appends, once the engine has carried out its decision (rewind.states.entry):
a start's RunStarted, a resume's RunResumed (+ ConfigChanged when it forks in place), a fork's first
records. Each record is built in one place here (`started_record`, `resumed_record`, `_change`), and a
resume's and a fork's are checked by the fold before anything is written. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from rewind.states.config import Config
from rewind.states.config_identity import config_hash
from rewind.states.entry import Entry, EntryRefused, Fork
from rewind.states.events import RUN_FEATURES, ConfigChanged, Event, ForkOrigin, RunResumed, RunStarted
from rewind.states.fold import IllegalTransition, apply, fold, seed_of
from rewind.states.history import RestorePoint
from rewind.states.state import ForkSeed, State, reference_to_restore


@dataclass(frozen=True)
class Computed:
    """What the engine measured of where this process computes, for the records that say it."""

    device: str
    world_size: int
    num_threads: int
    cpu_capability: str = ""


def opening_records(
    entry: Entry, computed: Computed, *, data: dict | None = None, pretrained: str = "", parent: str = "",
    version: str = "",
) -> tuple[Event, ...]:  # fmt: skip
    """What `entry` appends, given where this process computes (`computed`) and, where they go on record,
    the data's identities (`data`: {"data": ..., "tokenizer": ...}): a start's RunStarted (`pretrained`:
    the identity of the weights it starts from; `version`: this release), a resume's records, a fork's
    (`parent`: the parent run as the child names it). Nothing for the others. EntryRefused when the fold
    refuses them."""
    if entry.how == "started":
        return (started_record(entry.config, computed, version, list(RUN_FEATURES), pretrained, data),)
    point = entry.point
    if point is None or entry.how not in ("resumed", "forked"):
        return ()
    try:
        if entry.how == "resumed":
            return resume_records(
                entry.state, point, entry.end_seq, computed, entry.config if entry.changed else None, data
            )
        assert entry.started is not None and entry.logged is not None
        state = point.state
        origin = ForkOrigin(run=parent, step=state.step, checkpoint=point.checkpoint, config_hash=state.config_hash)
        threads = entry.ask.threads if isinstance(entry.ask, Fork) else 0
        return fork_records(entry.started, point, entry.logged, entry.config, origin, threads, data, version)
    except EntryRefused as exc:
        where = f"{entry.run}: " if entry.how == "resumed" else f"cannot fork {entry.run} at step {point.state.step}: "
        raise EntryRefused(f"{where}{exc}", exc.exit_code) from None


def started_record(
    config: Config, where: Computed, version: str, features: list[str], pretrained: str, data: dict | None,
    parent: ForkOrigin | None = None,
) -> RunStarted:  # fmt: skip
    """The one RunStarted: a run of `config` computing at `where`, with `features` (for life), starting from
    weights `pretrained` ("": the seed's), its data's identities `data` when they go on record."""
    return RunStarted(
        step=0,
        tokens=0,
        config=config,
        config_hash=config_hash(config),
        rewind_version=version,
        parent=parent,
        num_threads=where.num_threads,
        cpu_capability=where.cpu_capability,
        device=where.device,
        world_size=where.world_size,
        features=features,
        pretrained=pretrained,
        **(data or {}),
    )


def resumed_record(
    point: RestorePoint, last_seq: int, computed: Computed | None = None, seed: ForkSeed | None = None
) -> RunResumed:
    """The one RunResumed: going on from `point`, superseding the records after it through `last_seq`,
    computing at `computed` (None: a fork's, whose RunStarted says where), with a fork's `seed`."""
    where = {} if computed is None else {
        "device": computed.device, "world_size": computed.world_size, "num_threads": computed.num_threads
    }  # fmt: skip
    return RunResumed(
        step=point.state.step,
        tokens=point.state.tokens,
        checkpoint=point.checkpoint,
        superseded_first_seq=point.seq + 1,
        superseded_last_seq=last_seq,
        config_hash=point.state.config_hash,
        seed=seed,
        **where,
    )


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
    resumed = resumed_record(point, end_seq, computed)
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
    (its compute site, behaviours and pretrained weights; `num_threads` > 0: the user's count), then,
    from a checkpoint, RunResumed seeded with the parent's control state and ConfigChanged when the
    config differs (`data`: the identities, in a run that records them). The child holds only the
    checkpoints a restart needs: the fork point's and the reference's (none while a refresh is due)."""
    state = point.state
    extra = None if data is None or not started.behaviours.data_identity else data
    # The parent's site: an unchanged fork must compute the same bits (unless the user chose speed), and
    # under compute.device = "auto" it goes on where the parent computed; its behaviours (a run of an
    # older release: its old ones) and pretrained weights too.
    where = Computed(state.device, state.world_size, num_threads or state.num_threads, state.cpu_capability)
    child = started_record(config, where, version, list(started.features), state.pretrained, extra, origin)
    records: list[Event] = [child]
    if point.checkpoint:
        held = msgspec.structs.replace(state, reference=reference_to_restore(state))
        copied = {point.checkpoint} | ({held.reference.checkpoint} if held.reference else set())
        live = [c for c in held.live_checkpoints if c.checkpoint in copied]
        seed = seed_of(msgspec.structs.replace(held, live_checkpoints=live))
        records.append(resumed_record(RestorePoint(point.checkpoint, 0, held), 0, seed=seed))
        if config_hash(parent_config) != child.config_hash:
            records.append(_change(held, config, extra))
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
