"""Tokenizers: byte and BPE round trips, bytes per token, deterministic training, loading errors."""

from __future__ import annotations

import hashlib
import json

import fsspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.engine.data.tokenizer import (
    EOS_TOKEN,
    ByteTokenizer,
    Tokenizer,
    TokenizerError,
    byte_to_unicode,
    load_run_tokenizer,
    load_tokenizer,
    train_bpe,
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n",
    "Über naïve café — 東京 and emoji 🦊🦊, tabs\tand\r\nwindows lines.",
    "the the the then there their theory theorem",
]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return train_bpe(CORPUS * 5, 320)


def test_bytes_are_utf8_values_and_one_byte_each():
    tok = ByteTokenizer()
    text = "héllo 🦊"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, ""]) == [ids, []]
    assert tok.separator() == [10] and tok.eos_id is None and tok.pad_id == 0
    assert tok.identity == "" and tok.to_json() is None
    sizes = tok.token_num_bytes()
    assert sizes.dtype == np.int64 and sizes.shape == (256,) and int(sizes[ids].sum()) == len(text.encode())


def test_the_byte_table_is_a_bijection_onto_printable_characters():
    table = byte_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256
    assert all(char.isprintable() and not char.isspace() for char in table.values())
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ"  # GPT-2's space


def test_training_is_deterministic(bpe):
    again = train_bpe(CORPUS * 5, 320)
    assert again.to_json() == bpe.to_json()
    assert again.identity == bpe.identity and len(bpe.identity) == 64
    # ... and depends on what it was trained on.
    assert train_bpe(CORPUS[:2] * 5, 320).identity != bpe.identity


def test_trained_layout_is_eos_then_the_256_bytes(bpe):
    assert bpe.eos_id == 0 and bpe.pad_id == 0 and bpe.separator() == [0]
    assert 256 < bpe.vocab_size <= 320
    vocab = bpe.inner.get_vocab()
    assert sorted(vocab[char] for char in byte_to_unicode().values()) == list(range(1, 257))


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=80))
def test_bpe_round_trip_and_bytes_per_token(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert bpe.encode_batch([text, "fox"]) == [ids, bpe.encode("fox")]
    assert int(bpe.token_num_bytes()[ids].sum()) == len(text.encode("utf-8"))


def test_bytes_per_token_counts_merges_and_not_specials(bpe):
    sizes = bpe.token_num_bytes()
    assert sizes.shape == (bpe.vocab_size,) and sizes[bpe.eos_id] == 0
    assert (sizes[1:257] == 1).all() and sizes[257:].min() >= 2  # a merge joins at least two bytes
    ids = bpe.encode(" the the")
    assert len(ids) < len(" the the") and int(sizes[ids].sum()) == 8


def test_a_special_written_in_text_is_text_not_a_separator(bpe):
    ids = bpe.encode(f"a{EOS_TOKEN}b")
    assert bpe.eos_id not in ids
    assert bpe.decode(ids) == f"a{EOS_TOKEN}b"
    assert bpe.decode([*bpe.encode("a"), bpe.eos_id]) == f"a{EOS_TOKEN}"


def test_a_file_round_trips_and_loses_truncation_and_padding(tmp_path, bpe):
    inner = bpe.inner
    inner.enable_truncation(4)
    inner.enable_padding(length=64)
    path = tmp_path / "tokenizer.json"
    path.write_text(inner.to_str(), encoding="utf-8")
    inner.no_truncation()
    inner.no_padding()
    loaded = load_tokenizer(path)
    assert loaded.identity == hashlib.sha256(path.read_bytes()).hexdigest()
    text = "The quick brown fox jumps over the lazy dog."
    assert loaded.encode(text) == bpe.encode(text) and len(loaded.encode(text)) > 4


def test_a_tokenizer_without_eos_separates_with_a_newline(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers, trainers

    inner = HF(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=280, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = Tokenizer(inner.to_str())
    assert tok.eos_id is None and tok.pad_id == 0
    assert tok.separator() == tok.encode("\n") and len(tok.separator()) == 1


def test_bytes_per_token_without_a_byte_table_decodes_each_token():
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "héllo": 1, "w": 5}, "unk_token": "[UNK]"},
    }
    tok = Tokenizer(json.dumps(spec))
    assert tok.vocab_size == 6  # the largest id + 1, gaps and all
    assert tok.token_num_bytes().tolist() == [5, 6, 0, 0, 0, 1]
    assert tok.encode("héllo w") == [1, 5]


@pytest.mark.parametrize(
    ("content", "needle"),
    [(None, "no such file"), (b'{"not": "a tokenizer"}', "not a tokenizer.json"),
     (b"\xff\xfe", "not a tokenizer.json (not UTF-8"), ("dir", "is a directory")],
)
def test_load_errors_are_one_line(tmp_path, content, needle):
    path = tmp_path / "tokenizer.json"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(path)
    message = str(info.value)
    assert needle in message and str(path) in message and "\n" not in message


def test_load_from_an_fsspec_url(bpe):
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/tok-test/tokenizer.json", bpe.to_json().encode())
    try:
        assert load_tokenizer("memory://tok-test/tokenizer.json").identity == bpe.identity
    finally:
        fs.rm("/tok-test", recursive=True)


def test_a_run_tokenizer_is_its_data_file_or_bytes(tmp_path, bpe):
    assert isinstance(load_run_tokenizer(tmp_path), ByteTokenizer)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tokenizer.json").write_text(bpe.to_json(), encoding="utf-8")
    assert load_run_tokenizer(tmp_path).identity == bpe.identity


def test_too_small_a_vocabulary_is_refused():
    with pytest.raises(TokenizerError, match="vocab_size >= 257"):
        train_bpe(CORPUS, 200)
