"""Post-training rows of the embedded tasks: right answers, corrupted ones that never equal them, the same
row for the same index in every process, and the exact-match reward."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.engine.data.rows import PromptRow, SftRow
from rewind.engine.data.task_rows import (
    ANSWER_FIELD,
    POSTTRAIN_TASKS,
    exact_match_reward,
    exact_match_rewards,
    task_preference_row,
    task_prompt_row,
    task_sft_row,
    task_texts,
)
from rewind.engine.data.tasks import SPLITS, num_task_samples
from rewind.engine.data.tokenizer import train_bpe


def solved(prompt: str) -> str:
    """The right answer to a task prompt, worked out here."""
    verb, given_input = prompt.removesuffix("=").split(" ", 1)
    if verb == "add":
        a, b = given_input.split("+")
        return str(int(a) + int(b))
    return given_input[::-1] if verb == "rev" else "".join(sorted(given_input))


indices = st.tuples(st.sampled_from(POSTTRAIN_TASKS), st.sampled_from(SPLITS), st.integers(0, 255))


@settings(max_examples=300, deadline=None)
@given(indices)
def test_answers_are_right_and_corrupted_ones_wrong(where):
    name, split, index = where
    texts = task_texts(name, split, index)
    assert texts.answer == solved(texts.prompt)
    assert texts.wrong != texts.answer
    if name == "add":
        assert texts.wrong.isdigit() and 1 <= abs(int(texts.wrong) - int(texts.answer)) <= 10
    else:  # one letter replaced by another
        assert len(texts.wrong) == len(texts.answer) and texts.wrong.isalpha() and texts.wrong.islower()
        assert sum(a != b for a, b in zip(texts.wrong, texts.answer, strict=True)) == 1
    pair = task_preference_row(name, split, index)
    assert pair.chosen == tuple(texts.answer.encode()) and pair.rejected == tuple(texts.wrong.encode())


def test_byte_level_rows_are_the_tasks_text_with_the_newline_as_end_token():
    row = task_sft_row("add", "train", 7)
    texts = task_texts("add", "train", 7)
    # The end token of UTF-8 bytes is "\n" (rewind.engine.data.rows.end_token): prompt + response + end is the task's line.
    assert bytes([*row.prompt, *row.response, 10]).decode() == f"{texts.prompt}{texts.answer}\n"
    prompt = task_prompt_row("sort", "validation", 3)
    assert prompt == PromptRow(3, tuple(task_texts("sort", "validation", 3).prompt.encode()),
                               task_texts("sort", "validation", 3).prompt,
                               {ANSWER_FIELD: task_texts("sort", "validation", 3).answer})  # fmt: skip


def test_a_tokenizer_encodes_prompt_and_answer_apart():
    bpe = train_bpe([" ".join(f"rev {w}={w[::-1]}" for w in ("abc", "xyz", "then")) * 30], 300)
    texts = task_texts("reverse", "train", 0)
    row = task_sft_row("reverse", "train", 0, bpe.encode)
    assert row == SftRow(tuple(bpe.encode(texts.prompt)), tuple(bpe.encode(texts.answer)))


def test_train_and_validation_prompts_differ_and_indices_are_checked():
    train = {task_texts("add", "train", i).prompt for i in range(300)}
    validation = {
        task_texts("add", "validation", i).prompt for i in range(num_task_samples("add", "validation"))
    }
    assert not train & validation
    with pytest.raises(IndexError, match="out of range"):
        task_texts("add", "validation", num_task_samples("add", "validation"))
    with pytest.raises(ValueError, match="no answers"):
        task_texts("grammar", "train", 0)
    with pytest.raises(ValueError, match="unknown split"):
        task_texts("add", "test", 0)


def test_the_same_index_gives_the_same_row_in_another_process():
    code = (
        "from rewind.engine.data.task_rows import task_texts\n"
        "print([tuple(task_texts(n, s, i)) for n in ('reverse', 'sort', 'add') for s in ('train', 'validation')"
        " for i in (0, 5, 99)])"
    )
    here = [tuple(task_texts(n, s, i)) for n in POSTTRAIN_TASKS for s in SPLITS for i in (0, 5, 99)]
    assert [tuple(task_texts(n, s, i)) for n in POSTTRAIN_TASKS for s in SPLITS for i in (0, 5, 99)] == here
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert there.strip() == repr(here)


def test_exact_match_compares_the_first_line_with_the_answer():
    assert exact_match_reward("15", "15") == 1.0
    assert exact_match_reward("15\nadd 1+2=3\n", "15") == 1.0  # the first line only
    assert exact_match_reward("15", "15\n") == 1.0  # an answer's final newline is not part of it
    assert exact_match_reward("15\n", "15\n") == 1.0
    assert exact_match_reward(" 15", "15") == 0.0 and exact_match_reward("15 ", "15") == 0.0
    assert exact_match_reward("1", "15") == 0.0 and exact_match_reward("", "15") == 0.0
    assert exact_match_reward("ABC", "abc") == 0.0
    rewards = exact_match_rewards(["p", "p"], ["ba\n", "ab"], [[1], [2]], answer=["ba", "ba"], hint=["", ""])
    assert rewards == [1.0, 0.0]
    with pytest.raises(ValueError):
        exact_match_rewards(["p"], ["ba"], [[1]], answer=["ba", "ab"])
