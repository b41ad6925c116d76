"""Tokenise documents once into a prepared directory (rewind.stores.datamanifest), for `rewind data
prepare` and for a run that starts on text datasets.

Documents are read in order, grouped into batches of about `BATCH_CHARS` characters and tokenised with
the tokenizer's `encode_batch`, which is where the parallelism is (the Rust side spreads a batch over
its threads without the GIL), `IN_FLIGHT` batches at a time. Batching by size rather than by count
keeps every batch worth a thread pool's start-up whether the documents are tweets or books; a text
file is one document, so one huge file is encoded by one thread (split it, or use jsonl).

Preparing is idempotent: a directory already prepared from the same inputs (same paths, sizes and
fingerprints), by the same tokenizer and from the same kind and field, is returned as it is; with a
tokenizer to train, that is decided before training one (`reusable_trained`).
"""

from __future__ import annotations

import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from rewind.engine.data.documents import DocumentError, expand_inputs, iter_documents
from rewind.engine.data.tokenizer import (
    TOKENIZER_FILE,
    ByteTokenizer,
    TextTokenizer,
    Tokenizer,
    TokenizerError,
    load_tokenizer,
    train_bpe,
)
from rewind.states.data_identity import DataIdentity, SourceFile, identity_changes
from rewind.stores.datafiles import file_identity
from rewind.stores.datamanifest import (
    MANIFEST_FILE,
    DataManifest,
    ManifestError,
    check_prepared,
    dtype_for,
    read_manifest,
)
from rewind.stores.fsio import decode_json
from rewind.stores.preparedwriter import PreparedWriter

# Characters per encode_batch call, and how many calls run at once. Measured on the standard library's
# .py files (13 MB) with an 8192-id BPE on 2 cores, as a fraction of one encode_batch call over all of
# them: one batch at a time reaches 0.68 (64 KiB), 0.81 (256 KiB), 0.90 (1 MiB), because the pool idles
# while the last long document of each batch finishes; two at a time 0.76, 0.94, 0.96; three no better.
# Larger batches only hold more memory (IN_FLIGHT + 1 batches' encodings live at once).
BATCH_CHARS = 1 << 20
IN_FLIGHT = 2


@dataclass(frozen=True)
class Inputs:
    """The files of one split, expanded, and their cheap identities (size + fingerprint); `left_out`:
    (name, the name kept) for each name of a file already in."""

    paths: list[str]
    identities: list[SourceFile]
    left_out: list[tuple[str, str]] = field(default_factory=list)


def resolve_inputs(
    inputs: Iterable[str], base_dir: str | os.PathLike[str] | None = None, *, by_file: bool = False
) -> Inputs:
    """Every file `inputs` names (paths and globs, in the order given, each glob sorted), without
    repeats, with their cheap identities. A repeat is the same name again, and with `by_file` also
    another name of the same file (a symlink, a hard link), which `rewind data prepare` reads once;
    a run's dataset keeps what its glob names, as the run recorded it."""
    paths: list[str] = []
    kept: dict[object, str] = {}
    left_out: list[tuple[str, str]] = []
    for pattern in inputs:
        for path in expand_inputs(pattern, base_dir):
            key = file_key(path) if by_file else path
            if key in kept:
                left_out.append((path, kept[key]))
            else:
                kept[key] = path
                paths.append(path)
    identities = []
    for path in paths:
        try:
            identities.append(file_identity(path))
        except OSError as exc:
            raise DocumentError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return Inputs(paths, identities, left_out)


def file_key(path: str) -> object:
    """What `path` is: a local file's device and inode (every name of it alike), else its URL."""
    if "://" in path or "::" in path:
        return path
    try:
        info = os.stat(path)
    except OSError as exc:
        raise DocumentError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return (info.st_dev, info.st_ino)


def shared_files(train: Inputs, validation: Inputs) -> list[tuple[str, str]]:
    """(train name, validation name) of each file that both splits read."""
    in_train = {file_key(path): path for path in train.paths}
    return [(in_train[key], path) for path in validation.paths if (key := file_key(path)) in in_train]


def _batches(documents: Iterator[str], batch_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    num_chars = 0
    for document in documents:
        batch.append(document)
        num_chars += len(document)
        if num_chars >= batch_chars:
            yield batch
            batch, num_chars = [], 0
    if batch:
        yield batch


def _join(encoded: list[list[int]], separator: list[int], first: bool, dtype: np.dtype) -> np.ndarray:
    """The documents' ids as one array, the separator before each but the very first of the split."""
    flat: list[int] = []
    for ids in encoded:
        if not first:
            flat += separator
        first = False
        flat += ids
    return np.array(flat, dtype=dtype)


def tokenise_split(
    writer: PreparedWriter,
    split: str,
    paths: Sequence[str],
    tokenizer: TextTokenizer,
    *,
    kind: str,
    text_field: str,
    bar=None,
    batch_chars: int = BATCH_CHARS,
) -> int:
    """Tokenise the documents of `paths` into `split` of `writer`; returns the number of documents.

    `IN_FLIGHT` batches are encoded at once, each from a worker thread (encode_batch runs without the
    GIL): the tokenizer's threads pick up the next batch while the last documents of one finish, and
    reading, joining and writing here overlap with encoding. Results are written in order."""
    separator = tokenizer.separator()
    num_documents = 0
    pending: deque[tuple[Future[list[list[int]]], int]] = deque()

    def write_oldest() -> None:
        nonlocal num_documents
        future, num_in_batch = pending.popleft()
        writer.append(split, _join(future.result(), separator, num_documents == 0, writer.dtype))
        num_documents += num_in_batch
        if bar is not None:
            bar.update(num_in_batch)
            bar.set_postfix_str(f"{writer.num_tokens(split):,} {split} tokens", refresh=False)

    with ThreadPoolExecutor(max_workers=IN_FLIGHT, thread_name_prefix="rewind-tokenise") as pool:
        for batch in _batches(iter_documents(paths, kind, text_field), batch_chars):
            pending.append((pool.submit(tokenizer.encode_batch, batch), len(batch)))
            if len(pending) >= IN_FLIGHT:
                write_oldest()
        while pending:
            write_oldest()
    return num_documents


def _identity(kind: str, train: Inputs, validation: Inputs | None, tokenizer: str) -> DataIdentity:
    return DataIdentity(
        kind=kind,
        sources=train.identities,
        validation_sources=validation.identities if validation else [],
        tokenizer=tokenizer,
    )


def differences(
    manifest: DataManifest, train: Inputs, validation: Inputs | None, tokenizer: TextTokenizer, *, kind: str,
    text_field: str,
) -> list[str]:
    """How a prepared directory's manifest differs from preparing `train` (and `validation`) with
    `tokenizer` as `kind` / `text_field` now, one line each ([] = the same inputs: size and fingerprint)."""
    lines = []
    if manifest.input_kind != kind:
        lines.append(f"kind {manifest.input_kind}, not {kind}")
    elif manifest.text_field != text_field:
        lines.append(f"text field {manifest.text_field!r}, not {text_field!r}")
    recorded = DataIdentity(
        kind=kind,
        sources=manifest.sources,
        validation_sources=manifest.validation_sources,
        tokenizer=manifest.tokenizer,
    )
    for line in identity_changes("inputs", recorded, _identity(kind, train, validation, tokenizer.identity)):
        # identity_changes speaks of a run's dataset; here it is a directory's inputs.
        lines.append(line.replace("dataset 'inputs'", "inputs", 1).replace("the run recorded", "prepared from"))
    return lines


def reusable(
    out_dir: str | os.PathLike[str],
    train: Inputs,
    validation: Inputs | None,
    tokenizer: TextTokenizer,
    *,
    kind: str,
    text_field: str,
    overwrite: bool = False,
) -> DataManifest | None:
    """The manifest of `out_dir` when it already holds these inputs prepared by this tokenizer as this
    kind (None when it holds something else, or nothing). Prepared the same but damaged: ManifestError,
    unless `overwrite` (then None: prepare it again)."""
    if not os.path.isfile(os.path.join(out_dir, MANIFEST_FILE)):
        return None
    try:
        manifest = read_manifest(out_dir)
    except ManifestError:
        return None  # unreadable: not reusable, and replaceable with overwrite
    if differences(manifest, train, validation, tokenizer, kind=kind, text_field=text_field):
        return None
    if problems := check_prepared(out_dir):
        if overwrite:
            return None
        raise ManifestError(f"{problems[0]} (prepared from these inputs, but damaged: --overwrite prepares it again)")
    return manifest


def _check_out_dir(out_dir: str, overwrite: bool, why: Callable[[DataManifest], list[str]]) -> None:
    """Refuse to put a prepared directory where something else is: a file, a non-empty directory
    (unless `overwrite`), and never replace a directory that is not a prepared one. `why`: how the
    prepared data there differs (for the message)."""
    if not os.path.lexists(out_dir):
        return
    if not os.path.isdir(out_dir) or os.path.islink(out_dir):
        raise ManifestError(f"{out_dir}: exists and is not a directory")
    if not os.listdir(out_dir):
        return
    if not os.path.lexists(os.path.join(out_dir, MANIFEST_FILE)):
        raise ManifestError(f"{out_dir}: exists, is not empty and is not a prepared directory (refusing to replace it)")
    if not overwrite:
        try:
            reason = (why(read_manifest(out_dir)) or ["another tokenizer or inputs"])[0]
        except ManifestError as exc:
            reason = str(exc)
        raise ManifestError(f"{out_dir}: holds other prepared data ({reason}; --overwrite replaces it)")


def prepare(
    inputs: Sequence[str],
    out_dir: str | os.PathLike[str],
    tokenizer: TextTokenizer | None = None,
    *,
    kind: str,
    text_field: str = "text",
    validation_inputs: Sequence[str] = (),
    base_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
    progress: bool = False,
    batch_chars: int = BATCH_CHARS,
    reused: list[bool] | None = None,
) -> DataManifest:
    """Tokenise the documents of `inputs` (paths or globs; `validation_inputs` likewise, into the
    validation split) into the prepared directory `out_dir`: `prepare_files` of them."""
    train = resolve_inputs(inputs, base_dir)
    validation = resolve_inputs(validation_inputs, base_dir) if validation_inputs else None
    return prepare_files(
        train, validation, out_dir, tokenizer, kind=kind, text_field=text_field, overwrite=overwrite,
        progress=progress, batch_chars=batch_chars, reused=reused,
    )


def prepare_files(
    train: Inputs,
    validation: Inputs | None,
    out_dir: str | os.PathLike[str],
    tokenizer: TextTokenizer | None = None,
    *,
    kind: str,
    text_field: str = "text",
    overwrite: bool = False,
    progress: bool = False,
    batch_chars: int = BATCH_CHARS,
    reused: list[bool] | None = None,
) -> DataManifest:
    """Tokenise the documents of `train` (and `validation`, into the validation split) into the
    prepared directory `out_dir`, or return it as it is when it already holds exactly that (see
    `reusable`; `reused`, when given, gets True appended then, else False). `tokenizer` None = UTF-8
    bytes. `overwrite`: replace a prepared directory of other data (never a directory that is not a
    prepared one). Errors: DocumentError, ManifestError (one line each)."""
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    out_dir = os.path.abspath(os.path.expanduser(os.fspath(out_dir)))
    manifest = reusable(out_dir, train, validation, tokenizer, kind=kind, text_field=text_field, overwrite=overwrite)
    if reused is not None:
        reused.append(manifest is not None)
    if manifest is not None:
        return manifest
    _check_out_dir(out_dir, overwrite, lambda found: differences(
        found, train, validation, tokenizer, kind=kind, text_field=text_field))
    dtype = dtype_for(tokenizer.vocab_size)
    if any(not 0 <= t < tokenizer.vocab_size for t in tokenizer.separator()):
        raise ManifestError(f"the tokenizer's separator {tokenizer.separator()} is outside its vocabulary")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc="tokenising", unit=" docs", file=sys.stderr, dynamic_ncols=True)
    try:
        with PreparedWriter(out_dir, dtype=dtype, overwrite=overwrite) as writer:
            splits = [("train", train)] + ([("validation", validation)] if validation else [])
            num_documents = {
                split: tokenise_split(writer, split, files.paths, tokenizer, kind=kind, text_field=text_field,
                                      bar=bar, batch_chars=batch_chars)
                for split, files in splits
            }
            manifest = writer.commit(
                input_kind=kind,
                text_field=text_field,
                vocab_size=tokenizer.vocab_size,
                tokenizer_json=tokenizer.to_json(),
                separator=tokenizer.separator(),
                sources=_full_identities(train),
                validation_sources=_full_identities(validation) if validation else [],
                num_documents=num_documents,
            )
        return manifest
    finally:
        if bar is not None:
            bar.close()


def _full_identities(inputs: Inputs) -> list[SourceFile]:
    """The inputs' identities with their sha256, which must be those of the files as they were read:
    a file that changed while it was being tokenised would leave tokens of a text nobody can name."""
    full = []
    for before in inputs.identities:
        now = file_identity(before.path, full=True)
        if (now.size, now.fingerprint) != (before.size, before.fingerprint):
            raise DocumentError(f"{before.path}: changed while it was being prepared (prepare again)")
        full.append(now)
    return full


def prepare_tokenizer(train: Inputs, kind: str, text_field: str, vocab_size: int) -> Tokenizer:
    """A byte-level BPE of `vocab_size` ids trained on the documents of `train` (deterministic)."""
    return train_bpe(iter_documents(train.paths, kind, text_field), vocab_size)


def reusable_trained(
    out_dir: str | os.PathLike[str], train: Inputs, validation: Inputs | None, *, kind: str, text_field: str,
    vocab_size: int,
) -> Tokenizer | None:
    """The tokenizer of `out_dir` when the directory can be returned as it is for preparing these inputs
    with a BPE of `vocab_size` ids trained on them, so that a re-run does not train one first (seconds
    on a large corpus): the directory holds these inputs (`reusable`) tokenised by a tokenizer made as
    `train_bpe` makes them, with `vocab_size` ids (a trained tokenizer is a function of its train
    documents and vocab_size). None: train one (a corpus too small to fill the vocabulary always is)."""
    out_dir = os.path.abspath(os.path.expanduser(os.fspath(out_dir)))
    if not os.path.isfile(os.path.join(out_dir, TOKENIZER_FILE)):
        return None
    try:
        found = load_tokenizer(os.path.join(out_dir, TOKENIZER_FILE))
    except TokenizerError:
        return None  # prepare says what is wrong with the directory, if anything
    if found.vocab_size != vocab_size or _without_learned(found) != _without_learned(train_bpe([], vocab_size)):
        return None
    try:
        same = reusable(out_dir, train, validation, found, kind=kind, text_field=text_field)
    except ManifestError:  # prepared from these inputs but damaged: prepare says so (or replaces it)
        return None
    return found if same is not None else None


def _without_learned(tokenizer: Tokenizer) -> dict:
    """A tokenizer.json without what training learns (merges, and the vocabulary past the 257 fixed ids)."""
    data = decode_json(tokenizer.to_json())
    model = data.get("model") or {}
    fixed = sorted((token, i) for token, i in (model.get("vocab") or {}).items() if i < 257)
    return {**data, "model": {**{k: v for k, v in model.items() if k not in ("vocab", "merges")}, "vocab": fixed}}
