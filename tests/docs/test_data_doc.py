"""docs/data.md's built-in tasks are what the code generates: the packed pretraining rows it draws (text and
loss mask), the post-training rows of its table (prompt, answer, rejected), the validation examples and the
split sizes it quotes are made again here from rewind.engine.data.tasks and rewind.engine.data.examples."""

from __future__ import annotations

import re

from rewind.engine.data.examples import task_texts
from rewind.engine.data.tasks import TASK_NAMES, num_task_samples, task_sample
from tests.conftest import REPO

DOC = REPO / "docs" / "data.md"
BLOCK_SIZE = 48  # the page's rows


def section() -> str:
    text = DOC.read_text()
    return text[text.index("## The built-in tasks") : text.index("## Kinds")]


def rendered_row(task: str) -> str:
    """Train row 0 as the page draws it: the bytes (a newline as ⏎, the padding byte 0 as ·), then a ^
    under every character a target of the loss (target t is token t + 1)."""
    tokens, mask = task_sample(task, "train", 0, BLOCK_SIZE)
    text = "".join("⏎" if b == 10 else "·" if b == 0 else chr(b) for b in tokens.tolist())
    marks = "".join("^" if j > 0 and mask[j - 1] else " " for j in range(len(tokens))).rstrip()
    return f"{task}\n{text}\n{marks}\n"


def test_the_packed_rows_are_the_tasks_first_train_rows():
    (block,) = re.findall(r"```text\n(.*?)```", section(), re.S)
    assert f"`block_size = {BLOCK_SIZE}`" in section()
    assert block == "".join(rendered_row(task) for task in TASK_NAMES)


def test_the_post_training_table_is_the_tasks_rows():
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| `([^`]*)` \| `([^`]*)` \| `([^`]*)` \|$", section(), re.M)
    assert {task for task, *_ in rows} == {"reverse", "sort", "add"} and len(rows) == 6
    for task, index, prompt, answer, wrong in rows:
        assert task_texts(task, "train", int(index)) == (prompt, answer, wrong)


def test_the_task_table_s_example_is_each_task_s_first_train_row_and_the_sizes_are_the_splits():
    lines = [line for line in section().splitlines() if re.match(r"\| `\w+` \| [^0-9]", line)]
    cells = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    assert [row[0] for row in cells] == [f"`{task}`" for task in TASK_NAMES]
    sizes = {"2**20": 2**20, "2**31 - 1": 2**31 - 1}
    for (_, prompt, answer, _, splits), name in zip(cells, TASK_NAMES, strict=True):
        train, validation = splits.split(" / ")
        assert (sizes[train], int(validation)) == (
            num_task_samples(name, "train"),
            num_task_samples(name, "validation"),
        )
        if name != "grammar":
            assert (prompt, answer) == tuple(f"`{t}`" for t in task_texts(name, "train", 0)[:2])


def test_the_validation_examples_are_each_task_s_row_0():
    quoted = re.findall(r"`((?:rev|sort|add) [^`]*=)`\s*\n?-> `([^`]*)`", section())
    assert len(quoted) == 3
    for prompt, answer in quoted:
        task = {"rev": "reverse", "sort": "sort", "add": "add"}[prompt.split()[0]]
        assert task_texts(task, "validation", 0)[:2] == (prompt, answer)


def test_the_quoted_ranges_are_the_generator_s():
    from rewind.engine.data import examples, tasks
    text = " ".join(section().split())
    letters = f"{tasks._MIN_LETTERS} to {tasks._MAX_LETTERS} lowercase letters"
    assert text.count(letters) == 2
    assert f"two numbers of 1 to {tasks._MAX_DIGITS} digits" in text
    assert f"1 in {2**tasks._VALIDATION_SHARE_BITS} to validation" in text
    assert f"a sum off by 1 to {examples._MAX_MISS})" in text
