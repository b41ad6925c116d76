"""The one reader of files a user or a run directory supplies (rewind.stores.fsio): only a regular file
(links followed), at most a stated cap, never waiting on a FIFO nor reading /dev/zero, and JSON whose
nesting or bytes msgspec cannot take refused as malformed; and the stores that read through it
(data fingerprints, prepared directories, the activation cache's zarr.json). Each hostile read runs in
a worker process with a deadline and a memory limit (tests/stores/isolated.py), so a regression fails
the test instead of hanging it."""

from __future__ import annotations

import errno
import os
import sys

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.states.data_identity import SourceFile
from rewind.stores import fsio
from rewind.stores.activations import ActivationCache, CacheError, CacheSpec
from rewind.stores.datafiles import file_identity
from rewind.stores.datamanifest import (
    MAX_MANIFEST_BYTES,
    ManifestError,
    check_prepared,
)
from rewind.stores.preparedwriter import write_prepared
from tests.stores.isolated import Isolated


@pytest.fixture(scope="module")
def worker():
    with Isolated(timeout=60) as isolated:
        yield isolated


def read_bounded(path: str, cap: int) -> bytes:
    return fsio.filesystem(path).read_bounded(cap)


def file_identity_of(path: str, full: bool) -> SourceFile:
    return file_identity(path, full=full)


def check_prepared_fully(directory: str) -> list[str]:
    return check_prepared(directory, full=True)


def open_cache(url: str) -> None:
    ActivationCache.open(url)


HERE = "tests.stores.test_bounded_reads"


def fifo(path) -> str:
    os.mkfifo(path)
    return str(path)


def zero_link(path) -> str:
    os.symlink("/dev/zero", path)
    return str(path)


def sparse(path, size: int) -> str:
    with open(path, "wb") as handle:
        handle.truncate(size)  # nothing written, nothing to read
    return str(path)


# --- the reader ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "code", "words"),
    [
        (fifo, errno.EINVAL, "a FIFO, not a regular file"),
        (zero_link, errno.EINVAL, "a character device, not a regular file"),
        (lambda p: os.mkdir(p) or str(p), errno.EISDIR, "is a directory"),
        (lambda p: sparse(p, 1001), errno.EFBIG, "1,001 bytes, more than the 1,000"),
    ],
    ids=["fifo", "dev-zero", "directory", "oversized"],
)
def test_what_is_not_a_small_regular_file_is_refused_without_reading_it(worker, tmp_path, make, code, words):
    path = make(tmp_path / "file")
    outcome = worker.call(f"{HERE}:read_bounded", path, 1000)
    assert outcome.raised(fsio.RefusedFile) and outcome.raised(OSError), outcome
    assert outcome.message.startswith(f"[Errno {code}] ") and outcome.message.endswith(f": {path!r}")
    assert words in outcome.message and "\n" not in outcome.message


def test_a_regular_file_and_a_link_to_one_are_read_up_to_the_cap(tmp_path):
    (tmp_path / "file").write_bytes(b"x" * 1000)
    os.symlink(tmp_path / "file", tmp_path / "link")
    assert fsio.filesystem(tmp_path / "file").read_bounded(1000) == b"x" * 1000
    assert fsio.filesystem(tmp_path / "link").read_bounded(1000) == b"x" * 1000
    with pytest.raises(FileNotFoundError):
        fsio.filesystem(tmp_path / "absent").read_bounded(1000)


def test_a_file_that_grows_while_it_is_read_is_refused_at_the_cap(tmp_path, monkeypatch):
    path = tmp_path / "file"
    path.write_bytes(b"x" * 10)
    real_open = fsio.open_regular

    def then_grow(where):
        opened = real_open(where)
        with open(where, "ab") as handle:
            handle.write(b"y" * 100)  # after the size was taken
        return opened

    monkeypatch.setattr(fsio, "open_regular", then_grow)
    with pytest.raises(fsio.RefusedFile, match="grew past 50 bytes"):
        fsio.filesystem(path).read_bounded(50)


def test_the_cap_holds_on_other_filesystems_too():
    location = fsio.filesystem("memory://bounded/file")
    location.fs.pipe_file(location.path, b"z" * 2000)
    assert fsio.filesystem("memory://bounded/file").read_bounded(2000) == b"z" * 2000
    with pytest.raises(fsio.RefusedFile, match="2,000 bytes, more than the 1,999"):
        fsio.filesystem("memory://bounded/file").read_bounded(1999)


@settings(max_examples=40, deadline=None)
@given(
    depth=st.integers(1, 300_000),
    opener=st.sampled_from(["[", '{"a":']),
)
def test_json_nested_past_the_recursion_limit_is_malformed_json(depth, opener):
    """Nesting either decodes (it is then plain data) or is a DecodeError, never a RecursionError; past
    the interpreter's recursion limit it is always the error."""
    closer = "]" if opener == "[" else "}"
    text = (opener * depth + ("1" if opener != "[" else "") + closer * depth).encode()
    for kind in (object, dict if opener != "[" else list):
        try:
            fsio.decode_json(text, kind)
        except msgspec.DecodeError as exc:
            assert str(exc) == "JSON is malformed: nested too deeply"
        else:
            assert depth < sys.getrecursionlimit()


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_are_a_decode_error(data):
    try:
        fsio.decode_json(data)
    except msgspec.DecodeError as exc:
        assert "\n" not in str(exc)


@pytest.mark.parametrize(
    "data",
    [b'{"a": "\xff"}', b'{"\xfe": 1}', b"[" + b"9" * 5000 + b"]", b'{"a": 1e999}'],
    ids=["utf8-value", "utf8-key", "5000-digits", "1e999"],
)
def test_not_utf8_and_huge_numbers_are_decode_errors(data):
    with pytest.raises(msgspec.DecodeError):
        fsio.decode_json(data, dict[str, int])


# --- data files ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [fifo, zero_link], ids=["fifo", "dev-zero"])
def test_a_data_file_that_is_not_regular_is_refused_by_its_fingerprint(worker, tmp_path, make):
    path = make(tmp_path / "corpus.bin")
    for full in (False, True):
        outcome = worker.call(f"{HERE}:file_identity_of", path, full)
        assert outcome.raised(fsio.RefusedFile) and "not a regular file" in outcome.message, outcome


def test_the_full_hash_covers_the_size_it_names(tmp_path):
    path = tmp_path / "corpus.bin"
    path.write_bytes(bytes(range(256)) * 40)
    found = file_identity(path, full=True)
    assert found == SourceFile(path=str(path), size=10240, fingerprint=found.fingerprint, sha256=found.sha256)
    import hashlib

    assert found.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


# --- prepared directories -----------------------------------------------------------------------------


def prepared(path) -> str:
    write_prepared(
        path, {"train": np.arange(40, dtype=np.uint16)}, dtype="uint16", num_documents={"train": 1},
        input_kind="text", text_field="text", vocab_size=256, tokenizer_json=None, separator=[10], sources=[],
    )
    return str(path)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (fifo, "a FIFO, not a regular file"),
        (zero_link, "a character device"),
        (lambda p: sparse(p, MAX_MANIFEST_BYTES + 1), "more than the"),
        (lambda p: p.write_bytes(b"[" * 100_000), "nested too deeply"),
        (lambda p: p.write_bytes(b'{"format": "\xff"}'), "not UTF-8"),
        (lambda p: p.write_text('{"format": ' + "9" * 5000 + "}"), "not valid JSON"),
    ],
    ids=["fifo", "dev-zero", "oversized", "deep", "not-utf8", "huge-number"],
)
def test_a_hostile_manifest_is_one_line(worker, tmp_path, make, words):
    directory = prepared(tmp_path / "prep")
    os.unlink(tmp_path / "prep" / "manifest.json")
    make(tmp_path / "prep" / "manifest.json")
    outcome = worker.call("rewind.stores.datamanifest:read_manifest", directory)
    assert outcome.raised(ManifestError), outcome
    assert words in outcome.message and "\n" not in outcome.message
    assert worker.call(f"{HERE}:check_prepared_fully", directory).value == [outcome.message]


@pytest.mark.parametrize("make", [fifo, zero_link], ids=["fifo", "dev-zero"])
def test_a_token_file_that_is_not_regular_is_a_problem_not_a_hang(worker, tmp_path, make):
    directory = prepared(tmp_path / "prep")
    os.unlink(tmp_path / "prep" / "train.bin")
    make(tmp_path / "prep" / "train.bin")
    [problem] = worker.call(f"{HERE}:check_prepared_fully", directory).value
    assert problem.startswith(f"{directory}/train.bin: cannot read: ") and "not a regular file" in problem


# --- the activation cache's zarr.json -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (fifo, "not a regular file"),
        (lambda p: sparse(p, 1 << 20), "more than the"),
        (lambda p: p.write_text("[" * 30_000 + "]" * 30_000), "nested too deeply"),
        (lambda p: p.write_text('{"a": ' * 40 + "1" + "}" * 40), "nests deeper than"),
        (lambda p: p.write_text("[1]"), "is not a JSON object"),
        (lambda p: p.write_bytes(b'{"zarr_format": "\xff"}'), "not UTF-8"),
    ],
    ids=["fifo", "oversized", "deep", "deeper-than-zarr-writes", "not-an-object", "not-utf8"],
)
def test_a_hostile_zarr_json_is_a_cache_error(worker, tmp_path, make, words):
    url = str(tmp_path / "trunk-1.zarr")
    ActivationCache.create(url, CacheSpec(num_rows=4, seq_len=2, width=3, dtype="float32", rows_per_chunk=2))
    os.unlink(tmp_path / "trunk-1.zarr" / "zarr.json")
    make(tmp_path / "trunk-1.zarr" / "zarr.json")
    outcome = worker.call(f"{HERE}:open_cache", url)
    assert outcome.raised(CacheError) and words in outcome.message and "\n" not in outcome.message, outcome
