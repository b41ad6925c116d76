"""`prepare`: the token files are the tokenizer's own encoding joined by its separator, for every kind;
a directory already prepared from the same inputs is reused, anything else refused; failures leave nothing."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rewind.engine.data.dataprep import prepare, prepare_tokenizer, resolve_inputs
from rewind.engine.data.documents import DocumentError
from rewind.engine.data.tokenizer import Tokenizer, train_bpe
from rewind.stores.datamanifest import ManifestError, check_prepared, read_manifest

DOCUMENTS = [
    "Alice was beginning to get very tired of sitting by her sister on the bank.",
    "def f(x):\n    return x * 2  # doubled\n",
    "",
    "naïve café, 東京, 🦊 — and <|endoftext|> written as text.",
    "So she was considering in her own mind (as well as she could, for the hot day made her feel very sleepy)",
]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_bpe(DOCUMENTS * 3, 300)


def expected(tokenizer, documents) -> list[int]:
    flat: list[int] = []
    for i, document in enumerate(documents):
        flat += (tokenizer.separator() if i else []) + tokenizer.encode(document)
    return flat


def token_file(out, split="train") -> list[int]:
    manifest = read_manifest(out)
    return np.fromfile(out / manifest.splits[split].file, dtype=manifest.dtype).tolist()


def write_jsonl(path, documents, field="text") -> str:
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in documents), encoding="utf-8")
    return str(path)


def test_jsonl_tokens_are_the_tokenizers_own_joined_by_eos(tmp_path, bpe):
    source = write_jsonl(tmp_path / "a.jsonl", DOCUMENTS)
    manifest = prepare([source], tmp_path / "out", bpe, kind="jsonl")
    assert token_file(tmp_path / "out") == expected(bpe, DOCUMENTS)
    assert bpe.eos_id is not None and token_file(tmp_path / "out").count(bpe.eos_id) == len(DOCUMENTS) - 1
    train = manifest.splits["train"]
    assert train.num_documents == len(DOCUMENTS) and train.num_tokens == len(expected(bpe, DOCUMENTS))
    assert manifest.tokenizer == bpe.identity and manifest.separator == [bpe.eos_id]
    assert manifest.dtype == "uint16" and manifest.vocab_size == bpe.vocab_size and manifest.input_kind == "jsonl"
    [recorded] = manifest.sources
    assert recorded.path == source and recorded.sha256 == hashlib.sha256((tmp_path / "a.jsonl").read_bytes()).hexdigest()
    assert (tmp_path / "out" / "tokenizer.json").read_text(encoding="utf-8") == bpe.to_json()
    assert check_prepared(tmp_path / "out", full=True) == []


def test_text_files_in_glob_order_and_a_validation_split(tmp_path, bpe):
    for i, document in enumerate(DOCUMENTS):
        (tmp_path / f"doc{i}.txt").write_text(document, encoding="utf-8")
    held_out = tmp_path / "held_out.md"
    held_out.write_text("Down the rabbit hole.", encoding="utf-8")
    out = tmp_path / "out"
    manifest = prepare(["doc*.txt"], out, bpe, kind="text", validation_inputs=["held_out.md"], base_dir=tmp_path)
    assert token_file(out) == expected(bpe, [d for d in DOCUMENTS if d])  # an empty file holds no document
    assert token_file(out, "validation") == bpe.encode("Down the rabbit hole.")
    assert [s.path for s in manifest.sources] == [str(tmp_path / f"doc{i}.txt") for i in range(5)]
    assert [s.path for s in manifest.validation_sources] == [str(held_out)]
    assert manifest.splits["validation"].num_documents == 1


def test_parquet_with_another_field(tmp_path, bpe):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": DOCUMENTS}), path, row_group_size=2)
    manifest = prepare([str(path)], tmp_path / "out", bpe, kind="parquet", text_field="body")
    assert token_file(tmp_path / "out") == expected(bpe, DOCUMENTS)
    assert manifest.text_field == "body" and manifest.input_kind == "parquet"


def test_bytes_without_a_tokenizer(tmp_path):
    source = write_jsonl(tmp_path / "a.jsonl", ["héllo", "world"])
    manifest = prepare([source], tmp_path / "out", kind="jsonl")
    assert token_file(tmp_path / "out") == list("héllo\nworld".encode())
    assert manifest.tokenizer == "" and manifest.separator == [10] and manifest.vocab_size == 256
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_batches_do_not_change_the_tokens(tmp_path, bpe):
    source = write_jsonl(tmp_path / "a.jsonl", DOCUMENTS * 4)
    prepare([source], tmp_path / "one", bpe, kind="jsonl")
    prepare([source], tmp_path / "tiny", bpe, kind="jsonl", batch_chars=1)
    assert token_file(tmp_path / "tiny") == token_file(tmp_path / "one") == expected(bpe, DOCUMENTS * 4)


def test_a_large_vocabulary_writes_uint32(tmp_path):
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "big": 70_000, "\n": 3}, "unk_token": "[UNK]"},
    }
    tokenizer = Tokenizer(json.dumps(spec))
    source = write_jsonl(tmp_path / "a.jsonl", ["big big", "big other"])
    manifest = prepare([source], tmp_path / "out", tokenizer, kind="jsonl")
    assert manifest.dtype == "uint32" and manifest.vocab_size == 70_001
    assert token_file(tmp_path / "out") == [70_000, 70_000, *tokenizer.separator(), 70_000, 0]


def test_the_same_inputs_are_reused_without_work(tmp_path, bpe):
    source = write_jsonl(tmp_path / "a.jsonl", DOCUMENTS)
    reused: list[bool] = []
    first = prepare([source], tmp_path / "out", bpe, kind="jsonl", reused=reused)
    inode = os.stat(tmp_path / "out" / "train.bin").st_ino
    again = prepare([source], tmp_path / "out", bpe, kind="jsonl", reused=reused)
    assert reused == [False, True] and again == first and os.stat(tmp_path / "out" / "train.bin").st_ino == inode


def test_other_inputs_or_tokenizer_are_refused_unless_overwritten(tmp_path, bpe):
    source = write_jsonl(tmp_path / "a.jsonl", DOCUMENTS)
    first = prepare([source], tmp_path / "out", bpe, kind="jsonl")
    with pytest.raises(ManifestError, match=r"holds other prepared data \(inputs: tokenised by another tokenizer"):
        prepare([source], tmp_path / "out", kind="jsonl")  # bytes, not the BPE
    with pytest.raises(ManifestError, match="text field 'text', not 'body'"):
        prepare([source], tmp_path / "out", bpe, kind="jsonl", text_field="body")
    write_jsonl(tmp_path / "a.jsonl", DOCUMENTS[:2])
    with pytest.raises(ManifestError, match=r"a.jsonl: size \d+ bytes, prepared from \d+; --overwrite replaces it\)"):
        prepare([source], tmp_path / "out", bpe, kind="jsonl")
    assert read_manifest(tmp_path / "out") == first
    replaced = prepare([source], tmp_path / "out", bpe, kind="jsonl", overwrite=True)
    assert token_file(tmp_path / "out") == expected(bpe, DOCUMENTS[:2])
    assert replaced.splits["train"].num_documents == 2
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "out"]


def test_a_directory_that_is_not_prepared_is_never_replaced(tmp_path, bpe):
    source = write_jsonl(tmp_path / "a.jsonl", DOCUMENTS)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "precious.txt").write_text("keep me")
    with pytest.raises(ManifestError, match="is not a prepared directory"):
        prepare([source], tmp_path / "home", bpe, kind="jsonl", overwrite=True)
    assert os.listdir(tmp_path / "home") == ["precious.txt"]
    with pytest.raises(ManifestError, match="is not a directory"):
        prepare([source], tmp_path / "a.jsonl", bpe, kind="jsonl", overwrite=True)


def test_a_damaged_directory_of_the_same_inputs_is_named(tmp_path, bpe):
    source = write_jsonl(tmp_path / "a.jsonl", DOCUMENTS)
    prepare([source], tmp_path / "out", bpe, kind="jsonl")
    with open(tmp_path / "out" / "train.bin", "ab") as handle:
        handle.write(b"\0\0")
    with pytest.raises(ManifestError, match="damaged: --overwrite prepares it again"):
        prepare([source], tmp_path / "out", bpe, kind="jsonl")
    prepare([source], tmp_path / "out", bpe, kind="jsonl", overwrite=True)
    assert check_prepared(tmp_path / "out", full=True) == []


def test_a_bad_document_midway_leaves_no_directory(tmp_path, bpe):
    good = write_jsonl(tmp_path / "a.jsonl", DOCUMENTS * 50)
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": 3}\n', encoding="utf-8")
    with pytest.raises(DocumentError, match=f"{bad}:2: field 'text' is int"):
        prepare([good, str(bad)], tmp_path / "out", bpe, kind="jsonl", batch_chars=100)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "b.jsonl"]


def test_prepare_tokenizer_trains_on_the_documents(tmp_path):
    source = write_jsonl(tmp_path / "a.jsonl", DOCUMENTS * 3)
    trained = prepare_tokenizer(resolve_inputs([source]), "jsonl", "text", 300)
    assert trained.to_json() == train_bpe(DOCUMENTS * 3, 300).to_json()
    with pytest.raises(DocumentError, match="no such file"):
        prepare_tokenizer(resolve_inputs([str(tmp_path / "gone.jsonl")]), "jsonl", "text", 300)


def test_an_input_that_changes_while_read_is_refused(tmp_path, bpe, monkeypatch):
    source = write_jsonl(tmp_path / "a.jsonl", DOCUMENTS)
    real = Tokenizer.encode_batch

    def edit_then_encode(self, texts):
        write_jsonl(tmp_path / "a.jsonl", DOCUMENTS[:1])  # someone rewrites the file mid-way
        return real(self, texts)

    monkeypatch.setattr(Tokenizer, "encode_batch", edit_then_encode)
    with pytest.raises(DocumentError, match=r"a\.jsonl: changed while it was being prepared"):
        prepare([source], tmp_path / "out", bpe, kind="jsonl")
    assert not (tmp_path / "out").exists()
