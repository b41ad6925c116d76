"""`rewind data prepare INPUTS... --out DIR`: tokenise documents once into a prepared directory (a dataset of
kind "tokens" reads it), and `rewind data info DIR`: what a prepared directory holds.

Exit codes: 2 for a command line that cannot work as typed (conflicting options, a vocabulary size out of
range, inputs of mixed kinds without --kind, a file named both as a training and a validation input), 1
for inputs or a directory that are not as expected (no file matches, a malformed line, a tokenizer file
that is not one, a directory that holds other data).

A file named twice (again, or by another name: a symlink, a hard link) is read once, and a line on
stderr says which names were left out.
"""

from __future__ import annotations

import argparse
import sys
import time

from rewind.tools.errors import CommandError, UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="prepare datasets: tokenise documents into token files, inspect them")
    commands = p.add_subparsers(dest="data_command", metavar="SUBCOMMAND", parser_class=type(p))
    commands.required = True

    prep = commands.add_parser(
        "prepare",
        help="tokenise text / jsonl / parquet documents into a prepared directory",
        description="Tokenise documents into DIR (manifest.json, train.bin, validation.bin, tokenizer.json). "
        "Run again on the same inputs and tokenizer, it does nothing.",
    )
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="files or globs (quote globs: 'data/*.jsonl')")
    prep.add_argument("--out", required=True, metavar="DIR", help="the prepared directory to write")
    which = prep.add_mutually_exclusive_group()
    which.add_argument(
        "--tokenizer", metavar="PATH",
        help="a Hugging Face tokenizer.json, or a directory holding one: a prepared directory's tokenizer "
        "(so that corpora share it; UTF-8 bytes when it has none) or a model's (default: UTF-8 bytes)",
    )
    which.add_argument(
        "--train-tokenizer", type=int, metavar="VOCAB_SIZE",
        help="train a byte-level BPE of this many ids on the inputs (deterministic)",
    )
    prep.add_argument("--kind", choices=("text", "jsonl", "parquet"),
                      help="input kind (default: from the extension: .jsonl, .parquet, else text)")
    prep.add_argument("--text-field", default="text", metavar="F", help="jsonl / parquet: the document field")
    # One value per --validation: a list would take the training inputs typed after it as validation ones.
    prep.add_argument("--validation", action="append", default=[], metavar="INPUT",
                      help="a file or glob tokenised into the validation split; repeat it for more "
                      "(--validation a.jsonl --validation b.jsonl); no file may also be a training input")
    prep.add_argument("--overwrite", action="store_true", help="replace DIR when it holds other prepared data")
    prep.add_argument("--no-progress", action="store_true", help="no progress bar")
    prep.set_defaults(run=run_prepare)

    info = commands.add_parser("info", help="print a prepared directory's manifest")
    info.add_argument("directory", metavar="DIR")
    info.add_argument("--json", action="store_true", help="print manifest.json as it is")
    info.set_defaults(run=run_info)


def _kind(args: argparse.Namespace) -> str:
    from rewind.engine.data.documents import kind_of

    if args.kind:
        return args.kind
    kinds = {pattern: kind_of(pattern) for pattern in [*args.inputs, *args.validation]}
    if len(set(kinds.values())) > 1:
        shown = ", ".join(f"{pattern}: {kind}" for pattern, kind in kinds.items())
        raise UsageError(f"data prepare: inputs of different kinds ({shown}): give --kind")
    return next(iter(kinds.values()))


def run_prepare(args: argparse.Namespace) -> int:
    from rewind.engine.data.dataprep import prepare_files, prepare_tokenizer, resolve_inputs, reusable_trained
    from rewind.engine.data.documents import DocumentError
    from rewind.engine.data.tokenizer import TokenizerError, tokenizer_in
    from rewind.stores.datamanifest import ManifestError, manifest_hash

    kind = _kind(args)
    if args.train_tokenizer is not None and not 257 <= args.train_tokenizer <= MAX_TRAINED_VOCAB:
        raise UsageError(f"--train-tokenizer: between 257 and {MAX_TRAINED_VOCAB} ids, got {args.train_tokenizer}")
    started = time.perf_counter()
    trained_here = False
    try:
        train = resolve_inputs(args.inputs, by_file=True)
        validation = resolve_inputs(args.validation, by_file=True) if args.validation else None
        _check_splits(train, validation)
        if args.tokenizer:
            tokenizer = tokenizer_in(args.tokenizer)
        elif args.train_tokenizer is not None:
            vocab = args.train_tokenizer
            tokenizer = reusable_trained(args.out, train, validation, kind=kind, text_field=args.text_field,
                                         vocab_size=vocab)
            if tokenizer is None:
                tokenizer, trained_here = prepare_tokenizer(train, kind, args.text_field, vocab), True
        else:
            tokenizer = None
        trained = time.perf_counter()
        reused: list[bool] = []
        manifest = prepare_files(
            train, validation, args.out, tokenizer, kind=kind, text_field=args.text_field, overwrite=args.overwrite,
            progress=not args.no_progress and sys.stderr.isatty(), reused=reused,
        )
        elapsed = time.perf_counter() - trained
        digest = manifest_hash(args.out)
    except (DocumentError, TokenizerError, ManifestError) as exc:
        raise CommandError(str(exc), exit_code=1) from None
    if reused[0]:
        print(f"already prepared: {args.out}: {_splits_line(manifest)}")
    else:
        num_tokens = sum(split.num_tokens for split in manifest.splits.values())
        print(f"prepared {args.out}: {_splits_line(manifest)}")
        print(f"{elapsed:.2f} s, {num_tokens / max(elapsed, 1e-9):,.0f} tokens/s")
    if trained_here:
        print(f"tokenizer trained in {trained - started:.2f} s")
    print(f"tokenizer: {_tokenizer_line(manifest)}")
    print(f"manifest sha256: {digest}")
    return 0


MAX_TRAINED_VOCAB = 1 << 20


def _check_splits(train, validation) -> None:
    """Refuse a file in both splits (a validation loss on trained text measures nothing), and say which
    names of a file already read were left out."""
    from rewind.engine.data.dataprep import shared_files

    if validation is not None and (shared := shared_files(train, validation)):
        train_name, validation_name = shared[0]
        same = "" if train_name == validation_name else f" (as {train_name})"
        more = f", and {len(shared) - 1} more" if len(shared) > 1 else ""
        raise UsageError(
            f"data prepare: {validation_name} is both a validation input and a training input{same}{more}: "
            "leave it out of the training inputs (or out of --validation)"
        )
    left_out = train.left_out + (validation.left_out if validation is not None else [])
    if left_out:
        shown = ", ".join(
            f"{name} ({'named twice' if name == kept else f'the same file as {kept}'})" for name, kept in left_out[:3]
        )
        more = f", and {len(left_out) - 3} more" if len(left_out) > 3 else ""
        print(f"rewind: data prepare: each file is read once; left out: {shown}{more}", file=sys.stderr)


def _splits_line(manifest) -> str:
    return "; ".join(
        f"{split} {token_file.num_documents:,} documents, {token_file.num_tokens:,} tokens"
        for split, token_file in manifest.splits.items()
    )


def _tokenizer_line(manifest) -> str:
    which = f"sha256 {manifest.tokenizer}" if manifest.tokenizer else "UTF-8 bytes"
    return f"{which}, vocab {manifest.vocab_size}, {manifest.dtype}, separator {manifest.separator}"


def run_info(args: argparse.Namespace) -> int:
    from rewind.stores.datamanifest import (
        ManifestError,
        check_prepared,
        manifest_bytes,
        manifest_hash,
        read_manifest,
    )

    try:
        manifest = read_manifest(args.directory)
        digest = manifest_hash(args.directory)
        if args.json:
            sys.stdout.write(manifest_bytes(args.directory).decode("utf-8"))
            return 0
    except ManifestError as exc:
        raise CommandError(str(exc), exit_code=1) from None
    print(f"{args.directory}: {manifest.input_kind} documents (field {manifest.text_field!r}), {manifest.created_by}")
    print(f"tokenizer: {_tokenizer_line(manifest)}")
    for split, token_file in manifest.splits.items():
        print(f"{split}: {token_file.file}, {token_file.num_documents:,} documents, {token_file.num_tokens:,} tokens, "
              f"{token_file.size:,} bytes, sha256 {token_file.sha256}")
    for label, sources in (("source", manifest.sources), ("validation source", manifest.validation_sources)):
        for source in sources:
            print(f"{label}: {source.path} ({source.size:,} bytes, sha256 {source.sha256 or '-'})")
    print(f"manifest sha256: {digest}")
    problems = check_prepared(args.directory)
    for problem in problems:
        print(f"problem: {problem}")
    return 1 if problems else 0
