"""Opening a run's log: its folded state and the config in force, in time proportional to its tail.

`fold_log` starts from the newest state snapshot (rewind.stores.snapshots) that agrees with the log
(the record at its seq exists, with the event type, step and bytes it claims) and folds only the
records after it; with none, it folds the whole log. The result is the same either way for a snapshot
the engine wrote.

For readers (`rewind state`, `log`, `timeline`: what they print is never recorded) agreeing is enough.
A resume (`store` given, or `vouched`) records and trains on what it folds, and a checksum is all that
protects a snapshot file, so it starts only from one the log vouches for: the record after it is a
CheckpointCommitted that carries the digest of its state and config (snapshots.vouched_by). It
compares every snapshot it passes on the way with its fold (the check `rewind verify` makes:
snapshots.snapshot_problem) and warns in one line about those that disagree (SnapshotsIgnored): a
forged snapshot is never started from and changes nothing it trains. With none vouched for (a run
written before digests, or every snapshot lost), it folds the whole log; the snapshot it writes
after its RunResumed serves readers, its next checkpoint's a resume. It also refuses, before anything
is recorded, what the fold accepts but no run writes (`commit_problem`: a checkpoint committed twice),
which verify names too.

Whoever forges a snapshot can also put its digest into the record after it (and recompute the frame's
CRC), so a vouched snapshot is cross-checked with what the log does not carry: every checkpoint
committed in the tail that is still on disk records in its manifest the control state it was taken in
and the KL reference's digest (engine.checkpointing: meta `control`, `reference_sha256`), which must
be the fold's at its record (`manifest_problem`, the check verify makes for every live checkpoint);
the grpo batch the snapshot holds, which no manifest records, must be a record of the log at its step
(`_held_batch_problem`).
On a disagreement the snapshot is dropped, not the run: the log is folded whole, as with no snapshot,
and checked against the same manifests again. If the whole fold agrees, the snapshot (and its record's
digest) was the forgery: the resume goes on from the log with one warning line naming it. If it
disagrees too, the log and the checkpoint do not belong together and the resume is refused in one
line, nothing recorded (`rewind verify RUN` names the records at fault). Going on rather than refusing
outright costs nothing a run needs: the whole fold is what a run without snapshots always does.
What no manifest records is not cross-checked this way (see rewind.stores.snapshots).

Every record folded here is first admitted (rewind.states.admission, through rewind.stores.trust: a
config carried in the log gets the checks a config file gets), and so is a snapshot's state before it is used: a log is untrusted input.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from rewind.states.admission import state_problem
from rewind.states.config import Config
from rewind.states.events import CheckpointCommitted, ConfigChanged, Event, RunStarted, event_tag
from rewind.states.fold import IllegalTransition, apply, fold
from rewind.states.history import SeqEvent, config_in_force, effective, is_superseded, skip_ranges
from rewind.states.state import State, control_summary
from rewind.stores import snapshots
from rewind.stores.checkpoints import CheckpointError, CheckpointStore
from rewind.stores.eventlog import EventLog, Record
from rewind.stores.trust import RecordChecker, UntrustedRecord


@dataclass(frozen=True)
class FoldedLog:
    state: State  # the fold of every record of the log
    config: Config  # the config in force after them
    tail: list[SeqEvent]  # the records after the snapshot used (every record without one)
    end_seq: int  # the last record's seq (-1: an empty log)
    snapshot_seq: int  # the seq the fold started after (-1: from the start)


def _agrees(log: EventLog, snapshot: snapshots.Snapshot) -> Iterator[Record] | None:
    """The records after the snapshot's, if the log holds at its seq exactly the record it was taken
    at; None for a stale snapshot (another history under the same seq) or one inconsistent in itself."""
    if snapshot.state.next_seq != snapshot.seq + 1:
        return None
    records = log.records(start_seq=snapshot.seq)
    first = next(records, None)
    if first is None or first.seq != snapshot.seq:
        return None
    if event_tag(first.event) != snapshot.tag or first.event.step != snapshot.step:
        return None
    if snapshots.event_sha256(first.event) != snapshot.event_sha256:
        return None
    return records


def fold_log(log: EventLog, run_dir: str, store: CheckpointStore | None = None, *, vouched: bool = False) -> FoldedLog:
    """`store` given (a resume passes the run's checkpoint store) or `vouched`: only from a snapshot the
    log vouches for (see the module's docstring)."""
    end_seq = log.next_seq - 1
    if store is not None or vouched:
        return _fold_for_resume(log, run_dir, end_seq, CheckpointStore(run_dir) if store is None else store)
    for snapshot in snapshots.candidates(run_dir, end_seq):
        if state_problem(snapshot.state, snapshot.config):
            continue  # the full fold below names the record that carries the problem
        records = _agrees(log, snapshot)
        if records is None:
            continue
        tail = _checked(((r.seq, r.event) for r in records), RecordChecker(snapshot.config))
        try:
            state = fold((e for _, e in tail), snapshot.state)
        except IllegalTransition:
            continue  # the full fold below says what is wrong, from the log alone
        return FoldedLog(state, _config_after(snapshot.config, tail), tail, end_seq, snapshot.seq)
    records = _checked(((r.seq, r.event) for r in log.records()), RecordChecker())
    state = fold(e for _, e in records)
    config = config_in_force(records) if records and isinstance(records[0][1], RunStarted) else Config()
    return FoldedLog(state, config, records, records[-1][0] if records else -1, -1)


def commit_problem(state: State, event: Event) -> str:
    """What the fold accepts in `event` after `state` but no run writes ("" if nothing): a checkpoint
    committed while a record already names it live. No code path commits a checkpoint twice (a resume
    restarts from the last one and never takes another at its step; a content-named checkpoint taken
    again holds another state, so another name), and retention would later try to delete it twice.
    `rewind verify` and a resume both ask this."""
    if isinstance(event, CheckpointCommitted):
        first = next((c for c in state.live_checkpoints if c.checkpoint == event.checkpoint), None)
        if first is not None:
            return (
                f"checkpoint {event.checkpoint} committed a second time (it is live since step {first.step}); "
                "a run commits a checkpoint once: the log was edited"
            )
    return ""


class SnapshotsIgnored(UserWarning):
    """A resume passed snapshots that are not the fold of the log: it never starts from one."""

    def __init__(self, run_dir: str, problems: list[str]):
        named = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        super().__init__(
            f"{run_dir}: {named} (not used: a resume starts only from a snapshot the log vouches for and the "
            f"checkpoints after it agree with; `rewind verify {run_dir}` lists every such snapshot)"
        )
        self.problems = problems


def _vouched_start(log: EventLog, run_dir: str, end_seq: int) -> tuple[snapshots.Snapshot, Iterator[Record]] | None:
    """The newest snapshot that agrees with the log and that the record after it vouches for, with the
    records from that one on; None if there is none."""
    for snapshot in snapshots.candidates(run_dir, end_seq - 1):  # a snapshot at the end has no voucher
        if state_problem(snapshot.state, snapshot.config):
            continue
        records = _agrees(log, snapshot)
        after = next(records, None) if records is not None else None
        if after is not None and after.seq == snapshot.seq + 1 and snapshots.vouched_by(snapshot, after.event):
            return snapshot, itertools.chain([after], records)  # type: ignore[arg-type]
    return None


def _fold_for_resume(log: EventLog, run_dir: str, end_seq: int, store: CheckpointStore) -> FoldedLog:
    """The fold from the newest vouched snapshot, cross-checked with the manifests of the checkpoints
    committed after it; from the start without one, or when they disagree (see the module's docstring)."""
    start = _vouched_start(log, run_dir, end_seq)
    held = _held_batch_problem(log, start[0]) if start is not None else ""
    folded, commits, problems = _fold_from(log, run_dir, end_seq, start)
    disagreeing = _manifest_disagreements(store, commits, folded.state)
    if start is not None and (held or disagreeing):
        snapshot = start[0]
        folded, commits, problems = _fold_from(log, run_dir, end_seq, None)
        again = {name for _, name, _ in disagreeing}
        if still := _manifest_disagreements(store, [c for c in commits if c[1].checkpoint in again], folded.state):
            seq, name, fields = still[0]
            event = next(e for s, e, *_ in commits if s == seq)
            raise UntrustedRecord(seq, event, _disagreement(run_dir, name, fields))
        if disagreeing:
            _, name, fields = disagreeing[0]
            why = f"checkpoint {name}'s manifest disagrees with the fold from it on {fields}"
        else:
            why = held
        problems = [p for p in problems if not p.startswith(f"snapshot {snapshot.seq:012d}:")]
        problems.insert(
            0,
            f"snapshot {snapshot.seq:012d}: record {snapshot.seq + 1} vouches for it, but {why} (the log was "
            "folded whole instead; delete it: it is a cache)",
        )
    if problems:
        warnings.warn(SnapshotsIgnored(run_dir, problems), stacklevel=3)
    return folded


def _held_batch_problem(log: EventLog, snapshot: snapshots.Snapshot) -> str:
    """Why the grpo batch a vouched snapshot holds is not one the log records ("" if it is, or none is
    held): no manifest holds the batch, so it is looked up among the records of its step (an index seek)."""
    held = snapshot.state.rollouts
    if held is None or any(r.event == held for r in log.records_in_steps(held.step, held.step)):
        return ""
    return f"the rollout batch it holds ({held.path}) is not one the log records at step {held.step}"


# A CheckpointCommitted folded in a resume's tail: (seq, the record, the reference's digest before it
# as the writer computed it, the control state after it as its manifest records it).
_Commit = tuple[int, CheckpointCommitted, tuple[str, str], dict]


def _fold_from(
    log: EventLog, run_dir: str, end_seq: int, start: tuple[snapshots.Snapshot, Iterator[Record]] | None
) -> tuple[FoldedLog, list[_Commit], list[str]]:
    """The fold from `start` (from the log's start if None), each snapshot after it compared with the
    fold on the way (the problems found), and the checkpoints committed on the way."""
    state, config, first = State(), None, -1
    if start is not None:
        state, config, first = start[0].state, start[0].config, start[0].seq
    cached = {seq for seq in snapshots.list_seqs(run_dir) if seq > first}
    checker = RecordChecker(config)
    records: list[SeqEvent] = []
    problems: list[str] = []
    commits: list[_Commit] = []
    for record in start[1] if start is not None else log.records():
        seq, event = record.seq, record.event
        checker.check(seq, event)  # UntrustedRecord, before the fold could act on what it carries
        if problem := commit_problem(state, event):
            raise UntrustedRecord(seq, event, problem)
        records.append((seq, event))
        before, state = state, apply(state, event)
        if isinstance(event, CheckpointCommitted):
            commits.append((seq, event, reference_digests(before), control_summary(state)))
        if isinstance(event, RunStarted | ConfigChanged):
            config = event.config
        if seq in cached:
            snapshot = snapshots.read(run_dir, seq)
            if snapshot is None and snapshots.written_elsewhere(run_dir, seq):
                continue  # another release's: unused, and replaced at the next checkpoint
            if problem := snapshots.snapshot_problem(seq, snapshot, event, state, config):
                problems.append(problem)
    if start is not None:
        folded = FoldedLog(state, _config_after(start[0].config, records), records, end_seq, first)
    else:
        config = config_in_force(records) if records and isinstance(records[0][1], RunStarted) else Config()
        folded = FoldedLog(state, config, records, records[-1][0] if records else -1, -1)
    return folded, commits, problems


def reference_digests(state: State) -> tuple[str, str]:
    """What a checkpoint taken in `state` records of its KL reference: (the manifest sha256 its
    CheckpointCommitted recorded, as manifest format 2's `reference_sha256` holds it; the checkpoint's
    name, as format 1's `reference`). "" for none; "?" where the reference is not live (no writer
    takes a checkpoint then: engine.checkpointing.reference_digest refuses)."""
    if state.reference is None:
        return "", ""
    held = next((c for c in state.live_checkpoints if c.checkpoint == state.reference.checkpoint), None)
    return (held.manifest_sha256 if held is not None else "?"), state.reference.checkpoint


def manifest_problem(meta: dict, references: tuple[str, str], control: dict) -> list[str]:
    """What a checkpoint's manifest `meta` records otherwise than the fold at its record: the fields of
    the control state (`control`: control_summary of the state after its CheckpointCommitted) and
    "reference" (`references`: reference_digests of the state before it). Fields a manifest does not
    hold (an older release's) are not compared."""
    recorded = meta.get("control")
    differ = [k for k in control if recorded.get(k) != control[k]] if isinstance(recorded, dict) else []
    by_digest = "reference_sha256" in meta  # format 2; format 1 names the checkpoint
    key, expected = ("reference_sha256", references[0]) if by_digest else ("reference", references[1])
    if key in meta and meta[key] != expected:
        differ.append("reference")
    return differ


def _manifest_disagreements(
    store: CheckpointStore, commits: list[_Commit], state: State
) -> list[tuple[int, str, str]]:
    """(seq, checkpoint, the fields that differ) for each checkpoint of `commits` still live in `state`
    whose manifest disagrees with the fold. One whose manifest cannot be read is not compared: the
    resume that loads it says so, and verify names it."""
    live = {c.checkpoint for c in state.live_checkpoints}
    found = []
    for seq, event, references, control in commits:
        if event.checkpoint not in live:
            continue
        try:
            meta = store.load_manifest(event.checkpoint).meta
        except (CheckpointError, OSError):
            continue
        if differ := manifest_problem(meta, references, control):
            found.append((seq, event.checkpoint, ", ".join(differ)))
    return found


def _disagreement(run_dir: str, name: str, fields: str) -> str:
    return (
        f"checkpoint {name}'s manifest disagrees with the log on {fields}, folded whole or from a snapshot: "
        f"the log or the checkpoint was edited; nothing was changed (`rewind verify {run_dir}` names the "
        "records and snapshots at fault)"
    )


def _checked(records: Iterable[SeqEvent], checker: RecordChecker) -> list[SeqEvent]:
    checked = []
    for seq, event in records:
        checker.check(seq, event)  # UntrustedRecord, before the fold could act on what it carries
        checked.append((seq, event))
    return checked


def fold_to(log: EventLog, run_dir: str, *, at_step: int | None = None, at_seq: int | None = None) -> tuple[State, Config]:
    """The state (and config in force) after log record `at_seq` (raw records, superseded ones as they
    counted then), or after step `at_step`'s control events (the effective records with step <= it),
    folding from the nearest snapshot before that point (see snapshots.BAND)."""
    ranges = log.superseded_ranges() if at_step is not None else []
    start: tuple[State, Config | None, Iterator[Record] | None] = (State(), None, None)
    for snapshot in snapshots.candidates(run_dir, log.next_seq - 1 if at_seq is None else at_seq):
        if state_problem(snapshot.state, snapshot.config):
            continue
        if at_step is not None and (snapshot.state.step > at_step or is_superseded(snapshot.seq, ranges)):
            continue  # past the step, or a state that superseded records counted in
        records = _agrees(log, snapshot)
        if records is not None:
            start = (snapshot.state, snapshot.config, records)
            break
    state, config, records = start
    checker = RecordChecker(config)
    stream = ((r.seq, r.event) for r in (records if records is not None else log.records()))
    for seq, event in skip_ranges(stream, ranges):
        if (at_seq is not None and seq > at_seq) or (at_step is not None and event.step > at_step):
            break  # the effective records' steps never decrease
        checker.check(seq, event)
        state = apply(state, event)
        if isinstance(event, RunStarted | ConfigChanged):
            config = event.config
    return state, config if config is not None else Config()


def _config_after(config: Config, tail: Sequence[SeqEvent]) -> Config:
    """The config in force after `tail`, given the one in force before it (a resume in the tail only
    supersedes records after the snapshot: its restore point is never older than a snapshot)."""
    changes = [e.config for _, e in effective(tail) if isinstance(e, ConfigChanged)]
    return changes[-1] if changes else config


def save_snapshot(run_dir: str, state: State, event, config: Config) -> None:
    """Cache `state`, the fold up to the record just applied (seq state.next_seq - 1, holding `event`)."""
    snapshots.write(run_dir, snapshots.make(state.next_seq - 1, event, state, config))
