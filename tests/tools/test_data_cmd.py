"""`rewind data prepare` / `rewind data info` as a user types them: summaries, reuse, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from rewind.engine.data.tokenizer import train_bpe
from rewind.stores.datamanifest import manifest_hash, read_manifest

DOCUMENTS = ["The cat sat on the mat.", "The dog sat on the log.", "A bird sang on the wire."] * 4


def rewind(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rewind.tools.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def one_line(err: str, prefix: str = "rewind: ") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS))
    (tmp_path / "valid.jsonl").write_text(json.dumps({"text": "The cat sang."}) + "\n")
    return tmp_path


def test_prepare_then_again_is_reused(corpus):
    args = ["data", "prepare", "train.jsonl", "--out", "prepared", "--train-tokenizer", "300",
            "--validation", "valid.jsonl", "--no-progress"]
    first = rewind(corpus, *args)
    assert first.returncode == 0 and first.stderr == "", first.stderr
    digest = manifest_hash(corpus / "prepared")
    manifest = read_manifest(corpus / "prepared")
    assert first.stdout.startswith(f"prepared prepared: train {len(DOCUMENTS)} documents, "
                                   f"{manifest.splits['train'].num_tokens:,} tokens; validation 1 documents")
    assert "tokens/s" in first.stdout and f"manifest sha256: {digest}" in first.stdout
    assert manifest.tokenizer and (corpus / "prepared" / "tokenizer.json").exists()
    assert manifest.tokenizer == train_bpe(DOCUMENTS, 300).identity  # the trained one, deterministically

    again = rewind(corpus, *args)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("already prepared: prepared: ") and f"manifest sha256: {digest}" in again.stdout
    assert manifest_hash(corpus / "prepared") == digest


def test_bad_input_is_one_line_and_exit_1(corpus):
    (corpus / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "typo"}\n')
    result = rewind(corpus, "data", "prepare", "bad.jsonl", "--out", "prepared")
    assert result.returncode == 1 and result.stdout == ""
    assert one_line(result.stderr).endswith("bad.jsonl:2: no 'text' field")
    assert sorted(p.name for p in corpus.iterdir()) == ["bad.jsonl", "train.jsonl", "valid.jsonl"]


def test_conflicting_options_are_exit_2(corpus):
    result = rewind(corpus, "data", "prepare", "train.jsonl", "--out", "p", "--tokenizer", "t.json",
                    "--train-tokenizer", "300")
    assert result.returncode == 2 and "not allowed with argument" in one_line(result.stderr, "rewind data prepare: ")


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["nothing*.jsonl"], 1, "nothing*.jsonl: no file matches"),
        (["train.jsonl", "--tokenizer", "missing.json"], 1, "missing.json: no such file"),
        (["train.jsonl", "--train-tokenizer", "100"], 2, "--train-tokenizer: between 257 and"),
        (["train.jsonl", "notes.txt"], 2, "inputs of different kinds (train.jsonl: jsonl, notes.txt: text): give --kind"),
        (["train.jsonl", "--text-field", "body"], 1, "train.jsonl:1: no 'body' field"),
        (["train.jsonl", "--kind", "parquet"], 1, "not a parquet file"),
    ],
)
def test_refusals(rewind_cli, corpus, monkeypatch, args, code, needle):
    monkeypatch.chdir(corpus)
    exit_code, out, err = rewind_cli("data", "prepare", *args, "--out", "prepared", "--no-progress")
    assert exit_code == code and out == ""
    assert needle in one_line(err)
    assert not (corpus / "prepared").exists()


def test_a_tokenizer_file_other_data_and_overwrite(rewind_cli, corpus, monkeypatch):
    monkeypatch.chdir(corpus)
    tokenizer = train_bpe(DOCUMENTS, 280)
    (corpus / "tok.json").write_text(tokenizer.to_json(), encoding="utf-8")
    exit_code, out, err = rewind_cli("data", "prepare", "train.jsonl", "--out", "prepared", "--tokenizer", "tok.json")
    assert exit_code == 0, err
    manifest = read_manifest(corpus / "prepared")
    assert manifest.tokenizer == tokenizer.identity and f"tokenizer: sha256 {tokenizer.identity}" in out
    tokens = np.fromfile(corpus / "prepared" / "train.bin", dtype=np.uint16).tolist()
    assert tokens[: len(tokenizer.encode(DOCUMENTS[0])) + 1] == [*tokenizer.encode(DOCUMENTS[0]), tokenizer.eos_id]

    exit_code, out, err = rewind_cli("data", "prepare", "train.jsonl", "--out", "prepared")  # bytes now
    assert exit_code == 1 and "holds other prepared data (inputs: tokenised by another tokenizer" in one_line(err)
    exit_code, out, err = rewind_cli("data", "prepare", "train.jsonl", "--out", "prepared", "--overwrite")
    assert exit_code == 0, err
    assert read_manifest(corpus / "prepared").tokenizer == "" and "UTF-8 bytes" in out


def test_info(rewind_cli, corpus):
    prepared = corpus / "prepared"
    assert rewind_cli("data", "prepare", str(corpus / "train.jsonl"), "--out", prepared)[0] == 0
    exit_code, out, err = rewind_cli("data", "info", prepared)
    assert exit_code == 0, err
    assert f"train: train.bin, {len(DOCUMENTS)} documents" in out
    assert f"source: {corpus / 'train.jsonl'}" in out and f"manifest sha256: {manifest_hash(prepared)}" in out
    exit_code, out, err = rewind_cli("data", "info", prepared, "--json")
    assert exit_code == 0 and out == (prepared / "manifest.json").read_text()

    (prepared / "validation.bin").write_bytes(b"")  # (not in the manifest: ignored)
    (prepared / "train.bin").write_bytes(b"\0\0")
    exit_code, out, err = rewind_cli("data", "info", prepared)
    assert exit_code == 1 and "problem: " in out and "the manifest says" in out

    exit_code, out, err = rewind_cli("data", "info", corpus)
    assert exit_code == 1 and "not a prepared data directory" in one_line(err)


# --- issue 22: what prepare no longer does silently ------------------------------------------------------


@pytest.mark.parametrize("validation", ["train.jsonl", "t*.jsonl", "link.jsonl"])
def test_a_file_in_both_splits_is_refused(rewind_cli, corpus, monkeypatch, validation):
    monkeypatch.chdir(corpus)
    (corpus / "link.jsonl").symlink_to("train.jsonl")
    exit_code, out, err = rewind_cli("data", "prepare", "train.jsonl", "--validation", "valid.jsonl",
                                     "--validation", validation, "--out", "prepared", "--no-progress")
    assert exit_code == 2 and out == ""
    line = one_line(err)
    assert "is both a validation input and a training input" in line and "train.jsonl" in line
    assert not (corpus / "prepared").exists()


def test_other_names_of_a_file_are_read_once_and_said(rewind_cli, corpus, monkeypatch):
    monkeypatch.chdir(corpus)
    (corpus / "again.jsonl").symlink_to("train.jsonl")
    exit_code, out, err = rewind_cli("data", "prepare", "*.jsonl", "train.jsonl", "--validation", "valid.jsonl",
                                     "--out", "prepared", "--kind", "jsonl", "--no-progress")
    # (*.jsonl also matches valid.jsonl: refused, as above; name the training files instead)
    assert exit_code == 2 and "valid.jsonl is both" in one_line(err)
    exit_code, out, err = rewind_cli("data", "prepare", "again.jsonl", "train.jsonl", "again.jsonl",
                                     "--out", "prepared", "--no-progress")
    assert exit_code == 0 and out.startswith(f"prepared prepared: train {len(DOCUMENTS)} documents"), err
    assert one_line(err) == (
        f"rewind: data prepare: each file is read once; left out: {corpus / 'train.jsonl'} (the same file as "
        f"{corpus / 'again.jsonl'}), {corpus / 'again.jsonl'} (named twice)"
    )
    manifest = read_manifest(corpus / "prepared")
    assert [s.path for s in manifest.sources] == [str(corpus / "again.jsonl")]
    assert manifest.splits["train"].num_documents == len(DOCUMENTS)


def test_a_rerun_decides_reuse_before_training_a_tokenizer(rewind_cli, corpus, monkeypatch):
    import rewind.engine.data.dataprep as dataprep

    monkeypatch.chdir(corpus)
    # 270 ids: the corpus fills them (a vocabulary it cannot fill is trained again, and ends the same).
    args = ["data", "prepare", "train.jsonl", "--out", "prepared", "--train-tokenizer", "270", "--no-progress"]
    assert rewind_cli(*args)[0] == 0
    assert read_manifest(corpus / "prepared").vocab_size == 270
    real = dataprep.prepare_tokenizer
    trainings = []
    monkeypatch.setattr(dataprep, "prepare_tokenizer", lambda *a: trainings.append(a) or real(*a))
    exit_code, out, err = rewind_cli(*args)
    assert exit_code == 0, err
    assert out.startswith("already prepared: prepared: ") and "tokenizer trained" not in out
    assert trainings == []
    # Another vocabulary, or changed inputs, do train (and are then another directory's data).
    exit_code, out, err = rewind_cli(*args[:-2], "265", "--no-progress", "--overwrite")
    assert exit_code == 0 and "tokenizer trained in" in out and len(trainings) == 1
    (corpus / "train.jsonl").write_text(json.dumps({"text": "A new document, a new tokenizer."}) + "\n")
    exit_code, out, err = rewind_cli(*args[:-2], "265", "--no-progress", "--overwrite")
    assert exit_code == 0 and len(trainings) == 2


def test_a_tokenizer_of_another_shape_is_not_taken_for_a_trained_one(rewind_cli, corpus, monkeypatch):
    monkeypatch.chdir(corpus)
    tokenizer = train_bpe(DOCUMENTS, 270)
    data = json.loads(tokenizer.to_json())
    data["normalizer"] = {"type": "Lowercase"}  # same ids, other text: not what --train-tokenizer makes
    (corpus / "tok.json").write_text(json.dumps(data), encoding="utf-8")
    assert rewind_cli("data", "prepare", "train.jsonl", "--out", "prepared", "--tokenizer", "tok.json")[0] == 0
    exit_code, out, err = rewind_cli("data", "prepare", "train.jsonl", "--out", "prepared", "--train-tokenizer",
                                     "270", "--no-progress")
    assert exit_code == 1 and out == "" and "holds other prepared data" in one_line(err)


@pytest.mark.parametrize("first", [True, False])
def test_validation_takes_one_input_each_time_wherever_it_comes(rewind_cli, corpus, monkeypatch, first):
    monkeypatch.chdir(corpus)
    (corpus / "valid2.jsonl").write_text(json.dumps({"text": "The dog sang."}) + "\n")
    validation = ["--validation", "valid.jsonl", "--validation", "valid2.jsonl"]
    args = [*validation, "train.jsonl"] if first else ["train.jsonl", *validation]
    exit_code, out, err = rewind_cli("data", "prepare", *args, "--out", "prepared", "--no-progress")
    assert exit_code == 0 and "; validation 2 documents" in out, err
    manifest = read_manifest(corpus / "prepared")
    assert [s.path for s in manifest.sources] == [str(corpus / "train.jsonl")]
    assert [s.path for s in manifest.validation_sources] == [str(corpus / "valid.jsonl"), str(corpus / "valid2.jsonl")]
    assert manifest.splits["train"].num_documents == len(DOCUMENTS)


# --- issue 32: corpora that share a tokenizer ------------------------------------------------------------


def test_tokenizer_takes_a_prepared_directory_whose_tokenizer_it_shares(rewind_cli, corpus, monkeypatch):
    monkeypatch.chdir(corpus)
    (corpus / "other.jsonl").write_text(json.dumps({"text": "A bird sat on the wire, the cat sang."}) + "\n")
    assert rewind_cli("data", "prepare", "train.jsonl", "--out", "a", "--train-tokenizer", "280")[0] == 0
    exit_code, out, err = rewind_cli("data", "prepare", "other.jsonl", "--out", "b", "--tokenizer", "a")
    assert exit_code == 0, err
    shared = read_manifest(corpus / "a").tokenizer
    assert shared and read_manifest(corpus / "b").tokenizer == shared and f"tokenizer: sha256 {shared}" in out
    assert (corpus / "b" / "tokenizer.json").read_bytes() == (corpus / "a" / "tokenizer.json").read_bytes()

    # A directory prepared as UTF-8 bytes passes bytes on; a directory with no tokenizer.json is refused.
    assert rewind_cli("data", "prepare", "train.jsonl", "--out", "bytes")[0] == 0
    exit_code, out, err = rewind_cli("data", "prepare", "other.jsonl", "--out", "c", "--tokenizer", "bytes")
    assert exit_code == 0 and read_manifest(corpus / "c").tokenizer == "" and "UTF-8 bytes" in out, err
    (corpus / "empty").mkdir()
    exit_code, out, err = rewind_cli("data", "prepare", "other.jsonl", "--out", "d", "--tokenizer", "empty")
    assert exit_code == 1 and one_line(err).endswith(f"{corpus / 'empty' / 'tokenizer.json'}: no such file")
    assert not (corpus / "d").exists()
