"""`rewind data prepare` / `rewind data info` as a user types them: summaries, reuse, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from rewind.engine.tokenizer import train_bpe
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
