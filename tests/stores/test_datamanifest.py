"""Prepared directories: written whole or not at all, read back with one-line errors, checked cheap or full."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from rewind.states.data_identity import SourceFile
from rewind.stores.datamanifest import (
    FORMAT,
    ManifestError,
    check_prepared,
    dtype_for,
    is_prepared,
    manifest_hash,
    read_manifest,
)
from rewind.stores.preparedwriter import PreparedWriter, write_prepared

SOURCE = SourceFile(path="/data/a.jsonl", size=10, fingerprint="f" * 64, sha256="a" * 64)
TOKENIZER_JSON = '{"pretend": "tokenizer"}'


def fields(**overrides) -> dict:
    base = dict(input_kind="jsonl", text_field="text", vocab_size=300, tokenizer_json=TOKENIZER_JSON,
                separator=[0], sources=[SOURCE])
    return {**base, **overrides}


def prepared(tmp_path, **overrides):
    out = tmp_path / "prepared"
    splits = {"train": [np.arange(10, dtype=np.int64), np.arange(5, dtype=np.int64)],
              "validation": np.array([7, 8, 9], dtype=np.uint16)}
    manifest = write_prepared(out, splits, dtype="uint16", num_documents={"train": 2, "validation": 1},
                              **fields(**overrides))
    return out, manifest


def test_write_then_read_round_trips(tmp_path):
    out, manifest = prepared(tmp_path)
    assert sorted(os.listdir(out)) == ["manifest.json", "tokenizer.json", "train.bin", "validation.bin"]
    assert sorted(os.listdir(tmp_path)) == ["prepared"]  # no temporary sibling left behind
    assert read_manifest(out) == manifest
    assert manifest.format == FORMAT and manifest.dtype == "uint16" and manifest.created_by.startswith("rewind ")
    train = np.fromfile(out / "train.bin", dtype="<u2")
    assert train.tolist() == [*range(10), *range(5)]
    assert manifest.splits["train"].num_tokens == 15 and manifest.splits["train"].size == 30
    assert manifest.splits["train"].sha256 == hashlib.sha256((out / "train.bin").read_bytes()).hexdigest()
    assert manifest.splits["validation"].num_documents == 1
    assert manifest.tokenizer == hashlib.sha256(TOKENIZER_JSON.encode()).hexdigest()
    assert manifest_hash(out) == hashlib.sha256((out / "manifest.json").read_bytes()).hexdigest()
    assert is_prepared(out) and not is_prepared(tmp_path)
    assert check_prepared(out) == [] and check_prepared(out, full=True) == []


def test_bytes_have_no_tokenizer_copy(tmp_path):
    out, manifest = prepared(tmp_path, tokenizer_json=None, vocab_size=256, separator=[10])
    assert manifest.tokenizer == "" and not (out / "tokenizer.json").exists()
    assert check_prepared(out) == []
    (out / "tokenizer.json").write_text("{}")
    assert "the manifest says the tokens are UTF-8 bytes" in check_prepared(out)[0]


def test_the_same_manifest_is_the_same_bytes(tmp_path):
    a, _ = prepared(tmp_path / "a")
    b, _ = prepared(tmp_path / "b")
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()


def test_check_finds_damage_cheap_or_full(tmp_path):
    out, _ = prepared(tmp_path)
    data = bytearray((out / "train.bin").read_bytes())
    data[0] ^= 1  # same size, other contents: only the full check sees it
    (out / "train.bin").write_bytes(bytes(data))
    assert check_prepared(out) == []
    assert "train.bin: contents changed" in check_prepared(out, full=True)[0]
    (out / "train.bin").write_bytes(bytes(data[:-2]))
    assert check_prepared(out) == [f"{out}/train.bin: 28 bytes, the manifest says 30"]
    (out / "validation.bin").unlink()
    (out / "tokenizer.json").write_text("{}")
    problems = check_prepared(out)
    assert f"{out}/validation.bin: missing" in problems
    assert any("tokenizer.json: sha256" in p for p in problems)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda m: m.update(format=FORMAT + 1), f"prepared by a newer rewind (format {FORMAT + 1}"),
        (lambda m: m.pop("splits"), "manifest.json is malformed"),
        (lambda m: m["splits"]["train"].update(file="../../etc/passwd"), "split 'train' names file '../../etc/passwd'"),
        (lambda m: m["splits"].pop("train"), "has no train split"),
        (lambda m: m.update(vocab_size=70_000), "vocab_size 70000 does not fit uint16"),
        (lambda m: m.update(dtype="int8"), "manifest.json is malformed"),
    ],
)
def test_a_bad_manifest_is_one_line(tmp_path, edit, needle):
    out, _ = prepared(tmp_path)
    raw = json.loads((out / "manifest.json").read_text())
    edit(raw)
    (out / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ManifestError) as info:
        read_manifest(out)
    assert needle in str(info.value) and str(out) in str(info.value) and "\n" not in str(info.value)
    assert check_prepared(out) == [str(info.value)]


def test_missing_or_garbled_manifest(tmp_path):
    with pytest.raises(ManifestError, match="not a prepared data directory"):
        read_manifest(tmp_path / "nowhere")
    (tmp_path / "manifest.json").write_text("{oops")
    with pytest.raises(ManifestError, match="is not valid JSON"):
        read_manifest(tmp_path)
    with pytest.raises(ManifestError, match="not a prepared data directory"):
        manifest_hash(tmp_path / "nowhere")


def test_a_failure_midway_leaves_nothing(tmp_path):
    out = tmp_path / "prepared"
    with pytest.raises(RuntimeError, match="tokeniser died"), PreparedWriter(out, dtype="uint16") as writer:
        writer.append("train", np.arange(100))
        raise RuntimeError("tokeniser died")
    assert os.listdir(tmp_path) == []


def test_a_failure_before_the_rename_leaves_nothing(tmp_path, monkeypatch):
    out = tmp_path / "prepared"

    def refuse(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("rewind.stores.preparedwriter.os.rename", refuse)
    with pytest.raises(OSError, match="No space"):
        prepared(tmp_path)
    assert os.listdir(tmp_path) == [] and not out.exists()


def test_ids_that_do_not_fit_are_refused_not_wrapped(tmp_path):
    with pytest.raises(ManifestError, match="token id 65536 does not fit uint16"), \
            PreparedWriter(tmp_path / "p", dtype="uint16") as writer:
        writer.append("train", np.array([1, 65536]))
    with pytest.raises(ManifestError, match="token id -1 does not fit"), \
            PreparedWriter(tmp_path / "p", dtype="uint32") as writer:
        writer.append("train", np.array([-1]))
    assert os.listdir(tmp_path) == []


def test_an_existing_directory_is_replaced_only_when_asked(tmp_path):
    out, first = prepared(tmp_path)
    with pytest.raises(ManifestError, match="exists and is not empty"):
        prepared(tmp_path, text_field="body")
    assert read_manifest(out) == first
    write_prepared(out, {"train": np.array([1, 2])}, dtype="uint32", num_documents={"train": 1},
                   overwrite=True, **fields(text_field="body"))
    assert read_manifest(out).text_field == "body" and read_manifest(out).dtype == "uint32"
    assert sorted(os.listdir(out)) == ["manifest.json", "tokenizer.json", "train.bin"]
    assert sorted(os.listdir(tmp_path)) == ["prepared"]
    empty = tmp_path / "empty"
    empty.mkdir()
    write_prepared(empty, {"train": np.array([1])}, dtype="uint16", num_documents={"train": 1}, **fields())
    assert check_prepared(empty) == []


def test_dtype_by_vocabulary():
    assert [dtype_for(n) for n in (256, 65_536, 65_537, 1 << 32)] == ["uint16", "uint16", "uint32", "uint32"]
    with pytest.raises(ManifestError, match="does not fit in uint32"):
        dtype_for((1 << 32) + 1)


def test_only_local_directories_are_written():
    with pytest.raises(ManifestError, match="written on a local filesystem"):
        PreparedWriter("memory://somewhere/prepared", dtype="uint16")


def test_a_failed_replacement_keeps_the_old_directory(tmp_path, monkeypatch):
    out, first = prepared(tmp_path)
    real_rename = os.rename

    def fail_into_place(source, target):
        if ".tmp-" in os.fspath(source):
            raise OSError(5, "Input/output error")
        real_rename(source, target)

    monkeypatch.setattr("rewind.stores.preparedwriter.os.rename", fail_into_place)
    with pytest.raises(OSError, match="Input/output"):
        prepared(tmp_path, text_field="body", overwrite=True)
    assert read_manifest(out) == first and check_prepared(out, full=True) == []
    assert sorted(os.listdir(tmp_path)) == ["prepared"]
