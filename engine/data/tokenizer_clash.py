"""When a run's datasets come with different tokenizers: the one-line error, and the way forward in it.

A run reads every dataset with one tokenizer, so prepared directories whose token ids are different
tokenizers' cannot be read together, and that is what two corpora each prepared with
`rewind data prepare --train-tokenizer` are (each trains its own). Setting `[tokenizer] path` to one of
them only moves the clash to the others; what resolves it is preparing the others again with that one,
so each message ends with the command that does, built from the inputs the directory's manifest names
(`rewind data prepare ... --tokenizer DIR` takes a prepared directory's tokenizer).
"""

from __future__ import annotations

import os
import shlex

from rewind.engine.data.documents import kind_of
from rewind.engine.data.tokenizer import TextTokenizer
from rewind.stores.datamanifest import DataManifest, read_manifest

GUIDE = 'docs/data_prepare.md, "Several corpora, one tokenizer"'
# A command naming more input files than this names them as `rewind data info DIR` lists them.
MAX_FILES_SHOWN = 8


def prepare_again(directory: str, manifest: DataManifest, tokenizer: str | None) -> str:
    """The `rewind data prepare` command that prepares `directory` again from the inputs its manifest
    names (kind, field and validation inputs as they were), with the tokenizer `tokenizer` names (a
    tokenizer.json, or a directory holding one; None: UTF-8 bytes)."""
    train = [source.path for source in manifest.sources]
    validation = [source.path for source in manifest.validation_sources]
    listed = len(train) + len(validation) <= MAX_FILES_SHOWN
    if listed:
        inputs = shlex.join(train + [word for path in validation for word in ("--validation", path)])
    else:
        inputs = "INPUTS..." + (" --validation V ..." if validation else "")
    options = []
    if any(kind_of(path) != manifest.input_kind for path in train + validation):
        options += ["--kind", manifest.input_kind]
    if manifest.text_field != "text":
        options += ["--text-field", manifest.text_field]
    options += ["--out", _absolute(directory)]
    options += ["--tokenizer", _absolute(tokenizer)] if tokenizer is not None else []
    command = f"rewind data prepare {inputs} {shlex.join([*options, '--overwrite'])}"
    if listed:
        return command
    return f"{command} (the {len(train) + len(validation):,} files `rewind data info {_absolute(directory)}` lists)"


def tokenizers_differ(prepared: dict[str, str], weights: tuple[str, str] | None = None) -> str:
    """The error for a run whose prepared datasets (`prepared`: name -> directory, in the config's order)
    come with different tokenizers, or with another than the pretrained weights' (`weights`: its sha256
    and tokenizer.json). The one they are to share is the weights', else the first dataset's."""
    manifests = {name: read_manifest(directory) for name, directory in prepared.items()}
    made = [f"{name!r}: {_shown(manifest.tokenizer)}" for name, manifest in manifests.items()]
    if weights is not None:
        (kept, source), whose, what = weights, "the pretrained weights' tokenizer", "the pretrained weights and "
        made.insert(0, f"the weights': {_shown(kept)}")
    else:
        first = next(iter(prepared))
        kept, source, whose, what = manifests[first].tokenizer, prepared[first], f"the tokenizer of {first!r}", ""
    others = [name for name, manifest in manifests.items() if manifest.tokenizer != kept]
    commands = dict.fromkeys(prepare_again(prepared[name], manifests[name], source) for name in others)
    return (
        f"{what}the prepared datasets come with different tokenizers ({', '.join(made)}), and a run reads every "
        f"dataset with one ({GUIDE}): prepare {_names(others)} again with {whose}: {' && '.join(commands)}"
    )


def tokenised_by_another(name: str, directory: str, manifest: DataManifest, tokenizer: TextTokenizer) -> str:
    """The error for dataset `name`, whose prepared `directory` holds another tokenizer's ids than the
    run's `tokenizer`: the command that prepares it with the run's, when that is a file (or bytes)."""
    said = (
        f"dataset {name!r}: {directory} was tokenised by {_shown(manifest.tokenizer)}, the run's tokenizer is "
        f"{_shown(tokenizer.identity)}"
    )
    source = getattr(tokenizer, "source", None)
    if not tokenizer.identity or (isinstance(source, str) and ("://" in source or os.path.isfile(source))):
        command = prepare_again(directory, manifest, source if tokenizer.identity else None)
        return f"{said}, and a run reads every dataset with one ({GUIDE}): prepare it with the run's: {command}"
    # The run trains its tokenizer when it starts: there is no file to prepare with yet.
    if manifest.tokenizer:
        return (
            f'{said} (trained at the start): set [tokenizer] path = "{_absolute(directory)}/tokenizer.json" in '
            f"place of train_vocab_size (its text datasets are then tokenised with it), or see {GUIDE}"
        )
    return f"{said} (trained at the start), and a run reads every dataset with one: see {GUIDE}"


def _shown(identity: str) -> str:
    return identity[:12] or "UTF-8 bytes"


def _names(names: list[str]) -> str:
    quoted = [repr(name) for name in names]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} and {quoted[-1]}"


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.abspath(os.path.expanduser(path))
