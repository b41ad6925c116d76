"""Post-training rows from the embedded tasks ("reverse", "sort", "add" of rewind.engine.data.tasks), so that every
strategy runs without data files: SFT rows are a task's prompt and answer, preference rows its answer
(chosen) against a corrupted one (rejected), prompt rows its prompt with the answer for the exact-match
reward.

Row `index` of a split is a function of (task, split, index) only, drawn from a generator keyed by the
tasks' fixed TASK_SEED and this module's purpose, never from global or carried RNG state; its input belongs
to the split as tasks.task_sample's do (a hash of the input decides), so validation prompts are never
trained on. The answer is the task's without its "\\n": the end token (rewind.engine.data.rows.end_token) ends
it, which for UTF-8 bytes is that same "\\n", so the tokens are those of the task's text.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from types import MappingProxyType
from typing import NamedTuple

from rewind.engine.data.rows import PreferenceRow, PromptRow, SftRow, encode_text
from rewind.engine.data.tasks import SPLITS, TASK_SEED, Draws, Encoder, num_task_samples, split_example
from rewind.engine.model.rng import numpy_rng

POSTTRAIN_TASKS: tuple[str, ...] = ("reverse", "sort", "add")
ANSWER_FIELD = "answer"  # the prompt-row field the exact-match reward compares with
_MAX_MISS = 10  # a corrupted sum is off by 1 to this much


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
