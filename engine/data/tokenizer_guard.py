"""What a tokenizer.json may make of a text, bounded before any of it runs.

A tokenizer's normalizer rewrites text in Rust before it is split into tokens, and a rewrite can grow
it: a Sequence of Replace steps, each turning "a" into ten of them, makes one character of a document
into 10**k, and the allocation that fails on the way aborts the process (SIGABRT), which no Python
code can catch. So the growth is bounded from the file itself, before any text is normalized:

- `growth_of(spec)`: for every normalizer step, how long its output can be at most, as
  `factor * input + extra` characters (a Replace of a string by a longer one multiplies by the ratio,
  a regex one may match between every two characters, Unicode normalization forms have fixed worst
  cases, a Precompiled charsmap its longest replacement, Prepend adds); a Sequence composes its steps.
  A normalizer type without a known bound is refused. A tokenizer whose whole normalizer may grow
  text more than MAX_GROWTH-fold is refused when it is loaded: real ones stay below a few hundred.
- `NormalizerGuard.plan(texts)`: before each encode, the texts are cut into groups whose normalized
  length stays under MAX_NORMALIZED_CHARS: by the bound when it is enough (the usual case: no work), else
  by normalizing each text step by step, where no step is run on a text whose bound for that step
  passes the limit. A text that would still pass it alone is refused (TokenizerError, one line).

The decoder is bounded the same way (`decoder_growth`: its Replace steps multiply, WordPiece adds a
space per token, BPEDecoder and CTC replace a string by a space), since every token of the vocabulary is decoded when a run starts
(bits per byte) and a decoder may not make a token more than MAX_DECODER_GROWTH times longer.

`model_problem` names a model that would fail on the first word outside its vocabulary (a WordLevel
or WordPiece whose unknown token is not in it) before any document is read.
"""

from __future__ import annotations

import base64
import binascii
import struct
from typing import Any, NamedTuple

# A tokenizer whose normalizer could make text longer than this many times (plus a constant) is refused
# when loaded. Worst cases of real ones: NFKC x lowercase 54, BERT's normalizer 36, a sentencepiece
# charsmap about 18 (its longest rewrite), XLNet's sequence of them under 2,000.
MAX_GROWTH = 1 << 16
# The most characters one encode call may make its normalizer produce: each character costs the Rust
# side some 20 bytes (the text and its alignments), so about 5 GB at most, for documents that big.
MAX_NORMALIZED_CHARS = 1 << 28
# A decoder may make a token at most this much longer (real ones: the same length, or one space more).
MAX_DECODER_GROWTH = 256

# Worst-case output characters per input character of the fixed normalizers (Unicode's own figures:
# NFKC/NFKD of U+FDFA is 18 characters, NFD of U+1F82 4, NFC of U+1D160 3; a lowercase mapping is at
# most 3 characters; ByteLevel turns each UTF-8 byte into a character).
_FIXED = {
    "NFC": 3,
    "NFD": 4,
    "NFKC": 18,
    "NFKD": 18,
    "Lowercase": 3,
    "ByteLevel": 4,
    "Strip": 1,
    "StripAccents": 1,
    "Nmt": 1,
}


class GrowthError(ValueError):
    """A normalizer whose output cannot be bounded (an unknown type, a malformed step)."""


class Growth(NamedTuple):
    """Output characters <= factor * input characters + extra."""

    factor: int
    extra: int

    def then(self, after: Growth) -> Growth:
        """This step followed by `after`."""
        return Growth(self.factor * after.factor, self.extra * after.factor + after.extra)

    def at_most(self, num_chars: int) -> int:
        return self.factor * num_chars + self.extra


IDENTITY = Growth(1, 0)


def flatten(spec: Any, field: str = "normalizers") -> list[tuple[tuple[int, ...], dict]]:
    """The steps of a normalizer spec (tokenizer.json's "normalizer"; a decoder's with `field`
    "decoders"), each with its index path in the nested Sequences (for `tokenizers`' own objects:
    normalizer[i][j]); [] for none."""
    if spec is None:
        return []
    if not isinstance(spec, dict):
        raise GrowthError(f"a normalizer or decoder is a JSON object, not {type(spec).__name__}")
    if spec.get("type") != "Sequence":
        return [((), spec)]
    steps = spec.get(field)
    if not isinstance(steps, list):
        raise GrowthError(f"a Sequence without a list of {field}")
    return [((i, *path), step) for i, inner in enumerate(steps) for path, step in flatten(inner, field)]


def growth_of(step: dict) -> Growth:
    """The worst case of one (non-Sequence) normalizer step."""
    kind = step.get("type")
    if kind in _FIXED:
        return Growth(_FIXED[kind], 0)
    if kind == "BertNormalizer":
        lowercase = bool(step.get("lowercase", True))
        strip = step.get("strip_accents")
        factor = 3 if step.get("handle_chinese_chars", True) else 1  # a space either side of a CJK character
        factor *= 4 if (lowercase if strip is None else strip) else 1  # accents stripped after NFD
        return Growth(factor * (3 if lowercase else 1), 0)
    if kind == "Prepend":
        return Growth(1, _length(step.get("prepend"), "Prepend's prepend"))
    if kind == "Replace":
        return _replace_growth(step)
    if kind == "Precompiled":
        return Growth(_longest_rewrite(step.get("precompiled_charsmap")), 0)
    raise GrowthError(f"a normalizer of type {kind!r}, whose output rewind cannot bound")


def _replace_growth(step: dict) -> Growth:
    content = _length(step.get("content"), "Replace's content")
    pattern = step.get("pattern")
    if isinstance(pattern, dict) and isinstance(pattern.get("String"), str) and pattern["String"]:
        return Growth(max(1, -(-content // len(pattern["String"]))), 0)
    # A regex (or the empty string) may match between every two characters and at both ends.
    return Growth(1 + content, content)


# Decoders that never make a token longer; WordPiece puts a space before a token; BPEDecoder and CTC
# replace a string (the suffix, the word delimiter) by a space, as a Replace does.
_SAME_OR_SHORTER = frozenset({"ByteLevel", "ByteFallback", "Fuse", "Strip", "Metaspace"})
_AS_REPLACE = {"BPEDecoder": "suffix", "CTC": "word_delimiter_token"}


def decoder_growth(spec: Any) -> Growth:
    """How much longer a decoder (tokenizer.json's "decoder") may make a token, as a Growth; GrowthError
    for a decoder type without a known bound, or one past MAX_DECODER_GROWTH."""
    total = IDENTITY
    for _, step in flatten(spec, "decoders"):
        kind = step.get("type")
        if kind == "Replace":
            growth = _replace_growth(step)
        elif kind in _AS_REPLACE:
            growth = _replace_growth({"pattern": {"String": step.get(_AS_REPLACE[kind])}, "content": " "})
        elif kind == "WordPiece":
            growth = Growth(1, 1)
        elif kind in _SAME_OR_SHORTER:
            growth = IDENTITY
        else:
            raise GrowthError(f"a decoder of type {kind!r}, whose output rewind cannot bound")
        total = total.then(growth)
    if total.factor + total.extra > MAX_DECODER_GROWTH:
        raise GrowthError(
            f"its decoder may make a token up to {_shown(total.factor)} times longer{_plus(total.extra)}, past "
            f"the {MAX_DECODER_GROWTH:,} rewind accepts"
        )
    return total


def _length(value: Any, what: str) -> int:
    if not isinstance(value, str):
        raise GrowthError(f"{what} is not a string")
    return len(value)


def _longest_rewrite(charsmap: Any) -> int:
    """The longest replacement a sentencepiece charsmap holds, in characters: its layout is a u32 trie
    size, the trie, then the replacements, each ended by a NUL (a match, of one character or more, is
    replaced by the one at an offset)."""
    if not isinstance(charsmap, str):
        raise GrowthError("Precompiled's precompiled_charsmap is not a string")
    try:
        data = base64.b64decode(charsmap, validate=True)
    except (binascii.Error, ValueError):
        raise GrowthError("Precompiled's precompiled_charsmap is not base64") from None
    if len(data) < 4:
        raise GrowthError("Precompiled's precompiled_charsmap is too short")
    (trie_size,) = struct.unpack_from("<I", data)
    rewrites = data[4 + trie_size :] if 4 + trie_size <= len(data) else data
    return max([1, *(len(part.decode("utf-8", errors="replace")) for part in rewrites.split(b"\0"))])


def model_problem(model: Any) -> str:
    """Why a `tokenizers` model would fail on the first word outside its vocabulary ("" when it would
    not): a WordLevel or WordPiece model replaces such a word by its unknown token, which must then be
    in its vocabulary."""
    kind = type(model).__name__
    if kind not in ("WordLevel", "WordPiece") or model.token_to_id(model.unk_token) is not None:
        return ""
    return (
        f"its {kind} model's unknown token {str(model.unk_token)[:40]!r} is not in its vocabulary (a word "
        "outside the vocabulary could not be encoded)"
    )


class NormalizerGuard:
    """The bound of one tokenizer's normalizer, and the plan that keeps each encode call under it.

    `spec`: tokenizer.json's "normalizer"; `normalizer`: the `tokenizers` object built from it."""

    def __init__(self, spec: Any, normalizer: Any):
        steps = flatten(spec)
        self.steps: list[tuple[Growth, dict, Any]] = []
        total = IDENTITY
        for path, step in steps:
            growth = growth_of(step)
            total = total.then(growth)
            obj = normalizer
            for index in path:
                obj = obj[index]
            self.steps.append((growth, step, obj))
        self.total = total
        if total.factor + total.extra > MAX_GROWTH:
            raise GrowthError(
                f"its normalizer may make a text up to {_shown(total.factor)} times longer{_plus(total.extra)}, "
                f"past the {MAX_GROWTH:,} rewind accepts"
            )

    def plan(self, texts: list[str]) -> list[slice]:
        """Consecutive groups of `texts` whose normalized length together stays within
        MAX_NORMALIZED_CHARS (one group when their bound already does). GrowthError for a text that
        alone would not."""
        if sum(self.total.at_most(len(text)) for text in texts) <= MAX_NORMALIZED_CHARS:
            return [slice(0, len(texts))]
        groups, start, size = [], 0, 0
        for i, text in enumerate(texts):
            found = self.normalized_length(text)
            if size + found > MAX_NORMALIZED_CHARS and i > start:
                groups.append(slice(start, i))
                start, size = i, 0
            size += found
        groups.append(slice(start, len(texts)))
        return groups

    def normalized_length(self, text: str) -> int:
        """The length `text` has once normalized, by its bound when that is within the limit, else by
        running the steps one by one, none on a text it could take past the limit."""
        if (bound := self.total.at_most(len(text))) <= MAX_NORMALIZED_CHARS:
            return bound
        current = text
        for growth, spec, step in self.steps:
            if _step_output(growth, spec, current) > MAX_NORMALIZED_CHARS:
                raise GrowthError(
                    f"a document of {len(text):,} characters, which its normalizer could make longer than the "
                    f"{MAX_NORMALIZED_CHARS:,} characters one encode may produce (split the document)"
                )
            current = step.normalize_str(current)
        return len(current)


def _step_output(growth: Growth, spec: dict, text: str) -> int:
    """The most one step can make of `text`: exactly, for a Replace of a string (each non-overlapping
    occurrence, leftmost first, as the Rust side finds them), else its bound."""
    pattern = spec.get("pattern")
    if spec.get("type") == "Replace" and isinstance(pattern, dict) and pattern.get("String"):
        found = pattern["String"]
        return len(text) + text.count(found) * (len(spec["content"]) - len(found))
    return growth.at_most(len(text))


def _plus(extra: int) -> str:
    return f" (plus {_shown(extra)} characters)" if extra else ""


def _shown(number: int) -> str:
    return f"{number:,}" if number < 10**12 else f"about 10**{len(str(number)) - 1}"
