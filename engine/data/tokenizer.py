"""The run's tokenizer: a Hugging Face `tokenizers` file (tokenizer.json), or UTF-8 bytes.

Both kinds answer one interface (`Tokenizer`, `ByteTokenizer`): encode / encode_batch / decode, the
token that goes between documents of a flat token stream (`separator`), and how many UTF-8 bytes each
token stands for (`token_num_bytes`, for bits-per-byte figures that compare across tokenizers).

Encoding is of document text as it is: a tokenizer's post-processor (a [CLS] ... [SEP] template, a BOS)
is not applied, padding and truncation a tokenizer.json may carry are switched off (truncation would
cut documents silently), and special tokens written in the text (a literal "<|endoftext|>" in a
scraped page) are encoded as the text they are, so that only `separator()` ends a document.

A tokenizer.json is untrusted input: it is read only as a regular file of at most MAX_TOKENIZER_BYTES
(`read_tokenizer_bytes`), its normalizer's growth is bounded before any text is normalized and every
encode is kept within it (rewind.engine.data.tokenizer_guard: a file of a few KB could otherwise make one
character into more than memory holds, and the Rust side aborts the process), a WordLevel/WordPiece
model whose unknown token is missing is refused when loaded, and whatever the Rust side still raises
while encoding is a TokenizerError of one line.

`train_bpe` trains a byte-level BPE tokenizer that is a pure function of its inputs: see its docstring
for what makes the `tokenizers` trainer deterministic.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterable
from typing import Protocol

import msgspec
import numpy as np

from rewind.engine.data.tokenizer_guard import GrowthError, NormalizerGuard, decoder_growth, model_problem
from rewind.stores.datamanifest import MAX_TOKENIZER_BYTES, is_prepared
from rewind.stores.fsio import FilesystemUnavailable, decode_json, filesystem

EOS_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


class TokenizerError(Exception):
    """A tokenizer cannot be loaded or trained as asked (one line, naming the file)."""


class TextTokenizer(Protocol):
    """What the data pipeline needs of a tokenizer (`Tokenizer` and `ByteTokenizer` both are one)."""

    vocab_size: int
    identity: str
    eos_id: int | None
    pad_id: int

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def separator(self) -> list[int]: ...
    def token_num_bytes(self) -> np.ndarray: ...
    def to_json(self) -> str | None: ...


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's table from a byte to the printable character that stands for it in a byte-level BPE
    vocabulary: printable Latin-1 bytes map to themselves, the other 68 to U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.cache
def unicode_to_byte() -> dict[str, int]:
    return {char: b for b, char in byte_to_unicode().items()}


class ByteTokenizer:
    """Token id = UTF-8 byte value (vocab 256): what a run without a tokenizer reads."""

    vocab_size = 256
    identity = ""
    eos_id: int | None = None
    pad_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def separator(self) -> list[int]:
        return [10]  # "\n": what rewind joined documents with before it had tokenizers

    def token_num_bytes(self) -> np.ndarray:
        return np.ones(256, dtype=np.int64)

    def to_json(self) -> str | None:
        return None


class Tokenizer:
    """A `tokenizers.Tokenizer` and the sha256 of the tokenizer.json it was read from (or trained into)."""

    def __init__(self, json_text: str, *, source: str = "tokenizer.json"):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            inner = HFTokenizer.from_str(json_text)
        except BaseException as exc:  # tokenizers raises plain Exception with serde's message
            raise TokenizerError(f"{source}: not a tokenizer.json ({_first_line(_from_rust(exc))})") from None
        try:
            normalizer = inner.normalizer
            state = None if normalizer is None else decode_json(normalizer.__getstate__())
            self._guard = NormalizerGuard(state, normalizer)
            decoder_growth(None if inner.decoder is None else decode_json(inner.decoder.__getstate__()))
        except (GrowthError, msgspec.DecodeError) as exc:
            raise TokenizerError(f"{source}: refused: {exc}") from None
        if problem := model_problem(inner.model):
            raise TokenizerError(f"{source}: refused: {problem}")
        inner.no_truncation()
        inner.no_padding()
        inner.encode_special_tokens = True  # a special written in a document is text, not a separator
        self._inner = inner
        self._json = json_text
        self.source = source
        self.identity = hashlib.sha256(json_text.encode("utf-8")).hexdigest()
        vocab = inner.get_vocab(with_added_tokens=True)
        # The largest id + 1, not the count: a hand-edited vocabulary may have gaps, and a token file's
        # dtype must hold every id the tokenizer can produce.
        self.vocab_size = max(vocab.values(), default=-1) + 1
        if self.vocab_size == 0:
            raise TokenizerError(f"{source}: the tokenizer has an empty vocabulary")
        self.eos_id: int | None = vocab.get(EOS_TOKEN)
        self.pad_id = self.eos_id if self.eos_id is not None else 0

    @property
    def inner(self):
        """The wrapped `tokenizers.Tokenizer` (configured as this class encodes: see the module doc)."""
        return self._inner

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The parallel path: the Rust side splits the batch across its threads (without the GIL) and
        skips character offsets, which nothing here needs. Split where the normalizer's output would
        pass the guard's limit; TokenizerError (one line) for a text it refuses or an encoding error."""
        try:
            groups = self._guard.plan(texts)
        except GrowthError as exc:
            raise TokenizerError(f"{self.source}: {exc}") from None
        except BaseException as exc:  # (a step measured on its own)
            raise TokenizerError(f"{self.source}: cannot normalize a document: {_first_line(_from_rust(exc))}") from None
        ids: list[list[int]] = []
        for group in groups:
            try:
                encodings = self._inner.encode_batch_fast(texts[group], add_special_tokens=False)
            except BaseException as exc:  # a model that cannot encode a word, a panic in the Rust code
                raise TokenizerError(f"{self.source}: cannot encode a document: {_first_line(_from_rust(exc))}") from None
            ids += [encoding.ids for encoding in encodings]
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._inner.decode(list(ids), skip_special_tokens=False)

    def separator(self) -> list[int]:
        return [self.eos_id] if self.eos_id is not None else self.encode("\n")

    def token_num_bytes(self) -> np.ndarray:
        """UTF-8 bytes per token id (int64, vocab_size entries; 0 for specials and unused ids). Exact
        for a byte-level BPE (each character of a vocabulary entry is one byte); otherwise the length
        of the token decoded on its own, which is approximate where a token is part of a character."""
        sizes = np.zeros(self.vocab_size, dtype=np.int64)
        added = self._inner.get_added_tokens_decoder()
        byte_level = _is_byte_level(self._inner.decoder)
        table = unicode_to_byte()
        for token, token_id in self._inner.get_vocab(with_added_tokens=True).items():
            if token_id in added:
                if added[token_id].special:
                    continue
            elif byte_level and all(char in table for char in token):
                sizes[token_id] = len(token)
                continue
            sizes[token_id] = len(self._inner.decode([token_id], skip_special_tokens=False).encode("utf-8"))
        return sizes

    def to_json(self) -> str | None:
        return self._json


def _from_rust(exc: BaseException) -> BaseException:
    """`exc` when it is what `tokenizers` raises for a file or a text it cannot handle: an Exception, or
    pyo3's PanicException where its Rust code panics (a BaseException, which some tokenizer.json files
    can make it raise); anything else (KeyboardInterrupt, SystemExit) is raised again as it is."""
    if isinstance(exc, Exception) or type(exc).__name__ == "PanicException":
        return exc
    raise exc


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__


def _is_byte_level(decoder) -> bool:
    """Whether the tokenizer decodes through the byte-level table (its decoder is ByteLevel, alone or
    in a Sequence), so that vocabulary entries are strings of byte characters."""
    try:
        state = decode_json(decoder.__getstate__()) if decoder is not None else {}
    except msgspec.DecodeError:
        return False
    if not isinstance(state, dict):
        return False
    parts = state.get("decoders", []) if state.get("type") == "Sequence" else [state]
    return any(isinstance(part, dict) and part.get("type") == "ByteLevel" for part in parts)


def read_tokenizer_bytes(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the tokenizer.json at `path` (local or an fsspec URL): a regular file of at most
    MAX_TOKENIZER_BYTES. TokenizerError (one line) otherwise; FileNotFoundError when it is absent."""
    path = str(path)
    try:
        location = filesystem(os.path.expanduser(path))
        if location.is_local and os.path.isdir(location.path):
            raise TokenizerError(f"{path}: is a directory (give the tokenizer.json inside it)")
        return location.read_bounded(MAX_TOKENIZER_BYTES)
    except FileNotFoundError:
        raise
    except FilesystemUnavailable as exc:
        raise TokenizerError(str(exc)) from None
    except OSError as exc:
        raise TokenizerError(f"{path}: cannot read: {exc.strerror or exc}") from None


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer in `path` (a tokenizer.json, local or an fsspec URL). TokenizerError: one line."""
    path = str(path)
    try:
        data = read_tokenizer_bytes(path)
    except FileNotFoundError:
        raise TokenizerError(f"{path}: no such file") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenizerError(f"{path}: not a tokenizer.json (not UTF-8 text)") from None
    return Tokenizer(text, source=path)


def tokenizer_in(path: str | os.PathLike[str]) -> Tokenizer | ByteTokenizer:
    """The tokenizer `path` names: a tokenizer.json, or a directory holding one (a prepared directory, a
    transformers model's); UTF-8 bytes for a prepared directory without one (its data is bytes).
    TokenizerError: one line."""
    path = str(path)
    try:
        location = filesystem(os.path.expanduser(path))
    except FilesystemUnavailable as exc:
        raise TokenizerError(str(exc)) from None
    if not is_prepared(path) and not (location.is_local and os.path.isdir(location.path)):
        return load_tokenizer(path)
    inside = location.join(TOKENIZER_FILE)
    if not inside.exists() and is_prepared(path):
        return ByteTokenizer()
    return load_tokenizer(inside.url)


def load_run_tokenizer(run_dir: str | os.PathLike[str]) -> Tokenizer | ByteTokenizer:
    """The tokenizer of a run: RUN/data/tokenizer.json, or bytes when the run has none."""
    location = filesystem(str(run_dir)).join("data", TOKENIZER_FILE)
    if not location.exists():
        return ByteTokenizer()
    return load_tokenizer(location.url)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of `vocab_size` ids (<|endoftext|> = 0, then the 256 bytes, then
    merges) trained on `texts`; the same texts give the same tokenizer.json, byte for byte.

    What makes the trainer deterministic: counts of words and pairs are sums (order-free), ties between
    merges of equal count are broken by the pair's ids, and the ids are fixed before any merge because
    the special token comes first and the initial alphabet is all 256 byte characters, sorted. What
    would break it, and is therefore left unset: `limit_alphabet` (drops the rarest characters with an
    unstable sort over a hash map, so ties go either way), and `continuing_subword_prefix` /
    `end_of_word_suffix` (those tokens get ids in hash-map iteration order; tokenizers issue #1794)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise TokenizerError(f"a byte-level BPE needs vocab_size >= 257 (256 bytes and <|endoftext|>), got {vocab_size}")
    inner = HFTokenizer(models.BPE())
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    inner.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=0,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    inner.train_from_iterator(texts, trainer)
    return Tokenizer(inner.to_str(), source="trained tokenizer")
