"""Opening a log from a state snapshot gives exactly the full fold, and a bad snapshot is never used."""

from __future__ import annotations

import os

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rewind.states.config_reading import loads_config
from rewind.states.events import CheckpointCommitted, RunResumed
from rewind.states.fold import fold
from rewind.states.history import config_in_force
from rewind.states.strategies import engine_logs, simulate_run
from rewind.stores import snapshots
from rewind.stores.eventlog import EventLog
from rewind.stores.folding import fold_log

CONFIG = loads_config(
    """
[architecture]
block_size = 4
[training]
batch_size = 4
tokens = [160, 96, 96]
datasets = [[{name = "grammar"}], [{name = "reverse"}], [{name = "sort"}]]
[training.fade]
overlap = 0.5
[optimization.kl]
betas = [0.0, 0.1, 0.1]
reference_update_stages = [1]
[logging]
checkpoint_interval = 3
keep_last_checkpoints = 1
"""
)


def _write(run_dir, events) -> None:
    with EventLog.open(run_dir, "w") as log:
        for event in events:
            log.append(event)
        log.commit()


def _snapshot_every_checkpoint(run_dir, events) -> list[int]:
    """What the engine does: after each committed checkpoint record, cache the fold up to it."""
    seqs = []
    for seq, event in enumerate(events):
        if isinstance(event, CheckpointCommitted):
            pairs = list(enumerate(events[: seq + 1]))
            snapshots.write(str(run_dir), snapshots.make(seq, event, fold(events[: seq + 1]), config_in_force(pairs)))
            seqs.append(seq)
    return seqs


def _open(run_dir):
    with EventLog.open(run_dir) as log:
        return fold_log(log, str(run_dir))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(engine_logs(CONFIG, max_crashes=3))
def test_opening_from_a_snapshot_is_the_full_fold(tmp_path_factory, events):
    run = tmp_path_factory.mktemp("run")
    _write(run, events)
    seqs = _snapshot_every_checkpoint(run, events)
    opened = _open(run)
    assert opened.state == fold(events)
    assert opened.config == CONFIG
    assert opened.end_seq == len(events) - 1
    assert opened.snapshot_seq == (seqs[-1] if seqs else -1)
    assert len(opened.tail) == len(events) - 1 - opened.snapshot_seq  # only the tail was folded
    # Kept: the newest few, and the first of every band of records among the older ones.
    older = seqs[: -snapshots.KEEP]
    firsts = {min(s for s in older if s // snapshots.BAND == band) for band in {s // snapshots.BAND for s in older}}
    assert snapshots.list_seqs(str(run)) == sorted(firsts | set(seqs[-snapshots.KEEP :]))


def _prepared(tmp_path):
    events = simulate_run(CONFIG, crash_after=[7])
    assert any(isinstance(e, RunResumed) for e in events)
    run = tmp_path / "run"
    _write(run, events)
    return run, events, _snapshot_every_checkpoint(run, events)


def test_a_damaged_snapshot_is_skipped_for_an_older_one(tmp_path):
    run, events, seqs = _prepared(tmp_path)
    newest = run / "snapshots" / f"{seqs[-1]:012d}.state"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    opened = _open(run)
    assert opened.state == fold(events) and opened.snapshot_seq == seqs[-2]


def test_a_snapshot_of_another_history_or_past_the_end_is_not_used(tmp_path):
    run, events, seqs = _prepared(tmp_path)
    for seq in snapshots.list_seqs(str(run))[:-1]:
        os.remove(run / "snapshots" / f"{seq:012d}.state")
    newest = snapshots.read(str(run), seqs[-1])
    # Same seq, but the state of another record there: the check of type and step against the log fails.
    forged = msgspec.structs.replace(newest, tag="StepCommitted")
    (run / "snapshots" / f"{seqs[-1]:012d}.state").write_bytes(snapshots.encode(forged))
    beyond = msgspec.structs.replace(newest, seq=len(events) + 5)
    (run / "snapshots" / f"{len(events) + 5:012d}.state").write_bytes(snapshots.encode(beyond))
    opened = _open(run)
    assert opened.state == fold(events) and opened.snapshot_seq == -1


@given(st.binary(max_size=64))
def test_garbage_never_decodes_as_a_snapshot(data):
    assert snapshots.decode(data) is None


def test_verify_checks_every_snapshot_against_the_log(tmp_path, rewind_cli):
    run, events, _ = _prepared(tmp_path)
    _, out, _ = rewind_cli("verify", run)
    assert "PROBLEM snapshot" not in out, out  # (a simulated run has no checkpoint files to find)
    kept = snapshots.list_seqs(str(run))
    damaged = run / "snapshots" / f"{kept[-1]:012d}.state"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\\x00")
    wrong = snapshots.read(str(run), kept[-2])
    lying = msgspec.structs.replace(wrong, state=fold(events[:3]))
    (run / "snapshots" / f"{kept[-2]:012d}.state").write_bytes(snapshots.encode(lying))
    code, out, _ = rewind_cli("verify", run)
    assert code == 1
    assert f"PROBLEM snapshot {kept[-1]:012d}: damaged" in out
    assert f"PROBLEM snapshot {kept[-2]:012d}: differs from the fold of the log up to record {kept[-2]}" in out


def test_a_snapshot_of_another_shape_of_state_is_not_used(tmp_path):
    """msgspec fills missing fields with defaults, so a snapshot written before a State field was
    renamed would decode; its schema fingerprint keeps it from being used."""
    run, events, seqs = _prepared(tmp_path)
    newest = snapshots.read(str(run), seqs[-1])
    assert snapshots.decode(snapshots.encode(newest)) == newest
    assert snapshots.decode(snapshots.encode(msgspec.structs.replace(newest, schema="0" * 16))) is None
    # And one taken at the same seq of another history (another event there) is stale.
    other = msgspec.structs.replace(newest, event_sha256="0" * 64)
    (run / "snapshots" / f"{seqs[-1]:012d}.state").write_bytes(snapshots.encode(other))
    assert _open(run).snapshot_seq != seqs[-1] and _open(run).state == fold(events)


def _with_digests(events) -> list:
    """The log the engine writes today: each CheckpointCommitted carries the digest of the fold before
    it and the config in force then (what engine.checkpointing records)."""
    written: list = []
    for event in events:
        if isinstance(event, CheckpointCommitted):
            before, config = fold(written), config_in_force(list(enumerate(written)))
            event = msgspec.structs.replace(event, state_sha256=snapshots.state_digest(before, config))
        written.append(event)
    return written


def _vouched_snapshots(run_dir, events) -> list[int]:
    """What the engine does at each checkpoint: cache the fold up to the record before it, the state
    the checkpoint's record vouches for. Returns the seqs written."""
    seqs = []
    for seq, event in enumerate(events):
        if isinstance(event, CheckpointCommitted) and seq > 0:
            pairs = list(enumerate(events[:seq]))
            state = fold(events[:seq])
            snapshots.write(str(run_dir), snapshots.make(seq - 1, events[seq - 1], state, config_in_force(pairs)))
            seqs.append(seq - 1)
    return seqs


class _Counting(EventLog):
    """A log that keeps the first seq of every read of its records."""

    starts: list[int]

    def records(self, start_seq=0, stop_seq=None, *, check=True):
        self.starts.append(start_seq)
        return super().records(start_seq, stop_seq, check=check)


def _open_for_resume(run_dir):
    with EventLog.open(run_dir) as log:
        log.__class__, log.starts = _Counting, []
        return fold_log(log, str(run_dir), vouched=True), log.starts


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(engine_logs(CONFIG, max_crashes=3))
def test_a_resume_folds_only_the_tail_after_a_snapshot_the_log_vouches_for(tmp_path_factory, events):
    run = tmp_path_factory.mktemp("run")
    events = _with_digests(events)
    _write(run, events)
    seqs = _vouched_snapshots(run, events)
    opened, starts = _open_for_resume(run)
    assert opened.state == fold(events) and opened.config == CONFIG
    assert opened.snapshot_seq == (seqs[-1] if seqs else -1)
    assert len(opened.tail) == len(events) - 1 - opened.snapshot_seq
    assert starts == ([seqs[-1]] if seqs else [0])  # the log read once, from the snapshot on


def test_a_log_from_before_digests_is_folded_whole_by_a_resume(tmp_path):
    """Its snapshots agree with the log, but no record vouches for one: a resume folds everything,
    without a warning (they are not wrong), and a reader still starts from the newest."""
    run, events, seqs = _prepared(tmp_path)
    opened, starts = _open_for_resume(run)
    assert opened.state == fold(events) and opened.snapshot_seq == -1 and starts[-1] == 0
    assert len(opened.tail) == len(events)
    assert _open(run).snapshot_seq == seqs[-1]


def test_a_snapshot_that_is_not_the_state_its_record_vouches_for_is_not_started_from(tmp_path):
    import pytest

    from rewind.stores.folding import SnapshotsIgnored

    events = _with_digests(simulate_run(CONFIG, crash_after=[7]))
    run = tmp_path / "run"
    _write(run, events)
    seqs = _vouched_snapshots(run, events)
    newest = snapshots.read(str(run), seqs[-1])
    cursors = {name: count + 1 for name, count in newest.state.cursors.items()}
    forged = msgspec.structs.replace(newest, state=msgspec.structs.replace(newest.state, cursors=cursors))
    (run / "snapshots" / f"{seqs[-1]:012d}.state").write_bytes(snapshots.encode(forged))
    assert _open(run).state != fold(events)  # a reader is fooled (it records nothing) ...
    with pytest.warns(SnapshotsIgnored, match=f"snapshot {seqs[-1]:012d}: differs from the fold"):
        opened, starts = _open_for_resume(run)
    assert opened.state == fold(events) and opened.snapshot_seq == seqs[-2]  # ... a resume is not
    assert starts == [seqs[-1], seqs[-2]]


def test_the_digest_is_the_same_for_live_and_decoded_values():
    """The writer digests its live state, a resume a decoded snapshot: an int where a float is declared
    (or a tuple for a list) must not make them differ."""
    events = simulate_run(CONFIG)
    live = msgspec.structs.replace(fold(events), last_loss=2)  # a float field holding an int
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(live), type=type(live))
    assert isinstance(decoded.last_loss, float) and msgspec.msgpack.encode(live) != msgspec.msgpack.encode(decoded)
    assert snapshots.state_digest(live, CONFIG) == snapshots.state_digest(decoded, CONFIG)
    assert snapshots.state_digest(live, CONFIG) != snapshots.state_digest(fold(events), CONFIG)


def test_verify_checks_every_state_digest_against_the_fold(tmp_path, rewind_cli):
    events = _with_digests(simulate_run(CONFIG, crash_after=[7]))
    run = tmp_path / "run"
    _write(run, events)
    _vouched_snapshots(run, events)
    _, out, _ = rewind_cli("verify", run)
    assert "digest" not in out and "PROBLEM snapshot" not in out, out
    # A log whose record vouches for another state (a snapshot forged to match it, say): named.
    seq = max(s for s, e in enumerate(events) if isinstance(e, CheckpointCommitted))
    lying = [msgspec.structs.replace(e, state_sha256="0" * 64) if s == seq else e for s, e in enumerate(events)]
    other = tmp_path / "other"
    _write(other, lying)
    code, out, _ = rewind_cli("verify", other)
    assert code == 1 and f"record {seq} (CheckpointCommitted): its state digest is not the fold of the log before it" in out
