"""Embedded synthetic datasets, generated in code: byte-level text (token id = byte value).

Every row is a function of (dataset name, split, index, block_size) only, drawn from a generator
keyed by the fixed `TASK_SEED` (not the run seed): two runs see the same datasets, and the run seed
only changes the order they are read in (see `rewind.engine.data.cursors`).

- "grammar": pretraining-like text from a small probabilistic grammar, packed to fill the row; the
  loss covers every position.
- "reverse" / "sort" / "add": `rev abc=cba\\n`, `sort dbca=abcd\\n`, `add 123+45=168\\n`, several
  examples packed per row and the rest padded with byte 0 (never present in text); the loss covers
  only the answer characters and their newline. Each example's *input* belongs to exactly one split
  (a hash of the input picks it), so validation measures examples the model never trained on.

A row is `tokens` int64 (block_size + 1,) and `loss_mask` bool (block_size,) over the *targets*:
position t predicts tokens[t + 1] and counts when loss_mask[t].
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rewind.engine.model.rng import numpy_rng

Encoder = Callable[[str], list[int]]  # text -> token ids (a tokenizer's encode)

# Dataset-level seed: part of the datasets' definition. Changing it changes every built-in dataset.
TASK_SEED = 0x5EED_DA7A
TASK_NAMES: tuple[str, ...] = ("grammar", "reverse", "sort", "add")
SPLITS: tuple[str, ...] = ("train", "validation")

_SPLIT_SIZES = {
    "grammar": {"train": 2**31 - 1, "validation": 512},  # train is generated on demand: "infinite"
    "reverse": {"train": 2**20, "validation": 256},
    "sort": {"train": 2**20, "validation": 256},
    "add": {"train": 2**20, "validation": 256},
}
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_MIN_LETTERS, _MAX_LETTERS = 3, 8
_MAX_DIGITS = 4
# Longest example of each task, in bytes: the smallest row that can hold one (tokens = block + 1).
_LONGEST_EXAMPLE = {
    "grammar": 1,
    "reverse": len("rev ") + 2 * _MAX_LETTERS + len("=\n"),
    "sort": len("sort ") + 2 * _MAX_LETTERS + len("=\n"),
    "add": len("add ") + 2 * _MAX_DIGITS + len("+=") + (_MAX_DIGITS + 1) + len("\n"),
}
# 1 in 16 inputs belongs to validation, decided by a multiplicative hash of the input's key.
_VALIDATION_SHARE_BITS = 4
_DRAW_CHUNK = 128


class Draws:
    """Uniform floats pulled from a numpy Generator in chunks: one numpy call per ~100 decisions
    instead of one per decision, which is what keeps generating a row in the tens of microseconds."""

    __slots__ = ("_next", "_rng", "_values")

    def __init__(self, rng: np.random.Generator):
        self._rng = rng
        self._values: list[float] = []
        self._next = 0

    def uniform(self) -> float:
        if self._next == len(self._values):
            self._values = self._rng.random(_DRAW_CHUNK).tolist()
            self._next = 0
        value = self._values[self._next]
        self._next += 1
        return value

    def below(self, n: int) -> int:
        # min(): u * n can round up to n for u just below 1.
        return min(int(self.uniform() * n), n - 1)

    def between(self, low: int, high: int) -> int:
        """Uniform integer in [low, high]."""
        return low + self.below(high - low + 1)

    def choice(self, options: tuple | list) -> object:
        return options[self.below(len(options))]

    def chance(self, probability: float) -> bool:
        return self.uniform() < probability


def num_task_samples(name: str, split: str) -> int:
    return _SPLIT_SIZES[name][split]


def min_block_size(name: str) -> int:
    """Smallest block_size whose rows (block_size + 1 tokens) hold one example of `name`."""
    return _LONGEST_EXAMPLE[name] - 1


def _in_validation(key: int) -> bool:
    # Fibonacci hashing: the top bits of key * 2**64/phi spread consecutive keys evenly.
    mixed = (key * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    return mixed >> (64 - _VALIDATION_SHARE_BITS) == 0


def _letters_key(text: str) -> int:
    key = 0
    for char in text:
        key = key * 27 + (ord(char) - 96)  # base 27 with no zero digit: "a" and "aa" differ
    return key


def _random_letters(draws: Draws) -> str:
    length = draws.between(_MIN_LETTERS, _MAX_LETTERS)
    return "".join([_LETTERS[draws.below(26)] for _ in range(length)])


def _random_operand(draws: Draws) -> int:
    # Digits first, then the value: otherwise almost every operand would have four digits.
    digits = draws.between(1, _MAX_DIGITS)
    return draws.between(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def task_example(name: str, draws: Draws) -> tuple[str, str, int]:
    """(prompt, answer, key) of one example; the answer includes its terminating newline."""
    if name == "add":
        a, b = _random_operand(draws), _random_operand(draws)
        return f"add {a}+{b}=", f"{a + b}\n", a * 10**_MAX_DIGITS + b
    letters = _random_letters(draws)
    if name == "reverse":
        return f"rev {letters}=", f"{letters[::-1]}\n", _letters_key(letters)
    if name == "sort":
        return f"sort {letters}=", "".join(sorted(letters)) + "\n", _letters_key(letters)
    raise KeyError(name)


def split_example(name: str, split: str, draws: Draws) -> tuple[str, str]:
    """An example whose input belongs to `split` (rejection sampling against the split hash)."""
    want_validation = split == "validation"
    while True:
        prompt, answer, key = task_example(name, draws)
        if _in_validation(key) == want_validation:
            return prompt, answer


def _packed_examples(
    name: str, split: str, draws: Draws, row_length: int, encode: Encoder | None
) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.zeros(row_length, dtype=np.int64)
    loss_mask = np.zeros(row_length - 1, dtype=bool)
    used = 0
    while True:
        prompt, answer = split_example(name, split, draws)
        if encode is None:  # byte level: token id = byte value
            prompt_ids, answer_ids = prompt.encode("ascii"), answer.encode("ascii")
        else:  # prompt and answer apart, so the answer's first token never straddles the "="
            prompt_ids, answer_ids = encode(prompt), encode(answer)
        size = len(prompt_ids) + len(answer_ids)
        if used + size > row_length:
            # The row is full; an example that does not fit is dropped whole, never cut.
            break
        tokens[used : used + len(prompt_ids)] = np.frombuffer(prompt_ids, dtype=np.uint8) if encode is None else prompt_ids
        answer_start = used + len(prompt_ids)
        tokens[answer_start : used + size] = np.frombuffer(answer_ids, dtype=np.uint8) if encode is None else answer_ids
        # Target t is tokens[t + 1]: the answer tokens at [start, end) are targets [start - 1, end - 1).
        loss_mask[answer_start - 1 : used + size - 1] = True
        used += size
    return tokens, loss_mask


# --- "grammar": a small probabilistic English-like grammar (~300 words) ---------------------------
# Subject-verb agreement, tense, a/an, plural spelling and capitalisation give the model real
# structure to learn at every scale, from spelling to clause order.


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NAMES = _words(
    "Alice Bob Carol Dave Eve Frank Grace Heidi Ivan Judy Oscar Peggy Victor Walter Nora Liam Emma "
    "Olivia Noah Mia Lucas Zoe Hugo Iris Leo Maya Omar Rosa Sam Tara"
)
_NOUNS = _words(
    "cat dog bird fox horse cow sheep fish mouse wolf bear rabbit frog snake lion tiger duck goat "
    "child man woman person teacher doctor farmer baker painter sailor king queen student friend "
    "neighbor driver singer artist apple orange banana cake bread cookie egg lemon cherry carrot "
    "potato tomato box bag book letter story song picture map key door window table chair bed lamp "
    "clock cup bottle glass knife spoon plate bowl ball kite boat car bus train bicycle house garden "
    "river lake hill mountain forest tree flower leaf stone road bridge city village market school "
    "library kitchen castle island cloud star moon coin ring hat coat shoe"
)
_IRREGULAR_PLURALS = {
    "sheep": "sheep", "fish": "fish", "mouse": "mice", "wolf": "wolves", "child": "children",
    "man": "men", "woman": "women", "person": "people", "leaf": "leaves", "knife": "knives",
    "potato": "potatoes", "tomato": "tomatoes",
}  # fmt: skip
_ADJECTIVES = _words(
    "big small tall short old young new happy sad angry calm brave quiet loud fast slow warm cold "
    "hot wet dry clean dirty bright dark heavy light soft hard red blue green yellow black white "
    "brown purple golden silver round square strange famous hungry tired clever kind gentle wild "
    "busy lazy rich poor tiny huge lucky shy proud curious sleepy noisy shiny empty full sweet"
)
_TRANSITIVE = _words(
    "see like find take make hold carry watch follow chase build paint open close push pull read "
    "write draw fix wash cook eat visit help call teach bring sell buy keep miss need want love "
    "catch throw hide clean"
)
_INTRANSITIVE = _words(
    "sleep run walk smile laugh wait sing dance swim jump rest work play shine grow fall sit stand "
    "listen talk"
)
_IRREGULAR_PAST = {
    "see": "saw", "find": "found", "take": "took", "make": "made", "hold": "held", "build": "built",
    "read": "read", "write": "wrote", "draw": "drew", "eat": "ate", "teach": "taught",
    "bring": "brought", "sell": "sold", "buy": "bought", "keep": "kept", "catch": "caught",
    "throw": "threw", "hide": "hid", "sleep": "slept", "run": "ran", "sing": "sang", "swim": "swam",
    "shine": "shone", "grow": "grew", "fall": "fell", "sit": "sat", "stand": "stood",
}  # fmt: skip
_ADVERBS = _words(
    "quickly slowly quietly loudly happily sadly carefully often rarely always never today "
    "yesterday again soon together alone early late gladly suddenly gently badly well"
)
_PLACES = _words("in on under near behind above beside across through over")
_CONJUNCTIONS = ("and", "but", "because", "while", "so", "when")
_SINGULAR_DETERMINERS = ("the", "the", "a", "this", "that", "every", "my", "our")
_PLURAL_DETERMINERS = ("the", "the", "some", "these", "those", "many", "few", "all", "my", "our")
_NUMBER_WORDS = ("two", "three", "four", "five", "six", "seven", "ten", "twelve")
_VOWELS = frozenset("aeiou")


def _plural(noun: str) -> str:
    if noun in _IRREGULAR_PLURALS:
        return _IRREGULAR_PLURALS[noun]
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in _VOWELS:
        return noun[:-1] + "ies"
    return noun + "s"


def _third_person(verb: str) -> str:
    if verb.endswith(("s", "x", "ch", "sh", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in _VOWELS:
        return verb[:-1] + "ies"
    return verb + "s"


def _past(verb: str) -> str:
    if verb in _IRREGULAR_PAST:
        return _IRREGULAR_PAST[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in _VOWELS:
        return verb[:-1] + "ied"
    if verb in ("stop", "hop", "jog"):
        return verb + verb[-1] + "ed"
    return verb + "ed"


# Spelled forms precomputed once: generating a row is then only choices and joins.
_NOUN_FORMS = tuple((noun, _plural(noun)) for noun in _NOUNS)
_VERB_FORMS = {verb: (verb, _third_person(verb), _past(verb)) for verb in _TRANSITIVE + _INTRANSITIVE}


def _noun_phrase(draws: Draws, plural: bool, depth: int = 0) -> str:
    if not plural and draws.chance(0.15):
        return draws.choice(_NAMES)
    noun = draws.choice(_NOUN_FORMS)[1 if plural else 0]
    words = [draws.choice(_ADJECTIVES) for _ in range(draws.choice((0, 0, 1, 1, 2)))]
    words.append(noun)
    if plural:
        roll = draws.uniform()
        if roll < 0.25:
            words.insert(0, str(draws.between(2, 99)))
        elif roll < 0.4:
            words.insert(0, draws.choice(_NUMBER_WORDS))
        else:
            words.insert(0, draws.choice(_PLURAL_DETERMINERS))
    else:
        determiner = draws.choice(_SINGULAR_DETERMINERS)
        if determiner == "a" and words[0][0] in _VOWELS:
            determiner = "an"
        words.insert(0, determiner)
    if depth == 0 and draws.chance(0.12):
        words += ["with", _noun_phrase(draws, draws.chance(0.4), depth + 1)]
    return " ".join(words)


def _clause(draws: Draws) -> str:
    plural = draws.chance(0.35)
    subject = _noun_phrase(draws, plural)
    past = draws.chance(0.4)
    transitive = draws.chance(0.65)
    base, singular, past_form = _VERB_FORMS[draws.choice(_TRANSITIVE if transitive else _INTRANSITIVE)]
    parts = [subject, past_form if past else (base if plural else singular)]
    if transitive:
        parts.append(_noun_phrase(draws, draws.chance(0.35)))
    elif draws.chance(0.5):
        parts.append(draws.choice(_ADVERBS))
    if draws.chance(0.3):
        parts += [draws.choice(_PLACES), _noun_phrase(draws, draws.chance(0.3), depth=1)]
    return " ".join(parts)


def _sentence(draws: Draws) -> str:
    roll = draws.uniform()
    if roll < 0.45:
        text = _clause(draws) + "."
    elif roll < 0.65:
        text = f"{_clause(draws)}, {draws.choice(_CONJUNCTIONS)} {_clause(draws)}."
    elif roll < 0.75:
        place = f"{draws.choice(_PLACES)} {_noun_phrase(draws, draws.chance(0.3), depth=1)}"
        if draws.chance(0.3):
            place = f"in {draws.between(1800, 2030)}"
        text = f"{place}, {_clause(draws)}."
    elif roll < 0.85:
        plural = draws.chance(0.35)
        auxiliary = "did" if draws.chance(0.5) else ("do" if plural else "does")
        verb = draws.choice(_TRANSITIVE)
        text = f"{auxiliary} {_noun_phrase(draws, plural)} {verb} {_noun_phrase(draws, draws.chance(0.35))}?"
    elif roll < 0.95:
        count = draws.between(2, 99)
        noun = draws.choice(_NOUN_FORMS)[1]
        text = f"there are {count} {noun} {draws.choice(_PLACES)} {_noun_phrase(draws, False, depth=1)}."
    else:
        text = f'{draws.choice(_NAMES)} said, "{_clause(draws)}."'
    return text[0].upper() + text[1:]


def grammar_text(draws: Draws, min_length: int) -> str:
    """Sentences separated by spaces until the text has at least `min_length` characters."""
    sentences: list[str] = []
    length = -1
    while length < min_length:
        sentence = _sentence(draws)
        sentences.append(sentence)
        length += len(sentence) + 1
    return " ".join(sentences)


def _grammar_row(split: str, draws: Draws, row_length: int, encode: Encoder | None) -> tuple[np.ndarray, np.ndarray]:
    del split  # grammar splits differ by their generator key only (text is practically never repeated)
    if encode is None:
        encoded = grammar_text(draws, row_length).encode("ascii")[:row_length]
        return np.frombuffer(encoded, dtype=np.uint8).astype(np.int64), np.ones(row_length - 1, dtype=bool)
    # A tokenizer packs several characters per token: more sentences until the row is full.
    ids = encode(grammar_text(draws, row_length))
    while len(ids) < row_length:
        ids = ids + encode(" " + grammar_text(draws, row_length))
    return np.asarray(ids[:row_length], dtype=np.int64), np.ones(row_length - 1, dtype=bool)


def task_sample(
    name: str, split: str, index: int, block_size: int, encode: Encoder | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Row `index` of the built-in dataset `name`: (tokens int64 (block_size+1,), loss_mask bool (block_size,)).
    `encode`: the run's tokenizer (None: byte level). A tokenizer never makes more tokens than a text has
    bytes (byte-level BPE merges bytes), so the byte-level minimum block size still holds an example."""
    if not 0 <= index < _SPLIT_SIZES[name][split]:
        raise IndexError(f"{name}/{split}: index {index} out of range [0, {_SPLIT_SIZES[name][split]})")
    if block_size < min_block_size(name):
        raise ValueError(f"{name}: block_size {block_size} is below the minimum {min_block_size(name)}")
    draws = Draws(numpy_rng(TASK_SEED, name, split, int(index), block_size))
    if name == "grammar":
        return _grammar_row(split, draws, block_size + 1, encode)
    return _packed_examples(name, split, draws, block_size + 1, encode)

