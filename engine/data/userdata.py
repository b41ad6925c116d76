"""Opening a user dataset (`[data.NAME]`) and saying what it is (its DataIdentity).

- kind "tokens", a file: memory-mapped (fsspec ranged reads when remote); identity: the file's size,
  fingerprint and (at a run's start) sha256; tokenizer unknown ("").
- kind "tokens", a directory prepared by `rewind data prepare`: its train.bin (and validation.bin, which
  then is the validation split); identity: the token files (sha256 from the manifest), the manifest's
  hash, the tokenizer that made them. A run whose tokenizer differs is refused: the ids would mean
  other text.
- kinds "text", "jsonl", "parquet" (documents): tokenised by the run's tokenizer into the run's data
  directory (`RUN/data/NAME/`, the same code and format as `rewind data prepare`) when the run starts,
  reused after; identity: the input files (sha256), the manifest's hash, the tokenizer.
- jsonl / parquet with prompt_field and response_field (or chosen_field: a dpo dataset's chosen responses):
  examples tokenised in memory when opened (pair datasets are fine-tuning sets, small next to a corpus);
  identity: the input files.

Validation rows come from `validation_path` when given, else are carved from `path` by `RowSplit`:
"random" unless the config says "tail" or the run predates the "data_identity" feature.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sysconfig
import tempfile
import weakref
from dataclasses import dataclass, field

import msgspec
import numpy as np

from rewind.engine.data.datasets import DatasetError, PairDataset, WindowedDataset, pack_pairs
from rewind.engine.data.documents import DocumentError, expand_inputs, iter_pairs
from rewind.engine.data.tokenizer import ByteTokenizer, TextTokenizer
from rewind.engine.data.tokenizer_clash import tokenised_by_another
from rewind.engine.data.tokens import RowSplit, TokenFileError, TokenStream, holdout_problem, open_stream
from rewind.states.check_data import STDLIB_PLACEHOLDER
from rewind.states.config import DataSource
from rewind.states.data_identity import DataIdentity, SourceFile
from rewind.stores.confine import plain_name_problem
from rewind.stores.datafiles import file_identity
from rewind.stores.datamanifest import ManifestError, is_prepared, manifest_hash, read_manifest
from rewind.stores.fsio import filesystem


class _Scratch:
    """A temporary directory made on first use and removed with the last DataHome that shares it (copies
    made with dataclasses.replace share it), without the warning an implicit TemporaryDirectory cleanup gives."""

    def __init__(self) -> None:
        self.path: str | None = None

    def get(self) -> str:
        if self.path is None:
            self.path = tempfile.mkdtemp(prefix="rewind-data-")
            weakref.finalize(self, shutil.rmtree, self.path, ignore_errors=True)
        return self.path


@dataclass
class DataHome:
    """Where a run's data comes from and goes. `base_dir`: what relative paths are taken against (None:
    the working directory); `data_dir`: where documents are tokenised to (None: a temporary directory
    that lives as long as this object); `reuse_dirs`: data directories whose documents already tokenised
    are read, never written (a fork reads its parent's); `default_split`: what DataSource.split "" means
    for this run; `full_identity`: hash every file whole when computing identities (a run's start,
    verify --data); `streams`: the token files opened through it, by dataset (what
    rewind.engine.data.rundata.check_unchanged looks at before each checkpoint)."""

    tokenizer: TextTokenizer = field(default_factory=ByteTokenizer)
    data_dir: str | None = None
    base_dir: str | None = None
    default_split: str = "random"
    full_identity: bool = False
    reuse_dirs: tuple[str, ...] = ()
    streams: list[tuple[str, TokenStream]] = field(default_factory=list)
    _scratch: _Scratch = field(default_factory=_Scratch)
    _byte_table: np.ndarray | None = None

    def token_num_bytes(self) -> np.ndarray:
        """UTF-8 bytes per token id of the tokenizer (computed once: it walks the vocabulary)."""
        if self._byte_table is None:
            self._byte_table = self.tokenizer.token_num_bytes()
        return self._byte_table

    def resolve(self, path: str) -> str:
        if "://" in path:
            return path
        path = os.path.expanduser(path.replace(STDLIB_PLACEHOLDER, sysconfig.get_paths()["stdlib"]))
        if self.base_dir is not None and not os.path.isabs(path):
            path = os.path.join(self.base_dir, path)
        return path

    def prepared_name(self, name: str, source: DataSource) -> str:
        """The directory documents of `name` are tokenised into: keyed by what makes the tokens (the
        declaration's inputs and the tokenizer), so a fork that declares other documents tokenises them
        beside the old ones, which the steps before it still read. The dataset's name is the start of a
        directory's: a path ('../x') would lead out of the run's data."""
        if problem := plain_name_problem(name):
            raise DatasetError(f"dataset {name[:80]!r}: {problem}; a dataset's name must be a plain name")
        making = [source.kind, source.path, source.validation_path, source.text_field, self.tokenizer.identity]
        return f"{name}-{hashlib.sha256(msgspec.json.encode(making)).hexdigest()[:12]}"

    def open_stream(self, name: str, path: str, dtype: str) -> TokenStream:
        """The token file at `path`, read by dataset `name` (and kept in `streams`)."""
        stream = open_stream(path, dtype)
        self.streams.append((name, stream))
        return stream

    def is_reused(self, directory: str) -> bool:
        return any(os.path.dirname(directory) == reused for reused in self.reuse_dirs)

    def prepared_dir(self, name: str, source: DataSource) -> str:
        directory = self.prepared_name(name, source)
        for reused in self.reuse_dirs:
            if is_prepared(os.path.join(reused, directory)):
                return os.path.join(reused, directory)
        return os.path.join(self.data_dir if self.data_dir is not None else self._scratch.get(), directory)


def _split_mode(source: DataSource, home: DataHome) -> str:
    return source.split or home.default_split


def open_user_dataset(
    name: str, source: DataSource, block_size: int, vocab_size: int, home: DataHome | None = None
) -> WindowedDataset | PairDataset:
    home = home or DataHome()
    try:
        dataset = _open(name, source, block_size, vocab_size, home)
    except (TokenFileError, DocumentError, ManifestError) as exc:
        raise DatasetError(f"dataset {name!r}: {exc}") from None
    dataset.reshuffle = source.on_epoch_end == "reshuffle"
    return dataset


def _open(name: str, source: DataSource, block_size: int, vocab_size: int, home: DataHome):
    if source.prompt_field:
        return _open_pairs(name, source, block_size, home)
    if source.kind == "tokens":
        path = home.resolve(source.path)
        if is_prepared(path):
            return _open_prepared(name, path, block_size, vocab_size, home, source)
        validation = None
        if source.validation_path:
            validation = home.open_stream(name, home.resolve(source.validation_path), source.dtype)
        return WindowedDataset(
            name, home.open_stream(name, path, source.dtype), block_size, vocab_size,
            split=_split_mode(source, home), fraction=source.validation_fraction, validation=validation,
            check_all=home.full_identity,  # a start: every id checked before RunStarted
        )
    # Documents: tokenised once into the run's data directory, then read like a prepared directory.
    from rewind.engine.data.dataprep import prepare

    out_dir = home.prepared_dir(name, source)
    if home.is_reused(out_dir):  # another run's (a fork's parent): read, never written
        return _open_prepared(name, out_dir, block_size, vocab_size, home, source)
    prepare(
        [home.resolve(source.path)],
        out_dir,
        home.tokenizer,
        kind=source.kind,
        text_field=source.text_field,
        validation_inputs=[home.resolve(source.validation_path)] if source.validation_path else (),
        overwrite=True,
    )
    return _open_prepared(name, out_dir, block_size, vocab_size, home, source)


def _open_prepared(name, directory, block_size, vocab_size, home: DataHome, source: DataSource) -> WindowedDataset:
    manifest = read_manifest(directory)
    if manifest.tokenizer != home.tokenizer.identity:
        raise DatasetError(tokenised_by_another(name, directory, manifest, home.tokenizer))
    location = filesystem(directory)
    streams = {
        split: home.open_stream(name, location.join(f.file).url, manifest.dtype) for split, f in manifest.splits.items()
    }
    if source.validation_path and source.kind == "tokens":  # (documents' validation_path is in the manifest)
        if "validation" in streams:
            raise DatasetError(
                f"dataset {name!r}: {directory} has a validation split of its own; drop validation_path"
            )
        streams["validation"] = home.open_stream(name, home.resolve(source.validation_path), manifest.dtype)
    return WindowedDataset(
        name, streams["train"], block_size, vocab_size,
        split=_split_mode(source, home), fraction=source.validation_fraction, validation=streams.get("validation"),
        check_all=home.full_identity,  # a start: every id checked before RunStarted
    )


def _tokenised_pairs(paths: list[str], source: DataSource, home: DataHome) -> list[tuple[list[int], list[int]]]:
    # A dpo dataset (prompt/chosen/rejected) reads as pairs with its chosen responses, a grpo one
    # (prompt/answer) with its answers.
    response = source.response_field or source.chosen_field or source.answer_field
    pairs = list(iter_pairs(paths, source.kind, source.prompt_field, response))
    tokenizer = home.tokenizer
    prompts = tokenizer.encode_batch([p for p, _ in pairs])
    responses = tokenizer.encode_batch([r for _, r in pairs])
    return list(zip(prompts, responses, strict=True))


def _open_pairs(name: str, source: DataSource, block_size: int, home: DataHome) -> PairDataset:
    tokenizer = home.tokenizer
    end_id = tokenizer.eos_id
    pairs = _tokenised_pairs(expand_inputs(home.resolve(source.path)), source, home)
    if source.validation_path:
        train = pairs
        validation = _tokenised_pairs(expand_inputs(home.resolve(source.validation_path)), source, home)
    else:  # carved as a token file's windows are (RowSplit), with examples for windows
        if problem := holdout_problem(len(pairs), source.validation_fraction):
            raise DatasetError(f"dataset {name!r}: {home.resolve(source.path)}: too small: {problem}")
        carve = RowSplit(len(pairs), _split_mode(source, home), source.validation_fraction)
        validation = [pairs[i] for i in carve.rows("validation", np.arange(carve.num_validation)).tolist()]
        train = [pairs[i] for i in carve.rows("train", np.arange(carve.num_train)).tolist()]
    rows = {
        "train": pack_pairs(train, block_size, tokenizer.pad_id, end_id),
        "validation": pack_pairs(validation, block_size, tokenizer.pad_id, end_id),
    }
    return PairDataset(name, rows, block_size, home.resolve(source.path))


# --- identity -------------------------------------------------------------------------------------


def _identities(paths: list[str], full: bool) -> list[SourceFile]:
    out = []
    for path in paths:
        try:
            out.append(file_identity(path, full=full))
        except FileNotFoundError:
            raise DatasetError(f"{path}: file not found") from None
        except OSError as exc:
            raise DatasetError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return out


def dataset_identity(name: str, source: DataSource, home: DataHome) -> DataIdentity:
    """What dataset `name` is now (the cheap identity, or the full one with home.full_identity)."""
    full = home.full_identity
    try:
        if source.kind == "tokens" and not source.prompt_field:
            path = home.resolve(source.path)
            if is_prepared(path):
                identity = _prepared_identity(path, source.kind, [], [], full)
                if source.validation_path:
                    validation_file = _identities([home.resolve(source.validation_path)], full)
                    identity = msgspec.structs.replace(identity, validation_sources=identity.validation_sources + validation_file)
                return identity
            validation = [home.resolve(source.validation_path)] if source.validation_path else []
            files = _identities([path], full)
            return DataIdentity(
                kind="tokens",
                sources=files,
                validation_sources=_identities(validation, full),
                num_tokens=files[0].size // np.dtype(source.dtype).itemsize,
            )
        inputs = _identities(expand_inputs(home.resolve(source.path)), full)
        validation = _identities(expand_inputs(home.resolve(source.validation_path)), full) if source.validation_path else []
        if source.prompt_field:
            return DataIdentity(kind=source.kind, sources=inputs, validation_sources=validation, tokenizer=home.tokenizer.identity)
        return _prepared_identity(home.prepared_dir(name, source), source.kind, inputs, validation, full)
    except (DocumentError, ManifestError) as exc:
        raise DatasetError(f"dataset {name!r}: {exc}") from None
    except DatasetError as exc:  # a file gone or unreadable: say whose
        raise DatasetError(f"dataset {name!r}: {exc}") from None


def _prepared_identity(
    directory: str, kind: str, inputs: list[SourceFile], validation: list[SourceFile], full: bool
) -> DataIdentity:
    """A prepared directory: the documents it was made from (`inputs`, for data rewind tokenised into the
    run) or, for a directory the user prepared, its own token files as its sources. Either way its token
    files are fingerprinted (a same-size edit of them is seen by the cheap check); their sha256 is the
    manifest's, which `verify --data` checks against their bytes (`check_prepared`), so a start does not
    hash them again."""
    manifest = read_manifest(directory)
    location = filesystem(directory)
    token_files = {}
    for split, token_file in manifest.splits.items():
        found = _identities([location.join(token_file.file).url], False)[0]
        token_files[split] = SourceFile(path=found.path, size=found.size, fingerprint=found.fingerprint, sha256=token_file.sha256)
    if not inputs:
        inputs = [token_files["train"]]
        validation = [token_files["validation"]] if "validation" in token_files else []
    num_tokens = sum(token_file.num_tokens for token_file in manifest.splits.values())
    return DataIdentity(
        kind=kind, sources=inputs, validation_sources=validation, prepared=manifest_hash(directory),
        tokenizer=manifest.tokenizer, num_tokens=num_tokens,
        # Named within the directory: a run directory (which holds the ones rewind made) may move.
        token_files=[msgspec.structs.replace(token_files[s], path=manifest.splits[s].file) for s in sorted(token_files)],
    )
