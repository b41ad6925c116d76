"""Entering a run, decided: for a start, a resume (or a fork in place), a fork into a new run, a replay
and the read-only opens (sample, eval, export), `decide` says from what the run's log holds (a
`LogView`) where the entry goes on from (its restore point), under which config, where it computes (its
`Site`), or why it cannot (EntryRefused: the whole line and its exit code). What it then appends is
rewind.states.opening's, from what the engine measured once it adopted the site and opened the data.
Pure: the engine reads the log once, carries the decision out, and is the one place its failures become
a line (rewind.engine.run.entry.enter).

The rules, stated once: whether a run may go on under a config is rewind.states.check_continuation's;
an entry appends RunStarted (a start, a fork), or RunResumed (+ ConfigChanged when the config differs),
each built in one place (rewind.states.opening) and checked by the fold before anything is written; a
run computes where its record says; a resume goes on from the fold's own restore anchor, and a fork, a
replay and a read choose their restore point among the log's through `choose_point`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rewind.states.check_continuation import change_problem, finished_refusal, resume_refusal
from rewind.states.config import ComputeSection, Config
from rewind.states.config_identity import config_hash
from rewind.states.events import (
    CheckpointDeleted,
    RunStarted,
    StepCommitted,
)
from rewind.states.history import RestorePoint, SeqEvent, config_in_force, point_of, restore_points
from rewind.states.schedule import Schedule
from rewind.states.state import State


class EntryRefused(Exception):
    """The run cannot be entered as asked. exit_code: 2 for the request or config, 1 for the run's state."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


# --- what is asked --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Train:
    """`rewind train CONFIG` (a new run's start, or a resume) and `rewind resume` (`config` None: the one
    the run logged); `fork`: go on under a config that differs from the run's (a ConfigChanged).
    `threads` > 0: the user's --threads (here and in Fork)."""

    config: Config | None = None
    fork: bool = False
    threads: int = 0


@dataclass(frozen=True)
class Fork:
    """`rewind fork`: a new run from the run's last intact restore point at or before `at_step`, under
    `child_config(the config in force there)` (which may raise ConfigError)."""

    at_step: int
    child_config: Callable[[Config], Config]
    threads: int = 0


@dataclass(frozen=True)
class Replay:
    """`rewind replay`: from the checkpoint named (a name or its step; None: the earliest usable start)
    up to `to_step` (None: the last step logged)."""

    from_checkpoint: str | None = None
    to_step: int | None = None


@dataclass(frozen=True)
class ReadCheckpoint:
    """`rewind sample` and `eval`: the live checkpoint made at `at_step` (None: the last one); `export`: the
    run's last committed checkpoint, the one a resume would go on from."""

    at_step: int | None = None
    export: bool = False


Ask = Train | Fork | Replay | ReadCheckpoint


@dataclass(frozen=True)
class LogView:
    """What the engine read of run `run`'s log (rewind.engine.run.entry.read_log): `found` (a log is
    there), `state` (the fold of every record), `config` (in force at its end), `end_seq` (its last record,
    -1: none) and, for an entry that searches its history (fork, replay, the reads), `records`: the
    effective ones. A resume needs only the fold's own restore anchor."""

    run: str
    found: bool = True
    state: State = field(default_factory=State)
    config: Config = field(default_factory=Config)
    end_seq: int = -1
    records: Sequence[SeqEvent] = ()


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


@dataclass(frozen=True)
class Entry:
    """The decision: how the run is entered ("started", "resumed", "finished", "forked", "replay" or
    "read"), from `point` (None: a new run's start) under `config`, computing at `site` (None: where this
    process is, a new run's), after joining the process group `compute` asks for (None: none). `logged`:
    the config in force at the point (what the run's record of its data declares); `state`: the log's
    fold; `to_step`: a replay's last step."""

    ask: Ask
    how: str
    run: str
    config: Config
    point: RestorePoint | None = None
    site: Site | None = None
    logged: Config | None = None
    state: State = field(default_factory=State)
    end_seq: int = -1
    to_step: int = 0
    compute: ComputeSection | None = None
    started: RunStarted | None = None  # the run's first record (a fork's child keeps its features)

    @property
    def changed(self) -> bool:
        """The config differs from the one in force at the point: a ConfigChanged goes on record."""
        return self.logged is not None and config_hash(self.logged) != config_hash(self.config)


# --- the decision ---------------------------------------------------------------------------------------


def decide(ask: Ask, view: LogView, *, intact: Callable[[RestorePoint], bool] = lambda point: True) -> Entry:
    """How `ask` enters the run whose log `view` holds, or EntryRefused. `intact`: whether a restore
    point's checkpoint is whole on disk (what a fork may start from; the engine looks)."""
    if isinstance(ask, Train) and view.end_seq < 0 and ask.config is not None:
        return _start(ask, ask.config, view.run)
    if not view.found:
        raise EntryRefused(f"{view.run}: no run here (no event log)")
    if view.end_seq < 0:
        raise EntryRefused(f"{view.run}: the event log is empty", 1)
    if not view.state.started:
        raise EntryRefused(f"{view.run}: the event log does not start with RunStarted", 1)
    if isinstance(ask, Train):
        return _resume(ask, view)
    if isinstance(ask, Fork):
        return _fork(ask, view, intact)
    if isinstance(ask, Replay):
        return _replay(ask, view)
    return _read(ask, view)


def _start(ask: Train, config: Config, run: str) -> Entry:
    schedule = Schedule(config)
    if schedule.num_steps == 0:
        raise EntryRefused(
            f"the run has no steps: {schedule.total_tokens} tokens in all, one step takes {schedule.tokens_per_step}"
        )
    return Entry(ask, "started", run, config, compute=config.compute)


def _resume(ask: Train, view: LogView) -> Entry:
    current, logged, run = view.state, view.config, view.run
    config = logged if ask.config is None else ask.config
    if current.finished:
        if refusal := finished_refusal(run, current.step, logged, config):
            raise EntryRefused(refusal)
        return Entry(
            ask, "finished", run, logged, state=current, end_seq=view.end_seq, compute=config.compute
        )
    refusal = resume_refusal(run, logged, config)
    if refusal and not ask.fork:
        raise EntryRefused(refusal)
    point = point_of(current)
    if refusal and (problem := change_problem(logged, config, point)):
        raise EntryRefused(f"{run}: {problem}")
    going_on = config if refusal else logged
    site = site_of(current, num_threads=point.state.num_threads)  # the count it goes on from, or --threads
    return Entry(
        ask, "resumed", run, going_on, point, site, logged, current, view.end_seq, compute=going_on.compute
    )


def _fork(ask: Fork, view: LogView, intact: Callable[[RestorePoint], bool]) -> Entry:
    run, last_step = view.run, view.state.step
    if not 0 <= ask.at_step <= last_step:
        raise EntryRefused(
            f"--at-step {ask.at_step}: {run} has reached step {last_step} (choose 0..{last_step})"
        )
    point, parent_config = fork_point(view, ask.at_step, intact)
    config = ask.child_config(parent_config)
    if problem := change_problem(parent_config, config, point):
        raise EntryRefused(f"cannot fork {run} at step {point.state.step}: {problem}")
    site = site_of(point.state, reading=True)  # the parent's kernels, device and thread count there
    started = view.records[0][1]
    assert isinstance(started, RunStarted)
    return Entry(
        ask, "forked", run, config, point, site, parent_config, view.state, view.end_seq, started=started
    )


def fork_point(
    view: LogView, at_step: int, intact: Callable[[RestorePoint], bool]
) -> tuple[RestorePoint, Config]:
    """The last restore point at or before `at_step` whose checkpoint is live and `intact` (an older one
    is still a faithful starting point when a newer one is damaged: the checkpoint taken before a growth,
    at the same step as the one after it, needs none of the files the growth froze), or the run's start;
    and the config in force there."""
    records = view.records
    points = restore_points(records)
    live = {c.checkpoint for c in view.state.live_checkpoints}  # not deleted by retention since
    held = [
        p
        for p in points
        if p.checkpoint and p.state.last_checkpoint and p.state.last_checkpoint.checkpoint in live
    ]
    while (point := choose_point(held, at_or_before=at_step)) is not None:
        if intact(point):
            return point, config_in_force(records[: point.index])
        held = [p for p in held if p is not point]  # damaged or missing on disk
    started = records[0][1]
    assert isinstance(started, RunStarted)
    if started.parent is not None and started.parent.checkpoint:
        # A fork's own history begins at its fork point: "its start" would be weights it never had.
        raise EntryRefused(
            f"--at-step {at_step}: this run is a fork of {started.parent.run} at step {started.parent.step} and "
            "has no intact checkpoint at or before that step; fork its parent instead"
        )
    # The start as it stands now: a crash before the first checkpoint restarts from scratch, maybe
    # under a changed config (RunResumed(checkpoint="") then ConfigChanged).
    start = [p for p in points if not p.checkpoint][-1]
    return start, config_in_force(records[: start.index])


def _replay(ask: Replay, view: LogView) -> Entry:
    point = replay_start(view.records, ask.from_checkpoint)
    last_step = view.state.step
    end_step = last_step if ask.to_step is None else ask.to_step
    if not point.state.step < end_step <= last_step:
        raise EntryRefused(
            f"--to-step {end_step}: must be after the start (step {point.state.step}) and at most the last step "
            f"logged ({last_step})"
        )
    config = config_in_force(view.records[: point.index])
    # The process group of the run's last config: a window may cross a change of it (replay applies it).
    return Entry(
        ask, "replay", view.run, config, point, site_of(point.state, reading=True), config, view.state,
        view.end_seq, to_step=end_step, compute=view.config.compute,
    )  # fmt: skip


def replay_start(records: Sequence[SeqEvent], checkpoint: str | None) -> RestorePoint:
    """The restore point named by `checkpoint` (a name, or the step of one), or the earliest whose files
    still exist (retention deletes old ones; the run's start needs none). The run's start counts only
    when its first weights came from the seed (not for a fork, whose first weights are a checkpoint)."""
    parent = records[0][1].parent if isinstance(records[0][1], RunStarted) else None
    from_seed = parent is None or not parent.checkpoint
    has_steps = any(isinstance(e, StepCommitted) for _, e in records)
    every = restore_points(records)
    points = made_by_checkpoints(every)
    if from_seed and has_steps:
        start = choose_point([p for p in every if not p.checkpoint], step=0, first=True)
        points = sorted([start, *points] if start else points, key=lambda p: p.index)
    deleted = deleted_checkpoints(records)
    usable = [p for p in points if p.checkpoint not in deleted]
    if not usable:
        raise EntryRefused("the run has no steps to replay yet, or no checkpoint to start from", 1)
    if checkpoint is None:
        return usable[0]
    if checkpoint in ("start", "0") and points[0].checkpoint == "":
        return points[0]
    point = choose_point(points, name=checkpoint, first=True)
    if point is None and checkpoint.isdigit():
        point = choose_point([p for p in points if p.checkpoint], step=int(checkpoint), first=True)
    names = ", ".join(p.checkpoint or "the start (step 0)" for p in usable)
    if point is None:
        raise EntryRefused(
            f"--from-checkpoint {checkpoint}: no checkpoint of that name or step (known: {names})"
        )
    if point.checkpoint in deleted:
        raise EntryRefused(
            f"checkpoint {point.checkpoint} was deleted by the retention policy at step {deleted[point.checkpoint]}; "
            f"start from one of: {names}",
            1,
        )
    return point


def deleted_checkpoints(records: Sequence[SeqEvent]) -> dict[str, int]:
    """The checkpoints retention deleted, each with the step it was deleted at."""
    return {e.checkpoint: e.step for _, e in records if isinstance(e, CheckpointDeleted)}


def _read(ask: ReadCheckpoint, view: LogView) -> Entry:
    state, run = view.state, view.run
    if state.last_checkpoint is None:
        raise EntryRefused(f"{run}: the run has no committed checkpoint yet", 1)
    if ask.export:  # the fold's restore anchor: the state just after the checkpoint a resume loads
        anchor = state.anchor
        if anchor is None or anchor.last_checkpoint != state.last_checkpoint:
            raise EntryRefused(
                "the log's restore anchor is not its last checkpoint: cannot tell that model's layout", 1
            )
        return Entry(ask, "read", run, config_in_force(view.records), point_of(state), state=state)
    live = {c.checkpoint for c in state.live_checkpoints}
    point = choose_live_point(
        run, [p for p in checkpoint_points(view.records) if p.checkpoint in live], ask.at_step
    )
    # The run's kernels and thread count, as replay adopts them: the same figures as the run's own
    # boundary evaluation of this checkpoint, bit for bit, on the machine it ran on.
    site = site_of(state, reading=True)  # compute.device = "auto": where the run computed, if here
    return Entry(ask, "read", run, config_in_force(view.records[: point.index]), point, site, state=state)


def choose_live_point(run: str, points: Sequence[RestorePoint], at_step: int | None) -> RestorePoint:
    """The restore point of the live checkpoint to read (`points`: those of the live checkpoints, in log
    order): the last one, or the last committed at `at_step`."""
    if not points:
        raise EntryRefused(f"{run}: the run has no committed checkpoint yet", 1)
    chosen = choose_point(points, step=at_step)
    if chosen is None:
        steps = ", ".join(str(s) for s in sorted({p.state.step for p in points}))
        raise EntryRefused(
            f"--at-step {at_step}: no checkpoint at that step (retention keeps only some); "
            f"checkpoints exist at steps {steps}"
        )
    return chosen


def checkpoint_points(records: Sequence[SeqEvent]) -> list[RestorePoint]:
    """Every restore point a checkpoint makes, once per checkpoint, as of where it was made (a later
    resume from it and a config change there are in what follows), in log order."""
    return made_by_checkpoints(restore_points(records))


def made_by_checkpoints(points: Sequence[RestorePoint]) -> list[RestorePoint]:
    """Of a history's restore `points`, those a checkpoint makes, once per checkpoint (the first)."""
    made: dict[str, RestorePoint] = {}
    for point in points:
        if point.checkpoint:
            made.setdefault(point.checkpoint, point)
    return list(made.values())


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
