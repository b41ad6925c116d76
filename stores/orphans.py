"""Checkpoints on disk that the log does not name: debris of a crash, or evidence that the log lost records.

A crash can leave a complete checkpoint whose CheckpointCommitted never became durable: the engine
writes the checkpoint, then appends and commits its record. That is normal debris. But the engine
commits every record before it writes a checkpoint, and the checkpoint records the last of them
(`log_seq`, rewind.engine.run.journal): a log that ends before a checkpoint's `log_seq` lost acknowledged
records. Checkpoints of older releases carry no `log_seq`; for them the bound is their step: the journal
group-commits at every multiple of `report_interval`, before the next step runs, so by the time a
checkpoint of step S existed the records through step `report_interval * ((S - 1) // report_interval)`
had been acknowledged, and so had every checkpoint the same process wrote before. A log also lost
records when its restore point names a checkpoint that is gone while a later one sits on disk unnamed
(retention deletes a checkpoint only once its successor's record is durable).

Either way the directory is not a place to resume from: nothing may be appended or deleted, and the
user is told which checkpoint proves it and how far the log should reach. Nothing here writes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rewind.stores.checkpoints import TMP_PREFIX, CheckpointError, CheckpointStore


@dataclass(frozen=True)
class LogEnd:
    """How far a log reaches: its last record, the step its effective records reach, and a way to get
    the largest step any record holds (superseded ones included), which costs a full read."""

    seq: int
    step: int
    max_step: Callable[[], int]


def acknowledged_step(checkpoint_step: int, report_interval: int) -> int:
    """The step through which the log was durable when a checkpoint of `checkpoint_step` was written."""
    interval = max(report_interval, 1)
    return interval * ((max(checkpoint_step, 1) - 1) // interval)


def dated_orphans(store: CheckpointStore, live_names: Iterable[str]) -> list[tuple[str, int, int | None]]:
    """(name, step, log_seq) from the manifest of every complete checkpoint on disk the log does not
    name (log_seq None where an older release wrote it); ones whose manifest does not read carry no
    date and prove nothing."""
    dated = []
    for name in store.orphans(live_names):
        if name.startswith(TMP_PREFIX):
            continue
        try:
            manifest = store.load_manifest(name)
        except CheckpointError:
            continue
        dated.append((name, manifest.step, store.log_seq(name, manifest)))
    return dated


def lost_record_problems(
    store: CheckpointStore, live_names: Iterable[str], restore_checkpoint: str, end: LogEnd, report_interval: int
) -> list[str]:
    """One line per checkpoint that proves the log lost acknowledged records ([] when none does)."""
    live = list(live_names)
    dated = dated_orphans(store, live)
    problems = [
        f"checkpoint {name} (step {step}) was written when the log held records through seq {log_seq}, but the "
        f"log now ends at seq {end.seq}: records {end.seq + 1}..{log_seq}, acknowledged, are missing"
        for name, step, log_seq in dated
        if log_seq is not None and log_seq > end.seq
    ]
    # Checkpoints of older releases record no log_seq: their dates bound what the log must reach.
    later = sorted((step, name) for name, step, log_seq in dated if log_seq is None and step > end.step)
    max_step = end.max_step() if later else end.step  # the full read only when it could matter
    later = [(step, name) for step, name in later if step > max_step]
    for i, (step, name) in enumerate(later):
        # A process writes its checkpoints one at a time, each committed before it goes on: only the
        # newest unnamed one can be the one a crash caught before its record was durable.
        reach = step if i < len(later) - 1 else max(acknowledged_step(step, report_interval), *(s for s, _ in later[:i]), 0)
        if max_step < reach:
            problems.append(
                f"checkpoint {name} (step {step}) is on disk but the log ends at step {max_step} (record "
                f"{end.seq}): it should reach at least step {reach}, acknowledged records are missing"
            )
    if restore_checkpoint and restore_checkpoint not in store.names_on_disk():
        restore_step = int(restore_checkpoint.split("-", 1)[0])
        successors = sorted((step, name) for name, step, _ in dated if step > restore_step)
        if successors:
            step, name = successors[0]
            problems.append(
                f"the restore point's checkpoint {restore_checkpoint} is gone and {name} (step {step}) is on disk "
                f"unnamed: retention deleted it after {name}'s CheckpointCommitted, which the log no longer holds"
            )
    return problems
