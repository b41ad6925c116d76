"""Post-training examples as token ids, and how they are made: from the embedded tasks and from a user's
JSONL / Parquet files.

An *example* is one post-training record; a *row* is one line of tokens a step trains on (examples are laid
into rows by rewind.engine.data.example_batches). Three kinds: a prompt and its response (`SftRow`, SFT), a
prompt with a chosen and a rejected response (`PreferenceRow`, DPO), and a prompt with the string fields its
reward functions take (`PromptRow`, GRPO). (The types keep their older names, ...Row.)

Prompt and response are tokenised apart and concatenated, never as one text: a tokenizer would otherwise
merge across the boundary ("the" + "n" into "then"), and the response's first token would not be one the
model ever samples after that prompt.

An example holds its texts' tokens only. What ends a response is one token (`end_token`): the tokenizer's
<|endoftext|>, or, for a tokenizer without one (UTF-8 bytes), "\\n", so that a response is one line there and
the sampler stops at the end of it. The rows (rewind.engine.data.example_batches) append it to every
response and put it in the loss.

The embedded tasks ("reverse", "sort", "add" of rewind.engine.data.tasks) give examples of every kind, so
that every strategy runs without data files: an SFT example is a task's prompt and answer, a preference
example its answer (chosen) against a corrupted one (rejected), a prompt example its prompt with the answer
for the exact-match reward. Example `index` of a split is a function of (task, split, index) only, drawn
from a generator keyed by the tasks' fixed TASK_SEED and this module's purpose, never from global or
carried RNG state; its input belongs to the split as tasks.task_sample's do (a hash of the input decides),
so validation prompts are never trained on. The answer is the task's without its "\\n": the end token ends
it, which for UTF-8 bytes is that same "\\n", so the tokens are those of the task's text.

A user's files (rewind.engine.data.documents reads them) are tokenised by the run's tokenizer (their
identity goes on record as the dataset's: rewind.engine.data.userdata). Every field read must be a string,
in every record; a record that breaks that, or whose prompt is empty, or whose chosen and rejected responses
are the same tokens, is a DocumentError of one line naming its file and line (jsonl, from 1) or row
(parquet, from 0). Examples come in the order of `paths` (the sorted matches of a glob:
rewind.engine.data.documents.expand_inputs), then of the records in each file.
"""

from __future__ import annotations

import string
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from rewind.engine.data.documents import DocumentError, iter_rows
from rewind.engine.data.tasks import SPLITS, TASK_SEED, Draws, Encoder, num_task_samples, split_example
from rewind.engine.data.tokenizer import TextTokenizer, TokenizerError
from rewind.engine.model.rng import numpy_rng

Tokens = tuple[int, ...]
POSTTRAIN_TASKS: tuple[str, ...] = ("reverse", "sort", "add")
ANSWER_FIELD = "answer"  # the prompt-row field the exact-match reward compares with
_MAX_MISS = 10  # a corrupted sum is off by 1 to this much


def _check_prompt(prompt: Tokens) -> None:
    # The first response token is predicted from the prompt's last one: without a prompt it has no context.
    if not prompt:
        raise ValueError("a row's prompt holds no token")


@dataclass(frozen=True)
class SftRow:
    """A prompt and the response the model learns to give (without the end token)."""

    prompt: Tokens
    response: Tokens

    def __post_init__(self) -> None:
        _check_prompt(self.prompt)


@dataclass(frozen=True)
class PreferenceRow:
    """A prompt, the response preferred (`chosen`) and the one not (`rejected`); the two differ."""

    prompt: Tokens
    chosen: Tokens
    rejected: Tokens

    def __post_init__(self) -> None:
        _check_prompt(self.prompt)
        if self.chosen == self.rejected:
            raise ValueError("a preference row's chosen and rejected responses are the same")


@dataclass(frozen=True)
class PromptRow:
    """A prompt to sample completions for: `prompt_id` (its index in its source: what the sampling randomness
    and the record name it by), its tokens, its text and the string fields reward functions take (an
    "answer", ...), read-only."""

    prompt_id: int
    prompt: Tokens
    text: str
    fields: Mapping[str, str]

    def __post_init__(self) -> None:
        _check_prompt(self.prompt)


def encode_text(text: str, encode: Encoder | None) -> Tokens:
    """The token ids of `text`: `encode` (the run's tokenizer), or its UTF-8 bytes when None."""
    return tuple(text.encode("utf-8")) if encode is None else tuple(encode(text))


def end_token(tokenizer: TextTokenizer) -> int:
    """The token that ends every response: <|endoftext|> when the tokenizer has it, else its "\\n" (the
    byte 10 of UTF-8 bytes). TokenizerError when it has neither as one token."""
    if tokenizer.eos_id is not None:
        return tokenizer.eos_id
    newline = tokenizer.encode("\n")
    if len(newline) != 1:
        raise TokenizerError(
            "the tokenizer has no <|endoftext|> token and encodes '\\n' as "
            f"{len(newline)} tokens: post-training needs one token that ends a response"
        )
    return newline[0]


# --- the embedded tasks' examples -----------------------------------------------------------------------


class TaskTexts(NamedTuple):
    """One example's texts: the prompt ("add 12+5="), its answer ("17") and a wrong answer ("19")."""

    prompt: str
    answer: str
    wrong: str


def _corrupted(name: str, answer: str, draws: Draws) -> str:
    """A near miss, never the answer: a sum off by 1 to _MAX_MISS (upwards where downwards would go below
    zero), or one letter of the word replaced by another letter."""
    if name == "add":
        total, miss = int(answer), draws.between(1, _MAX_MISS)
        downwards = draws.chance(0.5) and total >= miss
        return str(total - miss if downwards else total + miss)
    letters = string.ascii_lowercase
    position = draws.below(len(answer))
    replaced = letters[(letters.index(answer[position]) + draws.between(1, len(letters) - 1)) % len(letters)]
    return answer[:position] + replaced + answer[position + 1 :]


def task_texts(name: str, split: str, index: int) -> TaskTexts:
    """The texts of row `index` of `split` of task `name` (one of POSTTRAIN_TASKS)."""
    if name not in POSTTRAIN_TASKS:
        raise ValueError(
            f"task {name!r} has no answers to post-train on (tasks with answers: {', '.join(POSTTRAIN_TASKS)})"
        )
    if split not in SPLITS:
        raise ValueError(f"{name}: unknown split {split!r} (expected one of {', '.join(SPLITS)})")
    if not 0 <= index < num_task_samples(name, split):
        raise IndexError(f"{name}/{split}: row {index} out of range [0, {num_task_samples(name, split)})")
    draws = Draws(numpy_rng(TASK_SEED, name, split, int(index), "posttrain row"))
    prompt, answer = split_example(name, split, draws)
    answer = answer.removesuffix("\n")
    return TaskTexts(prompt, answer, _corrupted(name, answer, draws))


def task_sft_row(name: str, split: str, index: int, encode: Encoder | None = None) -> SftRow:
    """The task's prompt and answer, tokenised apart (`encode`: the run's tokenizer; None: UTF-8 bytes)."""
    texts = task_texts(name, split, index)
    return SftRow(encode_text(texts.prompt, encode), encode_text(texts.answer, encode))


def task_preference_row(name: str, split: str, index: int, encode: Encoder | None = None) -> PreferenceRow:
    """The task's prompt, its answer (chosen) and a corrupted answer (rejected)."""
    texts = task_texts(name, split, index)
    return PreferenceRow(
        encode_text(texts.prompt, encode), encode_text(texts.answer, encode), encode_text(texts.wrong, encode)
    )


def task_prompt_row(name: str, split: str, index: int, encode: Encoder | None = None) -> PromptRow:
    """The task's prompt (prompt_id = `index`) with its answer under ANSWER_FIELD."""
    texts = task_texts(name, split, index)
    return PromptRow(
        index, encode_text(texts.prompt, encode), texts.prompt, MappingProxyType({ANSWER_FIELD: texts.answer})
    )


def exact_match_reward(completion: str, answer: str) -> float:
    """1.0 when the completion's first line equals the answer, else 0.0. The first line: the completion's
    text up to its first "\\n" (the tasks' end of an answer), all of it when it has none; `completion` is the
    decoded completion without its end token. The answer loses one final "\\n" if it has one. Nothing else
    is stripped or folded: a space or a letter's case makes a miss."""
    return 1.0 if completion.split("\n", 1)[0] == answer.removesuffix("\n") else 0.0


def exact_match_rewards(
    prompts: Sequence[str],
    completions: Sequence[str],
    completion_ids: Sequence[Sequence[int]],
    *,
    answer: Sequence[str],
    **row_fields: Sequence[str],
) -> list[float]:
    """`exact_match_reward` of each completion against its row's ANSWER_FIELD, with the signature every
    reward function has (the row fields come as one list per field, aligned with `completions`)."""
    del prompts, completion_ids, row_fields  # (what other reward functions read)
    return [
        exact_match_reward(completion, expected)
        for completion, expected in zip(completions, answer, strict=True)
    ]


# --- examples from a user's files -----------------------------------------------------------------------


def _encoded(place: str, field: str, text: str, encode: Encoder | None, end_id: int | None = None) -> Tokens:
    """`text`'s tokens; a response (`end_id` given) must not hold the token that ends one: with the
    byte-level tokenizer that is "\n", so a response is one line (training would teach the model to stop
    mid-response, and an answer with a line break could never be matched)."""
    try:
        tokens = encode_text(text, encode)
    except TokenizerError as exc:
        raise DocumentError(f"{place}: field {field!r}: {exc}") from None
    if end_id is not None and end_id in tokens:
        raise DocumentError(
            f"{place}: field {field!r} holds the token that ends a response (id {end_id}; with byte-level "
            "tokens, a line break): a response is one line"
        )
    return tokens


def _prompted_rows(
    paths: Sequence[str], kind: str, fields: tuple[str, ...], encode: Encoder | None
) -> Iterator[tuple[str, Tokens, tuple[str, ...]]]:
    """(place, prompt tokens, the texts of every field) of each row; fields[0] is the prompt."""
    for place, texts in iter_rows(paths, kind, fields):
        if not texts[0]:
            raise DocumentError(f"{place}: field {fields[0]!r} is empty")
        prompt = _encoded(place, fields[0], texts[0], encode)
        if not prompt:
            raise DocumentError(f"{place}: field {fields[0]!r} encodes to no token")
        yield place, prompt, texts


def read_sft_rows(
    paths: Sequence[str],
    kind: str,
    encode: Encoder | None = None,
    *,
    prompt_field: str = "prompt",
    response_field: str = "response",
    end_id: int | None = None,
) -> list[SftRow]:
    """The prompt/response rows of `paths` (kind "jsonl" or "parquet"). An empty response is a row (it
    teaches the end token after the prompt). `end_id`: the token that ends a response, refused inside one."""
    return [
        SftRow(prompt, _encoded(place, response_field, texts[1], encode, end_id))
        for place, prompt, texts in _prompted_rows(paths, kind, (prompt_field, response_field), encode)
    ]


def read_preference_rows(
    paths: Sequence[str],
    kind: str,
    encode: Encoder | None = None,
    *,
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
    end_id: int | None = None,
) -> list[PreferenceRow]:
    """The prompt/chosen/rejected rows of `paths` (kind "jsonl" or "parquet"); `end_id` as for sft rows."""
    rows = []
    for place, prompt, texts in _prompted_rows(
        paths, kind, (prompt_field, chosen_field, rejected_field), encode
    ):
        chosen = _encoded(place, chosen_field, texts[1], encode, end_id)
        rejected = _encoded(place, rejected_field, texts[2], encode, end_id)
        if chosen == rejected:  # (a preference between two equal responses says nothing)
            raise DocumentError(f"{place}: fields {chosen_field!r} and {rejected_field!r} are the same")
        rows.append(PreferenceRow(prompt, chosen, rejected))
    return rows


def read_prompt_rows(
    paths: Sequence[str],
    kind: str,
    encode: Encoder | None = None,
    *,
    prompt_field: str = "prompt",
    fields: Sequence[str] = (),
    end_id: int | None = None,
) -> list[PromptRow]:
    """The prompts of `paths` (kind "jsonl" or "parquet"), each with the string `fields` its reward functions
    take (the built-in exact match reads "answer": ANSWER_FIELD). prompt_id: the
    row's index among all the rows of `paths`, from 0. `end_id`: refused inside the first field (the answer:
    a completion ends at that token, so an answer holding it could never be matched)."""
    names = (prompt_field, *fields)
    rows = []
    for index, (place, prompt, texts) in enumerate(_prompted_rows(paths, kind, names, encode)):
        if fields:
            _encoded(place, fields[0], texts[1], encode, end_id)
        rows.append(PromptRow(index, prompt, texts[0], MappingProxyType(dict(zip(fields, texts[1:], strict=True)))))
    return rows
