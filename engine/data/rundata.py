"""A run's data: its tokenizer and data directory, the identity of its datasets on record, and the check
that a resumed, forked or replayed run reads the data it started on.

    RUN/data/tokenizer.json   the run's tokenizer (absent: UTF-8 bytes), written when the run starts
    RUN/data/NAME/            documents of dataset NAME tokenised by it (rewind.engine.data.userdata)

At a start (`start_home`) the tokenizer is read from `[tokenizer] path`, trained on the run's text
(`train_vocab_size`), or adopted from the prepared directories the config names, and copied into the run,
so everything after (resume, sample, export) reads the run's own copy. Every later process builds its
`DataHome` from the run directory and the folded state (`home_of`): the run's tokenizer, and the
validation carving the run started with (its features).

The data is checked against the record when a process opens the run (`check_data`: sizes and
fingerprints), and again before each checkpoint while it trains (`check_unchanged`: each token file it
reads against what it opened), so that a file rewritten under a training run stops it before a
checkpoint vouches for steps that may have read the new tokens.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import msgspec

from rewind.engine.data.datasets import DatasetError
from rewind.engine.data.documents import DocumentError, expand_inputs, iter_documents
from rewind.engine.data.registry import DatasetRegistry
from rewind.engine.data.tokenizer import (
    ByteTokenizer,
    TextTokenizer,
    TokenizerError,
    load_tokenizer,
    read_tokenizer_bytes,
    train_bpe,
)
from rewind.engine.data.tokenizer_clash import tokenizers_differ
from rewind.engine.data.userdata import DataHome, dataset_identity
from rewind.engine.model.ranks import Failure, first_failure
from rewind.states.check_data import TEXT_KINDS
from rewind.states.config import Config
from rewind.states.data_identity import DataIdentity, identity_changes
from rewind.states.state import State
from rewind.stores.datafiles import bytes_identity
from rewind.stores.datamanifest import (
    TOKENIZER_FILE,
    ManifestError,
    check_prepared,
    is_prepared,
    read_manifest,
)
from rewind.stores.fsio import filesystem

DATA_DIR = "data"


class DataChanged(Exception):
    """The data a run reads is not what it recorded (one line per difference in `lines`)."""

    def __init__(self, lines: list[str]):
        self.lines = lines
        super().__init__(lines[0] if len(lines) == 1 else f"{lines[0]} (and {len(lines) - 1} more)")


# What a config's data can raise when it is not what the config says (each one line): the callers turn
# them into their own one-line errors (exit 2), DataChanged into exit 1.
DATA_ERRORS = (DatasetError, DocumentError, ManifestError, TokenizerError)


def data_dir(run_dir: str) -> str | None:
    """Where documents are tokenised for the run: RUN/data on a local filesystem; None (a temporary
    directory per process) for a run on an object store."""
    location = filesystem(run_dir)
    return os.path.join(location.path, DATA_DIR) if location.is_local else None


def tokenizer_path(run_dir: str) -> str:
    return filesystem(run_dir).join(DATA_DIR, TOKENIZER_FILE).url


def _default_split(state: State | None) -> str:
    return "random" if state is None or state.behaviours.data_identity else "tail"


def home_of(run_dir: str, state: State, *, base_dir: str | None = None) -> DataHome:
    """The data home of an existing run, from its directory and folded state."""
    path = tokenizer_path(run_dir)
    tokenizer: TextTokenizer = ByteTokenizer()
    if filesystem(path).exists():
        tokenizer = load_tokenizer(path)
    if tokenizer.identity != state.tokenizer and state.behaviours.data_identity:
        raise DataChanged([f"{path}: the run's tokenizer file changed since the run started "
                           f"({tokenizer.identity[:12] or 'absent'}, recorded {state.tokenizer[:12] or 'none'})"])
    return DataHome(tokenizer=tokenizer, data_dir=data_dir(run_dir), base_dir=base_dir, default_split=_default_split(state))


def read_only_home(run_dir: str, state: State) -> DataHome:
    """`home_of`, for a process that must not write to the run (a fork reading its parent, `rewind eval`):
    documents the run tokenised are read from RUN/data, any other go to a scratch directory."""
    return dataclasses.replace(home_of(run_dir, state), data_dir=None, reuse_dirs=tuple(filter(None, [data_dir(run_dir)])))


def start_home(config: Config, run_dir: str, *, base_dir: str | None = None) -> DataHome:
    """The data home of a run about to start: its tokenizer decided (given, trained, adopted from the
    prepared data or the pretrained weights) and checked against the architecture and the pretrained
    weights. Documents are tokenised into a scratch directory: nothing is written to the run until
    `publish_run_data`, when the start is on its way to its first record (a start that fails leaves the
    directory as it was)."""
    home = DataHome(data_dir=None, base_dir=base_dir, full_identity=True)
    tokenizer = _choose_tokenizer(config, home)
    vocab_size = config.architecture.vocab_size
    # (UTF-8 bytes need no check here: the datasets check the ids they hold, and ASCII tasks fit 128.)
    if tokenizer.identity and tokenizer.vocab_size > vocab_size:
        raise TokenizerError(
            f"the tokenizer has {tokenizer.vocab_size} ids, more than architecture.vocab_size {vocab_size}"
        )
    if config.pretrained.path:
        expected = pretrained_tokenizer(home.resolve(config.pretrained.path))
        if expected is not None and expected[0] != tokenizer.identity:
            raise TokenizerError(
                f"pretrained: {config.pretrained.path} was trained with tokenizer {expected[0][:12] or 'UTF-8 bytes'}, "
                f"the run's is {tokenizer.identity[:12] or 'UTF-8 bytes'} (its token ids would mean other text)"
            )
    home.tokenizer = tokenizer
    return home


def publish_run_data(home: DataHome, config: Config, run_dir: str) -> None:
    """Put a starting run's tokenizer and tokenised documents into RUN/data (where every later process reads
    them), replacing what a start that died before its first record left there."""
    target_dir = data_dir(run_dir)
    if target_dir is None:
        return  # an object-store run tokenises in a scratch directory every time
    target = filesystem(tokenizer_path(run_dir))
    text = home.tokenizer.to_json()
    if text is not None:
        target.parent.makedirs()
        target.write_atomic(text.encode("utf-8"))
    elif target.exists():
        target.fs.rm(target.path)
    for name in used_datasets(config):
        source = config.data[name]
        prepared = home.prepared_dir(name, source)
        if source.kind in TEXT_KINDS and not source.prompt_field and not home.is_reused(prepared):
            destination = os.path.join(target_dir, os.path.basename(prepared))
            shutil.rmtree(destination, ignore_errors=True)
            shutil.copytree(prepared, destination)  # (the scratch copy stays open under the datasets)
    home.data_dir = target_dir


def pretrained_tokenizer(path: str) -> tuple[str, str | None] | None:
    """(sha256, tokenizer.json path or None) of the tokenizer pretrained weights were trained with, when
    they say: a transformers directory's tokenizer.json, or a rewind export's metadata (None: unknown)."""
    candidate = os.path.join(path, TOKENIZER_FILE)
    if os.path.isdir(path):
        if os.path.isfile(candidate):
            return bytes_identity(read_tokenizer_bytes(candidate)), candidate
        return None
    from rewind.engine.model.pretrained import tokenizer_of_export

    identity = tokenizer_of_export(path)
    return (identity, None) if identity is not None else None


def _choose_tokenizer(config: Config, home: DataHome) -> TextTokenizer:
    section = config.tokenizer
    if section.path:
        return load_tokenizer(home.resolve(section.path))
    if section.train_vocab_size:
        names = section.train_on or [n for n, s in config.data.items() if s.kind in TEXT_KINDS and not s.prompt_field]
        documents = []
        for name in names:
            source = config.data[name]
            found = expand_inputs(home.resolve(source.path))
            documents.append(iter_documents(found, source.kind, source.text_field))
        return train_bpe((doc for docs in documents for doc in docs), section.train_vocab_size)
    # No tokenizer named: the one of the prepared directories the config reads, when they agree.
    adopted: dict[str, str] = {}
    prepared: dict[str, str] = {}  # the datasets that come with a tokenizer: name -> directory
    for name, source in config.data.items():
        path = home.resolve(source.path)
        if source.kind == "tokens" and is_prepared(path):
            manifest = read_manifest(path)
            if manifest.tokenizer:
                adopted[manifest.tokenizer] = filesystem(path).join(TOKENIZER_FILE).url
                prepared[name] = path
    weights = None
    if config.pretrained.path:  # the weights' own tokenizer, when they come with it
        found = pretrained_tokenizer(home.resolve(config.pretrained.path))
        if found is not None and found[1] is not None:
            adopted[found[0]] = found[1]
            weights = (found[0], found[1])
    if len(adopted) > 1:
        raise TokenizerError(tokenizers_differ(prepared, weights))
    return load_tokenizer(next(iter(adopted.values()))) if adopted else ByteTokenizer()


def open_registry(config: Config, home: DataHome) -> DatasetRegistry:
    return DatasetRegistry(config, home)


def used_datasets(config: Config) -> list[str]:
    """The `[data.NAME]` datasets the run reads (a stage's mixture or an evaluation), sorted."""
    named = {s.name for stage in config.stages for s in stage.datasets} | set(config.training.evaluations)
    return sorted(named & set(config.data))


def identities(
    config: Config, home: DataHome, recorded: dict[str, DataIdentity] | None = None, old: Config | None = None
) -> dict[str, DataIdentity]:
    """The identity of every dataset of `config` the run reads, as it goes on record: full (content
    hashes), so that `rewind verify --data` has something to compare with. They must have been opened
    (documents are tokenised by then); a declared dataset nothing reads is not on record. A dataset that
    `old` (the config before a fork) declared the same way keeps its `recorded` identity, which the
    caller has just checked: a fork does not hash a corpus again."""
    full = dataclasses.replace(home, full_identity=True)
    kept = replace_config_data(config, old).data if old is not None else {}
    return {
        name: recorded[name] if recorded and name in kept and name in recorded else dataset_identity(name, config.data[name], full)
        for name in used_datasets(config)
    }


def check_data(config: Config, state: State, home: DataHome, *, full: bool = False) -> list[str]:
    """What differs between the data `config` names now and what the run recorded ([] = the same).
    A run started before the data was on record has nothing to compare."""
    if not state.behaviours.data_identity:
        return []
    changes: list[str] = []
    section = config.tokenizer
    if section.path:
        path = home.resolve(section.path)
        try:
            current = bytes_identity(read_tokenizer_bytes(path))
        except FileNotFoundError:
            current = "(missing)"
        except TokenizerError as exc:
            changes.append(f"tokenizer.path: {exc}")  # (not a regular file, or too large: nothing to compare)
            current = state.tokenizer
        if current != state.tokenizer:
            changes.append(f"tokenizer.path: {path} changed since the run started "
                           f"({current[:12]}, recorded {state.tokenizer[:12] or 'bytes'})")
    checking = dataclasses.replace(home, full_identity=full)
    for name, recorded in sorted(state.data.items()):
        if name not in config.data:
            continue  # no longer read (a fork that dropped it)
        source = config.data[name]
        try:
            current = dataset_identity(name, source, checking)
        except DatasetError as exc:
            changes.append(str(exc))
            continue
        except (DocumentError, ManifestError, OSError) as exc:
            changes.append(f"dataset {name!r}: {exc}")
            continue
        changes += identity_changes(name, recorded, current, full=full)
        prepared = _prepared_dir_of(name, source, home)
        if prepared is not None and not full:  # (full: verify_data checks them whole)
            changes += [f"dataset {name!r}: {line}" for line in check_prepared(prepared, full=False)]
    return changes


def check_unchanged(home: DataHome, step: int) -> None:
    """Before the checkpoint of step `step`: every token file the run reads is still the file it opened
    (its size, times and identity, and the blocks its fingerprint samples: rewind.engine.data.tokens), else
    DataChanged with one line naming the dataset, and the checkpoint is not taken. The ranks of a
    sharded run agree (the lowest failing rank's line), so that all stop or none."""
    changes = [f"dataset {name!r}: {problem}" for name, stream in home.streams if (problem := stream.change())]
    failure = None
    if changes:
        more = f" (and {len(changes) - 1} more)" if len(changes) > 1 else ""
        failure = Failure(
            f"{changes[0]}{more}; training stopped without the checkpoint of step {step}: put back the data the "
            "run recorded and run the same command again (it resumes from the last checkpoint)",
            1,
        )
    if (agreed := first_failure(failure)) is not None:
        raise DataChanged([agreed.message])


def _prepared_dir_of(name: str, source, home: DataHome) -> str | None:
    """The prepared directory dataset `name` reads its tokens from (None: it reads files as they are)."""
    if source.prompt_field:
        return None
    directory = home.resolve(source.path) if source.kind == "tokens" else home.prepared_dir(name, source)
    return directory if is_prepared(directory) else None


def replace_config_data(new: Config, old: Config) -> Config:
    """`new` with only the datasets it declares exactly as `old` did: those whose recorded identity must
    still hold (one declared otherwise is a change the new config puts on record)."""
    kept = {name: source for name, source in new.data.items() if old.data.get(name) == source}
    return msgspec.structs.replace(new, data=kept)


def copy_run_data(home: DataHome, config: Config, parent_dir: str, child_dir: str) -> None:
    """A fork's data directory: the parent's tokenizer file and the documents tokenised for `config`
    (in `home`'s directory), so the child resumes on its own copies."""
    target = data_dir(child_dir)
    if target is None:
        return  # an object-store run tokenises in a scratch directory every time
    os.makedirs(target, exist_ok=True)
    source_tokenizer = filesystem(tokenizer_path(parent_dir))
    if source_tokenizer.exists():
        filesystem(tokenizer_path(child_dir)).write_atomic(read_tokenizer_bytes(source_tokenizer.url))
    for name, source in config.data.items():
        prepared = home.prepared_dir(name, source)
        if source.kind in TEXT_KINDS and not source.prompt_field and os.path.isdir(prepared):
            shutil.copytree(prepared, os.path.join(target, os.path.basename(prepared)), dirs_exist_ok=True)


def verify_data(run_dir: str, config: Config, state: State) -> tuple[list[str], list[str]]:
    """(problems, notes) of `rewind verify --data`: every file of every dataset the run recorded re-hashed
    whole against its record, and every prepared directory it reads checked file by file."""
    if not state.behaviours.data_identity:
        return [], ["data: the run started before rewind recorded its data (nothing to compare with)"]
    try:
        home = home_of(run_dir, state)
    except (DataChanged, TokenizerError) as exc:
        return [f"data: {exc}"], []
    problems = [f"data: {line}" for line in check_data(config, state, home, full=True)]
    num_files = 0
    for name, source in sorted(config.data.items()):
        if name not in state.data:
            continue
        num_files += len(state.data[name].sources) + len(state.data[name].validation_sources)
        prepared = _prepared_dir_of(name, source, home)
        if prepared is not None:
            problems += [f"data: dataset {name!r}: {line}" for line in check_prepared(prepared, full=True)]
    if state.pretrained and config.pretrained.path:
        from rewind.engine.model.pretrained import PretrainedError, load_pretrained

        try:
            found = load_pretrained(config.pretrained.path, config).identity
        except PretrainedError as exc:
            found = f"unreadable ({exc})"
        if found != state.pretrained:
            problems.append(f"data: pretrained: {config.pretrained.path}: sha256 {found[:12]}, recorded {state.pretrained[:12]}")
        num_files += 1
    notes = [f"data: {len(state.data)} dataset(s), {num_files} file(s) re-hashed"
             + (", all as recorded" if not problems else "")]
    return problems, notes
