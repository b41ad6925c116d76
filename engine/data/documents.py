"""Documents out of a user's files: which files a path or glob names, and the texts (or prompt/response
pairs, or rows of named fields, each with the place an error about it names) they hold.

Kinds:
- text: one document per file, the whole file, strict UTF-8;
- jsonl: one JSON object per non-blank line, the document under `text_field`;
- parquet: the `text_field` column (strings), read in record batches with pyarrow.

Paths are local or fsspec URLs (`s3://bucket/corpus/*.jsonl`). Every error a user can cause is a
`DocumentError` of one line naming the file (and for jsonl the line, for parquet the row).

Input files are untrusted: a local one is read only if it is a regular file (a FIFO would block the
read, /dev/zero never ends), and no document is read past MAX_DOCUMENT_BYTES (a text file, a jsonl
line, after any decompression), so a file without line ends or a compressed bomb cannot take all the
memory before it is refused; a jsonl line that is not UTF-8 or nests too deeply is refused like any
malformed one.
"""

from __future__ import annotations

import contextlib
import lzma
import os
import zlib
from collections.abc import Iterable, Iterator
from typing import IO

import msgspec
from fsspec.compression import compr
from fsspec.utils import infer_compression

from rewind.stores.fsio import FilesystemUnavailable, Location, filesystem, open_regular

KINDS = ("text", "jsonl", "parquet")
_GLOB_CHARS = frozenset("*?[")
_PARQUET_BATCH_ROWS = 4096
# The longest document (a text file, a jsonl line) read, in bytes: far past any real one, and what the
# tokenizer's guard (rewind.engine.data.tokenizer_guard) lets one encode produce.
MAX_DOCUMENT_BYTES = 1 << 28


class DocumentError(Exception):
    """Input documents cannot be found or read as asked (one line, naming the file and place)."""


def kind_of(path: str) -> str:
    """The kind a file's name implies: .jsonl / .parquet, anything else text."""
    name = path.rstrip("/").rsplit("/", 1)[-1].lower()
    if name.endswith((".jsonl", ".jsonl.gz", ".ndjson")):
        return "jsonl"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    return "text"


def _locate(path: str) -> Location:
    try:
        return filesystem(path)
    except FilesystemUnavailable as exc:
        raise DocumentError(str(exc)) from None


def expand_inputs(pattern_or_path: str, base_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """The files `pattern_or_path` names: itself when it is a file, the sorted matches of a glob
    (`*`, `?`, `[...]`, `**` for any depth). Relative paths are taken against `base_dir` (default:
    the working directory). A directory is an error (a glob says which of its files), and so is a
    glob that matches no file."""
    given = pattern_or_path
    if "://" not in given and "::" not in given:
        given = os.path.expanduser(given)
        if base_dir is not None and not os.path.isabs(given):
            given = os.path.join(os.fspath(base_dir), given)
    location = _locate(given)
    fs = location.fs
    show = location.url if "://" in given else given
    try:
        if _GLOB_CHARS.intersection(pattern_or_path):
            matches = sorted(p for p in fs.glob(location.path) if fs.isfile(p))
            if not matches:
                raise DocumentError(f"{pattern_or_path}: no file matches")
            if location.is_local:
                return matches
            return [fs.unstrip_protocol(p) for p in matches]
        if fs.isdir(location.path):
            raise DocumentError(f"{show}: is a directory (name its files, or a glob such as {show.rstrip('/')}/*.jsonl)")
        if not fs.exists(location.path):
            raise DocumentError(f"{show}: no such file")
    except OSError as exc:
        raise DocumentError(f"{show}: cannot read: {exc.strerror or exc}") from None
    return [location.path if location.is_local else location.url]


@contextlib.contextmanager
def _open(path: str) -> Iterator[IO[bytes]]:
    """The file's bytes, decompressed when its name says so (.gz, .zst, ...)."""
    location = _locate(path)
    try:
        if location.is_local:
            raw: IO[bytes] = os.fdopen(open_regular(location.path)[0], "rb")
        else:
            raw = location.fs.open(location.path, "rb")
    except FileNotFoundError:
        raise DocumentError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DocumentError(f"{path}: is a directory") from None
    except OSError as exc:
        raise DocumentError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        with raw:
            compression = infer_compression(location.path)
            if compression is None:
                yield raw
            else:
                with compr[compression](raw, mode="rb") as handle:
                    yield handle
    except (OSError, EOFError, zlib.error, lzma.LZMAError) as exc:  # a damaged compressed stream, a read error
        raise DocumentError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None


def _read_text(path: str) -> str:
    with _open(path) as handle:
        data = handle.read(MAX_DOCUMENT_BYTES + 1)
    if len(data) > MAX_DOCUMENT_BYTES:
        raise DocumentError(f"{path}: a document longer than {MAX_DOCUMENT_BYTES:,} bytes (split it into files)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DocumentError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None


def _jsonl_records(path: str, fields: tuple[str, ...]) -> Iterator[tuple[str, tuple[str, ...]]]:
    decoder = msgspec.json.Decoder()
    with _open(path) as handle:
        line_number = 0
        while line := handle.readline(MAX_DOCUMENT_BYTES + 1):
            line_number += 1
            if len(line) > MAX_DOCUMENT_BYTES:
                raise DocumentError(f"{path}:{line_number}: a line longer than {MAX_DOCUMENT_BYTES:,} bytes")
            if not line.strip():
                continue  # blank lines (a trailing newline, spacing) hold no document
            try:
                record = decoder.decode(line)
            except UnicodeDecodeError as exc:
                raise DocumentError(f"{path}:{line_number}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
            except RecursionError:
                raise DocumentError(f"{path}:{line_number}: not valid JSON: nested too deeply") from None
            except msgspec.DecodeError as exc:
                raise DocumentError(f"{path}:{line_number}: not valid JSON: {exc}") from None
            if not isinstance(record, dict):
                raise DocumentError(f"{path}:{line_number}: a JSON {type(record).__name__}, not an object")
            values = []
            for field in fields:
                if field not in record:
                    raise DocumentError(f"{path}:{line_number}: no {field!r} field")
                value = record[field]
                if not isinstance(value, str):
                    raise DocumentError(
                        f"{path}:{line_number}: field {field!r} is {type(value).__name__}, not a string"
                    )
                values.append(value)
            yield f"{path}:{line_number}", tuple(values)


def _parquet_records(path: str, fields: tuple[str, ...]) -> Iterator[tuple[str, tuple[str, ...]]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DocumentError(f"{path}: reading parquet needs pyarrow (pip install 'rewind[parquet]')") from None
    with _open(path) as handle:
        try:
            parquet = pq.ParquetFile(handle)
        except (pa.ArrowException, OSError) as exc:
            raise DocumentError(f"{path}: not a parquet file ({str(exc).splitlines()[0]})") from None
        schema = parquet.schema_arrow
        for field in fields:
            if field not in schema.names:
                raise DocumentError(f"{path}: no column {field!r} (columns: {', '.join(schema.names)})")
            column_type = schema.field(field).type
            is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
            if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type) or is_view(column_type)):
                raise DocumentError(f"{path}: column {field!r} holds {column_type}, not strings")
        row = 0
        try:
            batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS, columns=list(fields))
            for batch in batches:
                columns = [batch.column(field) for field in fields]
                for field, column in zip(fields, columns, strict=True):
                    if column.null_count:
                        first = row + column.is_null().to_pylist().index(True)
                        raise DocumentError(f"{path}: row {first}: column {field!r} is null")
                for offset, values in enumerate(zip(*(column.to_pylist() for column in columns), strict=True)):
                    yield f"{path}: row {row + offset}", values
                row += batch.num_rows
        except pa.ArrowException as exc:
            raise DocumentError(f"{path}: cannot read row {row} on: {str(exc).splitlines()[0]}") from None


def _records(paths: Iterable[str], kind: str, fields: tuple[str, ...]) -> Iterator[tuple[str, tuple[str, ...]]]:
    if kind not in KINDS:
        raise DocumentError(f"unknown input kind {kind!r} (expected one of {', '.join(KINDS)})")
    paths = list(paths)
    num_records = 0
    for path in paths:
        if kind == "text":  # one document per file; an empty file holds none (nothing to join)
            text = _read_text(path)
            records: Iterator[tuple[str, tuple[str, ...]]] = iter([(path, (text,))] if text else [])
        elif kind == "jsonl":
            records = _jsonl_records(path, fields)
        else:
            records = _parquet_records(path, fields)
        for record in records:
            num_records += 1
            yield record
    if num_records == 0:
        where = paths[0] if len(paths) == 1 else f"{len(paths)} files"
        raise DocumentError(f"{where}: no documents" if paths else "no input files")


def iter_documents(paths: Iterable[str], kind: str, text_field: str = "text") -> Iterator[str]:
    """The documents of `paths`, in order (see the module doc for each kind). An input that holds no
    document at all is an error."""
    for _, (text,) in _records(paths, kind, (text_field,)):
        yield text


def iter_pairs(
    paths: Iterable[str], kind: str, prompt_field: str, response_field: str
) -> Iterator[tuple[str, str]]:
    """(prompt, response) of every row of `paths` (jsonl or parquet), in order."""
    if kind == "text":
        raise DocumentError("prompt/response pairs need jsonl or parquet input, not text files")
    for _, pair in _records(paths, kind, (prompt_field, response_field)):
        yield pair  # type: ignore[misc]


def iter_rows(paths: Iterable[str], kind: str, fields: tuple[str, ...]) -> Iterator[tuple[str, tuple[str, ...]]]:
    """(place, values of `fields`) of every row of `paths` (jsonl or parquet), in order; `place` is where an
    error about the row points: 'path:line' (jsonl, from 1) or 'path: row N' (parquet, from 0)."""
    if kind == "text":
        raise DocumentError(f"rows of {', '.join(fields)} need jsonl or parquet input, not text files")
    yield from _records(paths, kind, fields)
