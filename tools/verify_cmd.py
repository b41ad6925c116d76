"""`rewind verify RUN`: is this run's record intact and self-consistent?

Checks, reporting every problem with its exact location:
1. log framing, CRCs, sequence contiguity, decodability (segment and byte offset); a torn tail (bytes
   after the last commit mark, which no commit acknowledged: what a crash mid-write leaves, and what
   `rewind train` cuts off) is a note, not a problem, while damage before a commit mark is one; every
   segment index file (`events/NNNNNNNN.idx`, a cache of what a segment holds) against its segment:
   a damaged or stale one is named;
2. the fold succeeds (no illegal transition), and no record carries what no rewind run could have
   written (rewind.stores.trust: a config `check_config` refuses, an absurd thread count, a fork seed
   past the run's end, a checkpoint, file or dataset name that is not a plain name, an activation cache
   path rewind does not write), nor what only an edited log holds (a checkpoint committed twice:
   rewind.stores.folding.commit_problem, which a resume refuses); every activation cache a record
   names stays inside the run once links are resolved, and one there is the one the log records (its
   identity: rewind.stores.cachebinding), not another run's;
3. every checkpoint the log still holds live exists and matches the hashes its CheckpointCommitted
   recorded, file by file;
4. each live checkpoint's manifest agrees with the control state folded from the log at that point
   (step, tokens, cursors, stage, config) and with its KL reference (rewind.stores.folding
   .manifest_problem, the cross-check a resume makes of the snapshot it starts from);
5. what a resume would load (the restore point's checkpoint and its KL reference) is live;
6. no checkpoint on disk that the log does not name proves that the log lost acknowledged records
   (rewind.stores.orphans: which checkpoint, and the step the log should reach); the temporaries a
   killed write left (rewind.stores.temporaries) are a note;
7. every state snapshot beside the log (`snapshots/`, a cache that lets resume fold only the tail) is
   exactly the fold of the log up to its record, under the config then in force; a damaged or wrong
   one is named (it is never used over the log, and deleting it is safe); and the state digest each
   CheckpointCommitted carries, which vouches for the snapshot a resume starts from, is that of the
   fold before it;
8. with --data: every file of every dataset the run recorded, re-hashed whole against its record
   (RunStarted/ConfigChanged .data), and the prepared token files against their manifests;
9. nothing in the run directory would lead a writer out of it or onto what is no file (rewind.stores
   .runguard, the check `rewind train`/`resume` make when they take the lock): a link out of the run,
   a FIFO or device, a file where rewind keeps a directory (checkpoints/orphaned a file).
Exit 0 when clean, 1 otherwise.
"""

from __future__ import annotations

import argparse

from rewind.tools.errors import CommandError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="check a run's log, fold and checkpoints; exit 0 when clean")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument(
        "--data",
        action="store_true",
        help="also re-hash every data file the run recorded (its datasets, prepared token files, tokenizer)",
    )
    p.set_defaults(run=run)


def verify_run(run_dir: str, *, data: bool = False) -> tuple[list[str], list[str]]:
    """(problems, notes). Problems make the run fail verification; notes are informational. `data`: the
    run's data files too (8.)."""
    from rewind.states.events import (
        ActivationsCached,
        CheckpointCommitted,
        ConfigChanged,
        RolloutsRecorded,
        RunStarted,
    )
    from rewind.states.fold import IllegalTransition, apply
    from rewind.states.state import State, anchor_checkpoint, control_summary
    from rewind.stores import snapshots
    from rewind.stores.checkpoints import CHECKPOINTS_DIR, CheckpointStore
    from rewind.stores.eventlog import EventLog, verify_log
    from rewind.stores.folding import commit_problem, manifest_problem, reference_digests
    from rewind.stores.fsio import filesystem
    from rewind.stores.orphans import LogEnd, lost_record_problems
    from rewind.stores.runguard import write_problems
    from rewind.stores.temporaries import is_temporary, stale
    from rewind.stores.trust import RecordChecker

    problems: list[str] = []
    notes: list[str] = []
    # Before the log's checks, which may end the report early: a writer is refused for these whatever the log.
    problems += [f"run directory: {line}" for line in write_problems(filesystem(run_dir))]
    report = verify_log(run_dir)
    problems += [f"log: {p.segment} offset {p.offset}: {p.message}" for p in report.problems]
    if report.torn_tail is not None:  # what a crash mid-commit leaves: expected, not damage
        t = report.torn_tail
        notes.append(
            f"log: torn tail in {t.segment} at offset {t.offset}: {t.num_bytes} bytes of a commit that never "
            f"returned (the expected state after a crash; `rewind train`/`resume` cuts it off): {t.reason}"
        )
        if not t.certain:
            notes.append("log: (rewind 0.2 frames carry no commit marks: a damaged last record would look the same)")
    problems += [
        f"log index: {p.segment}: {p.message} (deleting it is safe; opening the log for writing rewrites it)"
        for p in report.index_problems
    ]
    notes.append(f"log: {report.num_records} records in {report.num_segments} segment(s), {report.num_bytes:,} bytes")
    if report.problems:
        return problems, notes

    store = CheckpointStore(run_dir)
    state = State()
    config = None
    at_checkpoint: dict[str, dict] = {}
    cached = {seq: snapshots.read(run_dir, seq) for seq in snapshots.list_seqs(run_dir)}
    checker, max_step, end_seq = RecordChecker(), 0, -1
    rollouts: dict[str, tuple] = {}  # sha256 -> (where first recorded, the record, the config then in force)
    caches: dict[str, State] = {}  # activation cache path -> the state that records it
    elsewhere: list[int] = []  # snapshots of another release: unused, replaced at the next checkpoint
    with EventLog.open(run_dir) as log:
        for record in log.records(check=False):  # checked below, so each problem is reported
            where = f"seq {record.seq} ({record.segment} offset {record.offset})"
            if problem := checker.problem(record.event):
                problems.append(f"record: {where}: {problem}")
                return problems, notes  # the fold would act on what the record carries
            max_step, end_seq = max(max_step, record.event.step), record.seq
            if problem := commit_problem(state, record.event):
                problems.append(f"record: {where}: {problem}")
            if problem := snapshots.digest_problem(record.seq, record.event, state, config):
                consequence = _digest_consequence(run_dir, record.seq, record.event)
                problems.append(f"record: {where}: {problem}; {consequence}")
            before = state
            try:
                state = apply(state, record.event)
            except IllegalTransition as exc:
                problems.append(f"fold: {where}: {exc}")
                return problems, notes
            if isinstance(record.event, RunStarted | ConfigChanged):
                config = record.event.config
            if isinstance(record.event, CheckpointCommitted):
                at_checkpoint[record.event.checkpoint] = (reference_digests(before), control_summary(state))
            if isinstance(record.event, ActivationsCached) and record.event.path:
                found = _cache_problems(run_dir, record.event.path)
                problems += [f"record: {where}: {p}" for p in found]
                if not found:
                    caches[record.event.path] = state  # what the last record naming it says it holds
            if isinstance(record.event, RolloutsRecorded):
                rollouts.setdefault(record.event.sha256, (where, record.event, config))
            if record.seq in cached:
                snapshot = cached.pop(record.seq)
                if snapshot is None and snapshots.written_elsewhere(run_dir, record.seq):
                    elsewhere.append(record.seq)
                    continue
                if problem := snapshots.snapshot_problem(record.seq, snapshot, record.event, state, config):
                    problems.append(problem)
    problems += [f"snapshot {seq:012d}: past the end of the log (record {seq} does not exist)" for seq in cached]
    notes.append(f"fold: ok (step {state.step}, {'finished' if state.finished else 'not finished'})")
    if elsewhere:
        notes.append(
            f"snapshots: {len(elsewhere)} written by another release (not used: opening folds the log instead, "
            "and the next checkpoint writes a new one)"
        )
    num_bad = 0
    checked_trunks: dict[str, str] = {}  # sha256 -> problem ("" = sound): a trunk file is shared, read once
    for ref in state.live_checkpoints:
        found = store.verify(ref.checkpoint, ref.files)
        problems += [f"checkpoint {ref.checkpoint}: {p}" for p in found]
        if found:
            num_bad += 1
            continue
        meta = store.load_manifest(ref.checkpoint).meta
        trunk_problems = _trunk_problems(run_dir, meta.get("trunks", {}), checked_trunks)
        problems += [f"checkpoint {ref.checkpoint}: {p}" for p in trunk_problems]
        if trunk_problems:
            num_bad += 1
            continue
        expected = at_checkpoint.get(ref.checkpoint)
        if expected is not None and (diff := manifest_problem(meta, *expected)):
            problems.append(f"checkpoint {ref.checkpoint}: manifest disagrees with the log on {', '.join(diff)}")
            num_bad += 1
    # What a resume would load: the restore point's checkpoint and the reference it names.
    anchor, live = state.anchor, {c.checkpoint for c in state.live_checkpoints}
    for role, ref in (("checkpoint", anchor and anchor.last_checkpoint), ("KL reference", anchor and anchor.reference)):
        if ref is not None and ref.checkpoint not in live:
            problems.append(f"restore point: its {role} {ref.checkpoint} is not live: a resume could not load it")
    verdict = f"{num_bad} with problems" if num_bad else "verified"
    notes.append(f"checkpoints: {len(state.live_checkpoints)} live, {verdict}")
    for path, holding in caches.items():
        found, said = _cache_identity_problems(run_dir, path, holding)
        problems += found
        notes += said
    if rollouts:
        found = _rollout_problems(run_dir, rollouts)
        problems += found
        notes.append(f"rollouts: {len(rollouts)} file(s), {f'{len(found)} with problems' if found else 'verified'}")
    live_names = [c.checkpoint for c in state.live_checkpoints]
    end = LogEnd(end_seq, state.step, lambda: max_step)
    interval = config.logging.report_interval if config is not None else 1
    lost = lost_record_problems(store, live_names, anchor_checkpoint(anchor) if anchor else "", end, interval)
    problems += [f"log: lost acknowledged records: {line}" for line in lost]
    orphans = [name for name in store.orphans(live_names) if not is_temporary(CHECKPOINTS_DIR, name)]
    if orphans:
        notes.append(f"checkpoints on disk that no live event names (ignored by rewind): {', '.join(orphans)}")
    if left := stale(run_dir):
        notes.append(f"temporaries a killed write left (never read; the next resume removes them): {', '.join(left)}")
    if aside := store.set_aside_names():
        notes.append(f"checkpoints a resume set aside under checkpoints/orphaned/ (kept, unused): {', '.join(aside)}")
    if data and config is not None:
        from rewind.engine.data.rundata import verify_data  # the engine (torch) only when asked

        found, said = verify_data(run_dir, config, state)
        problems += found
        notes += said
    return problems, notes


def _trunk_problems(run_dir: str, trunks: dict, checked: dict[str, str]) -> list[str]:
    """Each frozen stack's weights file a checkpoint names (RUN/trunks/<sha256>): present, and its bytes
    hash to its name."""
    from rewind.stores.checkpoints import CheckpointError
    from rewind.stores.trunks import TrunkStore

    found = []
    for stack, digest in sorted(trunks.items()):
        if digest not in checked:
            try:
                TrunkStore(run_dir).read(digest)
                checked[digest] = ""
            except CheckpointError as exc:
                checked[digest] = str(exc)
        if checked[digest]:
            found.append(f"frozen stack {stack}: {checked[digest]}")
    return found


def _rollout_problems(run_dir: str, rollouts: dict[str, tuple]) -> list[str]:
    """Every rollout file the log names (a grpo or distill stage's batches, kept for the record and read by
    the steps of their window): present, its bytes hashing to its name, a batch in rewind's format that
    follows the rules its stage's kind's batches follow (rewind.engine.step.kinds.batch_problem: the check a
    resume makes)."""
    from rewind.engine.posttrain.rolloutreader import run_behaviours, run_end_id
    from rewind.engine.step.kinds import batch_problem

    end_id, features = run_end_id(run_dir), run_behaviours(run_dir)
    found = []
    for where, record, config in rollouts.values():
        if problem := batch_problem(run_dir, record, config, end_id, features):
            found.append(f"record: {where}: {problem}")
    return found


def _digest_consequence(run_dir: str, seq: int, event) -> str:
    """What a state digest that is not the fold before its record means for a resume: the snapshot it
    vouches for, if one holds it, was forged with it; otherwise the record alone was edited."""
    from rewind.stores import snapshots

    held = snapshots.read(run_dir, seq - 1)
    if held is None or not snapshots.vouched_by(held, event):
        return "a resume starts from no snapshot it vouches for"
    return (
        f"it is that of snapshot {seq - 1:012d}, forged with it: a resume would start from that snapshot but "
        "for its cross-check with the manifests of the checkpoints after it, which record the control state "
        "and the KL reference, and with the log's record of the rollout batch it holds; on a disagreement it "
        "folds the log whole. "
        f"Deleting {run_dir}/snapshots/ (a cache) makes every resume fold the log whole"
    )


def _cache_problems(run_dir: str, path: str) -> list[str]:
    """An activation cache a record names (a name the record check passed) must not lead out of a
    local run directory through a link (`cache/` or the cache itself)."""
    from rewind.stores.confine import NotConfined, inside_path
    from rewind.stores.fsio import filesystem

    location = filesystem(run_dir)
    if not location.is_local:
        return []  # (object stores have no links)
    try:
        inside_path(location.path, path.split("/"))
    except NotConfined as exc:
        return [f"activation cache {exc} (rewind neither reads nor writes a cache there)"]
    return []


def _cache_identity_problems(run_dir: str, path: str, state) -> tuple[list[str], list[str]]:
    """(problems, notes) of the activation cache at `path`, if one is there: it must be the one the log
    records (stores.cachebinding.identity_problem, the check a resume makes before it reads a cache).
    An absent or unfinished one is no problem: a resume writes or recomputes what it lacks."""
    from rewind.stores.activations import ActivationCache, CacheError
    from rewind.stores.cachebinding import OLDER_RELEASE, identity_problem
    from rewind.stores.fsio import filesystem

    location = filesystem(run_dir).join(*path.split("/"))
    if not location.exists():
        return [], []
    try:
        cache = ActivationCache.open(location.url)
    except CacheError as exc:
        return [], [f"activation cache {path}: unreadable, so recomputed ({exc})"]
    if not cache.is_complete() or not (problem := identity_problem(cache.spec, state)):
        return [], []
    if problem == OLDER_RELEASE:
        return [], [f"activation cache {path}: {problem}: not read (the trunk is recomputed, the same bits)"]
    return [f"activation cache {path}: {problem}; a resume does not read it (the trunk is recomputed): delete it"], []


def run(args: argparse.Namespace) -> int:
    from rewind.stores.eventlog import LogNotFoundError

    try:
        problems, notes = verify_run(args.run_dir, data=args.data)
    except LogNotFoundError:
        raise CommandError(f"{args.run_dir}: no run here (no event log)") from None
    for line in notes:
        print(line)
    for line in problems:
        print(f"PROBLEM {line}")
    print("verify: clean" if not problems else f"verify: {len(problems)} problem(s)")
    return 0 if not problems else 1
