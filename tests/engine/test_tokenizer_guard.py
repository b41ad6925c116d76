"""A tokenizer.json is bounded before it runs (rewind.engine.data.tokenizer_guard): its normalizer's and its
decoder's worst-case growth are computed from the file and never exceeded by what `tokenizers` produces
(properties over random normalizers, decoders and texts), a normalizer that multiplies text past
MAX_GROWTH (a decoder past MAX_DECODER_GROWTH) is refused when the file is loaded (the 2 KB file that made `data prepare` die in a Rust allocation failure), every encode stays
under MAX_NORMALIZED_CHARS by splitting or refusing, and models that cannot encode an unknown word are
refused when loaded or in one line when they fail."""

from __future__ import annotations

import base64
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

from rewind.engine.data import tokenizer_guard
from rewind.engine.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer, train_bpe
from rewind.engine.data.tokenizer_guard import (
    MAX_DECODER_GROWTH,
    MAX_GROWTH,
    Growth,
    GrowthError,
    NormalizerGuard,
    decoder_growth,
    growth_of,
)
from rewind.stores.fsio import decode_json

VOCAB = {"[UNK]": 0, "a": 1, "b": 2}
# Characters at the worst cases the fixed bounds name: NFKC/NFKD of U+FDFA (18), NFD of U+1F82 (4),
# NFC of U+1D160 (3), lowercase of U+0130 (2), a CJK character (BERT pads it), a 4-byte emoji.
HARD = "\ufdfa\u1f82\U0001d160\u0130\u4e00\U0001f600aAb \t\u0301"


def json_of(normalizer=None, model=None) -> str:
    inner = HFTokenizer(model or models.WordLevel(VOCAB, unk_token="[UNK]"))
    if normalizer is not None:
        inner.normalizer = normalizer
    return inner.to_str()


def bomb(num_steps: int = 15) -> str:
    """The issue's file: a Sequence of Replace steps each turning "a" into ten (10**15-fold)."""
    return json_of(normalizers.Sequence([normalizers.Replace("a", "a" * 10) for _ in range(num_steps)]))


def test_a_normalizer_that_multiplies_text_is_refused_when_loaded(tmp_path):
    text = bomb()
    assert len(text) < 2048
    path = tmp_path / "tokenizer.json"
    path.write_text(text)
    with pytest.raises(TokenizerError) as info:
        load_tokenizer(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: refused: its normalizer may make a text")
    assert "about 10**15 times longer" in message and f"{MAX_GROWTH:,}" in message


def test_real_normalizers_are_accepted():
    accepted = [
        None,
        normalizers.NFC(),
        normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]),  # Llama 2
        normalizers.BertNormalizer(lowercase=True, handle_chinese_chars=True),  # BERT uncased
        normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
        normalizers.Sequence(
            [normalizers.Replace("``", '"'), normalizers.NFKD(), normalizers.StripAccents(),
             normalizers.Lowercase(), normalizers.Replace(Regex(" {2,}"), " ")]
        ),
    ]
    for normalizer in accepted:
        tokenizer = Tokenizer(json_of(normalizer))
        assert tokenizer.encode("ab a") == tokenizer.inner.encode("ab a", add_special_tokens=False).ids
    assert Tokenizer(json_of(accepted[3]))._guard.total == Growth(36, 0)
    assert train_bpe(["hello world"] * 3, 300)._guard.total == Growth(1, 0)


# --- the bound is sound: what tokenizers produces never exceeds it ------------------------------------

short = st.text(alphabet=st.sampled_from("ab \u2581x"), max_size=4)
steps = st.one_of(
    st.builds(lambda p, c: normalizers.Replace(p, c), st.text(alphabet="ab ", min_size=1, max_size=2), short),
    st.builds(lambda p, c: normalizers.Replace(Regex(p), c), st.sampled_from(["a", "a*", "", " +", "b|"]), short),
    st.builds(normalizers.Prepend, short),
    st.sampled_from(
        [normalizers.NFC(), normalizers.NFD(), normalizers.NFKC(), normalizers.NFKD(), normalizers.Lowercase(),
         normalizers.ByteLevel(), normalizers.Strip(), normalizers.StripAccents(), normalizers.Nmt()]
    ),
    st.builds(
        normalizers.BertNormalizer, clean_text=st.booleans(), handle_chinese_chars=st.booleans(),
        strip_accents=st.sampled_from([None, True, False]), lowercase=st.booleans(),
    ),
)
texts = st.text(alphabet=st.sampled_from(HARD), max_size=12)


@settings(max_examples=150, deadline=None)
@given(chain=st.lists(steps, min_size=1, max_size=3), text=texts)
def test_no_normalizer_produces_more_than_its_bound(chain, text):
    normalizer = normalizers.Sequence(chain)
    tokenizer = Tokenizer(json_of(normalizer))
    try:
        produced = len(normalizer.normalize_str(text))
    except BaseException as exc:  # pyo3's PanicException: some chains make tokenizers' Rust code panic
        assert type(exc).__name__ == "PanicException"
        with pytest.raises(TokenizerError, match="cannot encode a document") as info:
            tokenizer.encode(text)  # the same panic, as one line
        assert "\n" not in str(info.value)
        return
    assert produced <= tokenizer._guard.total.at_most(len(text)), (normalizer.__getstate__(), text)
    assert tokenizer.encode(text) == tokenizer.inner.encode(text, add_special_tokens=False).ids


decoder_steps = st.one_of(
    st.builds(lambda p, c: decoders.Replace(p, c), st.text(alphabet="ab \u2581", min_size=1, max_size=2), short),
    st.sampled_from(
        [decoders.WordPiece(), decoders.BPEDecoder(suffix=""), decoders.BPEDecoder(), decoders.Metaspace(),
         decoders.Fuse(), decoders.ByteFallback(), decoders.Strip(" ", 1, 0), decoders.CTC(), decoders.ByteLevel()]
    ),
)


@settings(max_examples=150, deadline=None)
@given(
    chain=st.lists(decoder_steps, min_size=1, max_size=3),
    tokens=st.lists(st.text(alphabet=st.sampled_from("ab \u2581#<>0x|"), max_size=6), max_size=6),
)
def test_no_decoder_produces_more_than_its_bound(chain, tokens):
    decoder = decoders.Sequence(chain)
    growth = decoder_growth(decode_json(decoder.__getstate__()))
    assert len(decoder.decode(tokens)) <= sum(growth.at_most(len(token)) for token in tokens)


def test_a_decoder_that_multiplies_tokens_is_refused_when_loaded():
    inner = HFTokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    inner.decoder = decoders.Sequence([decoders.Replace("a", "a" * 10) for _ in range(15)])
    with pytest.raises(TokenizerError) as info:
        Tokenizer(inner.to_str(), source="t.json")
    assert str(info.value) == (
        f"t.json: refused: its decoder may make a token up to about 10**15 times longer, past the "
        f"{MAX_DECODER_GROWTH:,} rewind accepts"
    )


def test_a_precompiled_charsmap_is_bounded_by_its_longest_rewrite():
    trie = b"\0" * 8
    charsmap = struct.pack("<I", len(trie)) + trie + "ab\0\ufdfa\ufdfa\0x".encode() + b"\0"
    step = {"type": "Precompiled", "precompiled_charsmap": base64.b64encode(charsmap).decode()}
    assert growth_of(step) == Growth(2, 0)
    with pytest.raises(GrowthError, match="not base64"):
        growth_of({"type": "Precompiled", "precompiled_charsmap": "%%"})
    with pytest.raises(GrowthError, match="cannot bound"):
        growth_of({"type": "SomethingNew"})


# --- every encode stays under the limit -------------------------------------------------------------


def test_a_batch_past_the_limit_is_split_and_encodes_the_same(monkeypatch):
    tokenizer = Tokenizer(json_of(normalizers.Replace("a", "aaaa")))  # 4-fold at most
    documents = ["ab" * 10, "a" * 30, "b" * 5, "ba" * 12]
    whole = tokenizer.encode_batch(documents)
    monkeypatch.setattr(tokenizer_guard, "MAX_NORMALIZED_CHARS", 130)
    groups = tokenizer._guard.plan(documents)
    assert len(groups) > 1 and [i for g in groups for i in range(len(documents))[g]] == [0, 1, 2, 3]
    assert tokenizer.encode_batch(documents) == whole


def test_a_document_its_normalizer_would_take_past_the_limit_is_refused_before_it_runs(monkeypatch):
    tokenizer = Tokenizer(json_of(normalizers.Sequence([normalizers.NFC(), normalizers.Replace("a", "a" * 50)])))
    monkeypatch.setattr(tokenizer_guard, "MAX_NORMALIZED_CHARS", 1000)
    ran = []
    monkeypatch.setattr(
        NormalizerGuard, "normalized_length",
        lambda self, text, real=NormalizerGuard.normalized_length: ran.append(text) or real(self, text),
    )
    assert tokenizer.encode("b" * 200)  # bound 200 * 150 > 1000, measured 200: encoded
    with pytest.raises(TokenizerError) as info:
        tokenizer.encode("a" * 30)  # 1,500 characters after its second step: that step never runs
    assert "\n" not in str(info.value) and "a document of 30 characters" in str(info.value)
    assert "split the document" in str(info.value) and len(ran) == 2


# --- models that cannot encode an unknown word ------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    [models.WordLevel({"a": 0}, unk_token="[UNK]"), models.WordPiece({"a": 0}, unk_token="[UNK]")],
    ids=["WordLevel", "WordPiece"],
)
def test_a_model_whose_unknown_token_is_missing_is_refused_when_loaded(model):
    with pytest.raises(TokenizerError) as info:
        Tokenizer(json_of(model=model), source="t.json")
    assert str(info.value) == (
        f"t.json: refused: its {type(model).__name__} model's unknown token '[UNK]' is not in its vocabulary "
        "(a word outside the vocabulary could not be encoded)"
    )


def test_an_encoding_error_is_one_line():
    inner = HFTokenizer(models.BPE({"a": 0}, [], unk_token="[X]"))  # unk token missing: fails on "b"
    inner.decoder = decoders.BPEDecoder()
    tokenizer = Tokenizer(inner.to_str(), source="bpe.json")
    assert tokenizer.encode("a") == [0]
    with pytest.raises(TokenizerError, match=r"^bpe\.json: cannot encode a document: .*\[X\]") as info:
        tokenizer.encode_batch(["a", "ab"])
    assert "\n" not in str(info.value)
