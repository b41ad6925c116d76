"""Documents out of files: which files an input names, the three kinds, and one-line errors naming the place."""

from __future__ import annotations

import os

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rewind.engine.data.documents import DocumentError, expand_inputs, iter_documents, iter_pairs, kind_of


def one_line_error(fn, *needles: str) -> str:
    with pytest.raises(DocumentError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def write(path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


# --- which files ---------------------------------------------------------------------------------


def test_a_glob_expands_sorted_and_relative_to_base_dir(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "c.txt"):
        write(tmp_path / name, "x")
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "d.jsonl", "x")
    assert expand_inputs("*.jsonl", tmp_path) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    assert expand_inputs(str(tmp_path / "**" / "*.jsonl")) == [
        str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), str(tmp_path / "sub" / "d.jsonl")
    ]
    assert expand_inputs("c.txt", tmp_path) == [str(tmp_path / "c.txt")]


def test_what_names_no_file_is_refused(tmp_path):
    one_line_error(lambda: expand_inputs("*.parquet", tmp_path), "*.parquet: no file matches")
    one_line_error(lambda: expand_inputs("missing.txt", tmp_path), "missing.txt: no such file")
    one_line_error(lambda: expand_inputs(str(tmp_path)), "is a directory", "/*.jsonl")


def test_fsspec_urls_expand_through_their_filesystem():
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/docs-test/b.jsonl", b'{"text": "two"}\n')
    fs.pipe_file("/docs-test/a.jsonl", b'{"text": "one"}\n')
    try:
        paths = expand_inputs("memory://docs-test/*.jsonl")
        assert all(p.startswith("memory://") for p in paths)  # URLs still, not the filesystem's own paths
        assert [p.rsplit("/", 1)[-1] for p in paths] == ["a.jsonl", "b.jsonl"]
        assert list(iter_documents(paths, "jsonl")) == ["one", "two"]
    finally:
        fs.rm("/docs-test", recursive=True)


def test_kind_from_the_name():
    assert [kind_of(n) for n in ("a.jsonl", "x/*.JSONL", "a.parquet", "a.txt", "a.py", "data/*")] == [
        "jsonl", "jsonl", "parquet", "text", "text", "text"
    ]


# --- text ---------------------------------------------------------------------------------------


def test_text_is_one_document_per_file(tmp_path):
    paths = [write(tmp_path / "a.txt", "first\nfile\n"), write(tmp_path / "b.txt", "sécond")]
    assert list(iter_documents(paths, "text")) == ["first\nfile\n", "sécond"]


def test_text_must_be_utf8(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    one_line_error(lambda: list(iter_documents([str(bad)], "text")), f"{bad}: not UTF-8 text", "byte 3")


# --- jsonl --------------------------------------------------------------------------------------


def test_jsonl_reads_the_field_and_skips_blank_lines(tmp_path):
    path = write(tmp_path / "a.jsonl", '{"text": "one", "id": 1}\n\n   \n{"body": "x", "text": "two\\nlines"}\n')
    assert list(iter_documents([path], "jsonl")) == ["one", "two\nlines"]
    assert list(iter_documents([path, path], "jsonl", "text")) == ["one", "two\nlines"] * 2


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("{not json", "not valid JSON"),
        ('{"body": "x"}', "no 'text' field"),
        ('{"text": 7}', "field 'text' is int, not a string"),
        ('{"text": null}', "field 'text' is NoneType, not a string"),
        ('["text"]', "a JSON list, not an object"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, line, needle):
    path = write(tmp_path / "a.jsonl", '{"text": "fine"}\n\n' + line + "\n")
    one_line_error(lambda: list(iter_documents([path], "jsonl")), f"{path}:3: ", needle)


def test_no_documents_at_all_is_an_error(tmp_path):
    empty = write(tmp_path / "empty.jsonl", "\n\n")
    one_line_error(lambda: list(iter_documents([empty], "jsonl")), f"{empty}: no documents")
    one_line_error(lambda: list(iter_documents([empty, empty], "jsonl")), "2 files: no documents")
    blank = write(tmp_path / "blank.txt", "")
    one_line_error(lambda: list(iter_documents([blank], "text")), f"{blank}: no documents")
    full = write(tmp_path / "full.txt", "some text")
    assert list(iter_documents([blank, full, blank], "text")) == ["some text"]  # an empty file is no document


def test_pairs_from_jsonl(tmp_path):
    path = write(tmp_path / "p.jsonl", '{"q": "2+2?", "a": "4"}\n{"q": "hi", "a": "hello"}\n')
    assert list(iter_pairs([path], "jsonl", "q", "a")) == [("2+2?", "4"), ("hi", "hello")]
    bad = write(tmp_path / "bad.jsonl", '{"q": "x"}\n')
    one_line_error(lambda: list(iter_pairs([bad], "jsonl", "q", "a")), f"{bad}:1: no 'a' field")
    one_line_error(lambda: list(iter_pairs([path], "text", "q", "a")), "need jsonl or parquet")


# --- parquet ------------------------------------------------------------------------------------


def test_parquet_reads_the_column_across_row_groups(tmp_path):
    path = str(tmp_path / "a.parquet")
    texts = [f"document {i} ü" for i in range(10)]
    pq.write_table(pa.table({"text": texts, "n": list(range(10))}), path, row_group_size=3)
    assert list(iter_documents([path], "parquet")) == texts
    pq.write_table(pa.table({"p": ["a", "b"], "r": ["c", "d"]}), path)
    assert list(iter_pairs([path], "parquet", "p", "r")) == [("a", "c"), ("b", "d")]


def test_parquet_large_strings_are_strings(tmp_path):
    path = str(tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": pa.array(["x", "y"], type=pa.large_string())}), path)
    assert list(iter_documents([path], "parquet")) == ["x", "y"]


def test_parquet_errors(tmp_path):
    path = str(tmp_path / "a.parquet")
    pq.write_table(pa.table({"body": ["x"], "n": [1]}), path)
    one_line_error(lambda: list(iter_documents([path], "parquet")), f"{path}: no column 'text'", "body, n")
    one_line_error(lambda: list(iter_documents([path], "parquet", "n")), "column 'n' holds int64, not strings")
    pq.write_table(pa.table({"text": ["a", None, "c"]}), path)
    one_line_error(lambda: list(iter_documents([path], "parquet")), f"{path}: row 1: column 'text' is null")
    not_parquet = write(tmp_path / "b.parquet", "just text")
    one_line_error(lambda: list(iter_documents([not_parquet], "parquet")), "not a parquet file")
    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), path)
    one_line_error(lambda: list(iter_documents([path], "parquet")), "no documents")


def test_unreadable_files_are_one_line(tmp_path):
    missing = str(tmp_path / "gone.jsonl")
    one_line_error(lambda: list(iter_documents([missing], "jsonl")), f"{missing}: no such file")
    one_line_error(lambda: list(iter_documents([str(tmp_path)], "text")), "is a directory")
    one_line_error(lambda: list(iter_documents([missing], "csv")), "unknown input kind 'csv'")
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.txt"
        locked.write_text("x")
        locked.chmod(0)
        one_line_error(lambda: list(iter_documents([str(locked)], "text")), "cannot read")


def test_gzipped_inputs_are_read_decompressed(tmp_path):
    import gzip

    path = tmp_path / "a.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"text": "zipped"}\n'))
    assert kind_of(str(path)) == "jsonl"
    assert list(iter_documents([str(path)], "jsonl")) == ["zipped"]
