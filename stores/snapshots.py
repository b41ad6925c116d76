"""Snapshots of the folded state beside the log: a cache that makes opening a run cost its tail.

Folding a 1M-step log takes seconds; a resume needs only the state at its restore point and what came
after. So whenever a checkpoint's record is committed, the writer also stores the folded state as of
the record just before it (and the config in force then), and after each resume the state as of its
records, in `RUN/snapshots/<seq:012d>.state`: msgpack, a format version, and a CRC32C over the rest.
Opening a run folds only the records after the newest snapshot that checks out.

A snapshot is never trusted over the log: one that is missing, damaged, of another format or shape of
state (a schema fingerprint), from a different history (the record at its seq is not the one it was
taken at, byte for byte) or past the log's end is ignored, and the run is folded from the start instead.
Renaming a field of the state therefore never strands a run: old snapshots just stop being used.

A checksum alone protects the file, and whoever edits it recomputes that. So a resume, which records
and trains on what it folds (the reference, the held rollout batch, the cursors ...), starts only from
a snapshot the log vouches for: at a checkpoint the writer records in the CheckpointCommitted the
digest of the state folded up to the record before it and of the config in force then
(`state_digest`), and writes the snapshot of exactly that state, at the seq before the checkpoint's
(`vouched_by`: the record after the snapshot's is a CheckpointCommitted carrying its digest). A
snapshot whose digest is not the record's (forged, damaged into another valid state) is never started
from; a run written before digests folds its log whole once, and its next checkpoint vouches for one.
Whoever can edit the snapshot can edit that record too (and recompute its frame's CRC), so a resume
also cross-checks the fold from a vouched snapshot with the manifests of the checkpoints committed
after it, which record the control state (step, tokens, stage, cursors, config hash) and the KL
reference's digest, and folds the log whole when one disagrees (rewind.stores.folding). The held
rollout batch (State.rollouts), which no manifest records, must be a RolloutsRecorded the log holds at
its step (an index seek), else the log is folded whole too. `rewind verify` names such a record and
snapshot (the digest is not the fold), and deleting RUN/snapshots/ makes a resume fold the log whole.
Readers (`rewind state`, `log`, `timeline`: what they print is never recorded) start from any snapshot
that agrees with the log. `rewind verify` folds the whole log and checks every snapshot, and every
digest a record carries, against it (`snapshot_problem`, `digest_problem`). Writes are atomic
(temporary file, rename) but not synced: losing a snapshot costs one longer fold, nothing else.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from typing import Any

import google_crc32c
import msgspec

from rewind.states.config import Config
from rewind.states.state import State
from rewind.stores import confine
from rewind.stores.fsio import filesystem

SNAPSHOTS_DIR = "snapshots"
FORMAT = 1
KEEP = 3  # the newest few: enough that a damaged one still leaves a recent one to start from
# Older ones are thinned to one per band of this many records, so that `rewind state --at-step N`
# and the like start near any point of a long run (a few hundred small files at a million steps).
BAND = 1 << 16
_SUFFIX = ".state"
_CRC = struct.Struct("<I")


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    format: int
    schema: str  # SCHEMA: the shape of everything below, as this code defines it
    seq: int  # the record the state is the fold up to (inclusive)
    # That record's event type, step and content hash, checked against the log before use.
    tag: str
    step: int
    event_sha256: str
    state: State
    config: Config  # the config in force at that record


def _schema_fingerprint() -> str:
    """Changes whenever a field of the snapshot, the state or the config is added, renamed, removed or
    retyped. msgspec fills a missing field with its default, so without it a snapshot written before a
    rename would decode into a state with the renamed field at its default: a run resumed from the
    wrong state. With it, such a snapshot is simply not used."""
    return hashlib.sha256(msgspec.json.encode(msgspec.json.schema(Snapshot))).hexdigest()[:16]


def event_sha256(event: Any) -> str:
    return hashlib.sha256(msgspec.msgpack.encode(event)).hexdigest()


SCHEMA = _schema_fingerprint()


def _directory(run_dir: str) -> str | None:
    location = filesystem(run_dir)
    return os.path.join(location.path, SNAPSHOTS_DIR) if location.is_local else None


def _name(seq: int) -> str:
    return f"{seq:012d}{_SUFFIX}"


def encode(snapshot: Snapshot) -> bytes:
    body = msgspec.msgpack.encode(snapshot)
    return body + _CRC.pack(google_crc32c.value(body))


def decode(data: bytes) -> Snapshot | None:
    """The snapshot in `data`, or None for anything that does not check out."""
    if len(data) < _CRC.size:
        return None
    body, (crc,) = data[: -_CRC.size], _CRC.unpack(data[-_CRC.size :])
    if google_crc32c.value(body) != crc:
        return None
    try:
        snapshot = msgspec.msgpack.decode(body, type=Snapshot)
    except (msgspec.DecodeError, ValueError):
        return None
    return snapshot if (snapshot.format, snapshot.schema) == (FORMAT, SCHEMA) else None


class _Header(msgspec.Struct):
    """The fields every snapshot format has, to tell another release's snapshot from a damaged one."""

    format: int
    schema: str


def written_elsewhere(run_dir: str, seq: int) -> bool:
    """Whether the snapshot at `seq` is intact but of another release's format or schema (so unused:
    an expected sight after an upgrade, not damage)."""
    directory = _directory(run_dir)
    if directory is None:
        return False
    try:
        data = confine.read_file(os.path.dirname(directory), [SNAPSHOTS_DIR, _name(seq)], max_size=64 << 20)
    except (OSError, confine.NotConfined):
        return False
    body, crc = data[: -_CRC.size], data[-_CRC.size :]
    if len(data) < _CRC.size or google_crc32c.value(body) != _CRC.unpack(crc)[0]:
        return False
    try:
        header = msgspec.msgpack.decode(body, type=_Header)
    except (msgspec.DecodeError, ValueError):
        return False
    return (header.format, header.schema) != (FORMAT, SCHEMA)


def make(seq: int, event: Any, state: State, config: Config) -> Snapshot:
    """The snapshot of `state`, the fold up to record `seq`, which holds `event`."""
    return Snapshot(
        format=FORMAT,
        schema=SCHEMA,
        seq=seq,
        tag=type(event).__struct_config__.tag,
        step=event.step,
        event_sha256=event_sha256(event),
        state=state,
        config=config,
    )


def write(run_dir: str, snapshot: Snapshot) -> None:
    """Store a snapshot, keeping the newest few. Local run directories only (object stores fold from
    the start)."""
    directory = _directory(run_dir)
    if directory is None:
        return
    seq = snapshot.seq
    os.makedirs(directory, exist_ok=True)
    data = encode(snapshot)
    final = os.path.join(directory, _name(seq))
    tmp = f"{final}.tmp-{os.getpid()}"
    with open(tmp, "wb") as handle:
        handle.write(data)
    os.replace(tmp, final)
    kept_bands: set[int] = set()
    for old in list_seqs(run_dir)[:-KEEP]:
        if old // BAND not in kept_bands:
            kept_bands.add(old // BAND)  # the first snapshot of each band stays
            continue
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(directory, _name(old)))


def discard_after(run_dir: str, end_seq: int) -> None:
    """Remove the snapshots past a log's end (records a crash or a cut took away): the writer is about to
    give those seqs to other records, and a cache of another history would be taken for a stale one."""
    directory = _directory(run_dir)
    for seq in list_seqs(run_dir):
        if seq > end_seq and directory is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(directory, _name(seq)))


def list_seqs(run_dir: str) -> list[int]:
    directory = _directory(run_dir)
    if directory is None or not os.path.isdir(directory):
        return []
    stems = (n[: -len(_SUFFIX)] for n in os.listdir(directory) if n.endswith(_SUFFIX))
    return sorted(int(stem) for stem in stems if stem.isdigit())


def read(run_dir: str, seq: int) -> Snapshot | None:
    directory = _directory(run_dir)
    if directory is None:
        return None
    try:  # a cache: only a regular file inside the run, and never a reason to OOM
        data = confine.read_file(os.path.dirname(directory), [SNAPSHOTS_DIR, _name(seq)], max_size=64 << 20)
    except (OSError, confine.NotConfined):
        return None
    snapshot = decode(data)
    return snapshot if snapshot is not None and snapshot.seq == seq else None


def snapshot_problem(seq: int, snapshot: Snapshot | None, event: Any, state: State, config: Config | None) -> str:
    """Why the snapshot stored at `seq` is not the fold of the log up to that record ("" if it is):
    `event` is the log's record `seq`, `state` the fold of the log up to it, `config` the config in
    force then. `rewind verify` and a resume both ask this (None: the file did not decode)."""
    where = f"snapshot {seq:012d}"
    if snapshot is None:
        return f"{where}: damaged or of an unknown format (ignored; deleting it is safe)"
    tag = type(event).__struct_config__.tag
    if (snapshot.tag, snapshot.step) != (tag, event.step):
        return f"{where}: names {snapshot.tag} at step {snapshot.step}, the log holds {tag} at step {event.step}"
    same = snapshot.event_sha256 == event_sha256(event) and _bits(snapshot.state) == _bits(state)
    if not same or _bits(snapshot.config) != _bits(config):
        return f"{where}: differs from the fold of the log up to record {seq}; delete it (it is a cache)"
    return ""


_CANONICAL = msgspec.msgpack.Encoder(order="deterministic")


def _bits(value: Any) -> bytes:
    """Equal for equal values, a NaN (a skipped step's loss) included, whatever order a dict was built in."""
    return _CANONICAL.encode(value)


def state_digest(state: State, config: Config | None) -> str:
    """What a CheckpointCommitted records of the state folded up to the record before it and the config
    in force then: the sha256 of their canonical encoding, taken after a round trip through the wire
    types, so that the writer's live values (an int where a float is declared) and a decoded
    snapshot's give the same digest for the same state."""
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode((state, config)), type=tuple[State, Config | None])
    return hashlib.sha256(_bits(wire)).hexdigest()


def vouched_by(snapshot: Snapshot, after: Any) -> bool:
    """Does `after`, the log's record just after the snapshot's, vouch for it (a CheckpointCommitted
    that carries the digest of its state and config)?"""
    digest = getattr(after, "state_sha256", "")
    return bool(digest) and digest == state_digest(snapshot.state, snapshot.config)


def digest_problem(seq: int, event: Any, state: State, config: Config | None) -> str:
    """Why record `seq`'s state digest is not that of `state` and `config`, the fold up to the record
    before it ("" if it is, or if the record carries none)."""
    digest = getattr(event, "state_sha256", "")
    if not digest or digest == state_digest(state, config):
        return ""
    return f"record {seq} ({type(event).__struct_config__.tag}): its state digest is not the fold of the log before it"


def candidates(run_dir: str, end_seq: int) -> list[Snapshot]:
    """Snapshots that could start a fold of a log ending at `end_seq`, newest first (the caller checks
    each against the log before using it)."""
    found: list[Any] = [read(run_dir, seq) for seq in reversed(list_seqs(run_dir)) if seq <= end_seq]
    return [snapshot for snapshot in found if snapshot is not None]
