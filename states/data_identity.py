"""What a run's data *is*, on record: the identity of every user dataset, the tokenizer and the pretrained
weights a run starts from, written in its first event (RunStarted) and in every ConfigChanged that
brings new data in.

Two levels of checking, because a corpus can be large:
- cheap, on every resume, fork and replay: each file's size and `fingerprint` (a hash of its size and of
  a fixed set of blocks spread through it, computed by rewind.stores.datafiles), and for data prepared by
  `rewind data prepare` the hash of its manifest;
- full, on demand (`rewind verify --data`): each file's sha256.

Pure: the engine computes identities; this module holds their shape and says how two differ.
"""

from __future__ import annotations

import msgspec


class SourceFile(msgspec.Struct, frozen=True, kw_only=True):
    """One file a dataset reads: its path as the config resolved it, size in bytes, cheap fingerprint
    and full content hash ("" when it was not computed: a remote file of a run that skipped it)."""

    path: str
    size: int
    fingerprint: str
    sha256: str = ""


class DataIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """One dataset. `sources`: the files its train rows come from (a prepared directory's token file, or
    the documents a text dataset is tokenised from); `validation_sources` when the split has its own
    files; `prepared`: sha256 of the manifest rewind tokenised it into ("" = read as is); `tokenizer`:
    sha256 of the tokenizer that made its tokens ("" = UTF-8 bytes, or a token file of unknown origin)."""

    kind: str
    sources: list[SourceFile] = []
    validation_sources: list[SourceFile] = []
    prepared: str = ""
    tokenizer: str = ""
    num_tokens: int = 0
    # A prepared directory's token files (train, then validation), whatever its sources are: what the
    # steps actually read, so an edit of them is a change even when the documents are unchanged.
    token_files: list[SourceFile] = []


def _files_changed(label: str, recorded: list[SourceFile], current: list[SourceFile], full: bool) -> list[str]:
    if [f.path for f in recorded] != [f.path for f in current]:
        gone = [f.path for f in recorded if f.path not in {c.path for c in current}]
        added = [f.path for f in current if f.path not in {r.path for r in recorded}]
        parts = []
        if gone:
            parts.append(f"{len(gone)} file(s) gone ({gone[0]}{', ...' if len(gone) > 1 else ''})")
        if added:
            parts.append(f"{len(added)} new file(s) ({added[0]}{', ...' if len(added) > 1 else ''})")
        return [f"{label}: " + (" and ".join(parts) or "the files are in another order")]
    for old, new in zip(recorded, current, strict=True):
        if old.size != new.size:
            return [f"{label}: {old.path}: size {new.size} bytes, the run recorded {old.size}"]
        if old.fingerprint != new.fingerprint:
            return [f"{label}: {old.path}: contents changed (same size, different fingerprint)"]
        if full and old.sha256 and new.sha256 and old.sha256 != new.sha256:
            return [f"{label}: {old.path}: contents changed (sha256 {new.sha256[:12]}, recorded {old.sha256[:12]})"]
    return []


def identity_changes(name: str, recorded: DataIdentity, current: DataIdentity, *, full: bool = False) -> list[str]:
    """How dataset `name` now differs from what the run recorded, one line per difference ([] = the same).
    `full`: compare content hashes too (both sides must have computed them)."""
    label = f"dataset {name!r}"
    if recorded.kind != current.kind:
        return [f"{label}: kind {current.kind!r}, the run recorded {recorded.kind!r}"]
    changes = _files_changed(label, recorded.sources, current.sources, full)
    changes += _files_changed(f"{label} (validation)", recorded.validation_sources, current.validation_sources, full)
    if recorded.token_files and not changes:  # (a run recorded before they were has none to compare)
        changes += _files_changed(f"{label} (its token files)", recorded.token_files, current.token_files, full)
    if recorded.tokenizer != current.tokenizer:
        changes.append(f"{label}: tokenised by another tokenizer ({current.tokenizer[:12] or 'bytes'}, "
                       f"recorded {recorded.tokenizer[:12] or 'bytes'})")
    if recorded.prepared and current.prepared and recorded.prepared != current.prepared:
        changes.append(f"{label}: its prepared manifest changed ({current.prepared[:12]}, recorded {recorded.prepared[:12]})")
    return changes
