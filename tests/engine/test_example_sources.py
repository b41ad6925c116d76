"""Post-training examples by (split, index): the embedded tasks' and examples read from files, with validation
examples carved as a prompt/response dataset's are."""

from __future__ import annotations

import numpy as np
import pytest

from rewind.engine.data.example_sources import FileRows, TaskRows
from rewind.engine.data.examples import SftRow, task_preference_row, task_prompt_row, task_sft_row
from rewind.engine.data.tasks import num_task_samples
from rewind.engine.data.tokens import RowSplit


def test_task_rows_are_the_task_row_functions_by_split_and_index():
    assert TaskRows("add", "sft").row("train", 4) == task_sft_row("add", "train", 4)
    assert TaskRows("sort", "preference").row("validation", 2) == task_preference_row("sort", "validation", 2)
    encode = lambda text: [ord(c) + 1 for c in text]  # noqa: E731
    assert TaskRows("reverse", "prompt", encode).row("train", 9) == task_prompt_row(
        "reverse", "train", 9, encode
    )
    assert TaskRows("add", "sft").num_rows("validation") == num_task_samples("add", "validation")
    with pytest.raises(ValueError, match="unknown row kind"):
        TaskRows("add", "rl")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown split"):
        TaskRows("add", "sft").num_rows("test")


ROWS = [SftRow((i + 1,), (i,)) for i in range(40)]


@pytest.mark.parametrize("mode", ["random", "tail"])
def test_validation_rows_are_carved_like_a_pair_datasets(mode):
    rows = FileRows(ROWS, mode=mode, fraction=0.1)
    train = [rows.row("train", i) for i in range(rows.num_rows("train"))]
    validation = [rows.row("validation", i) for i in range(rows.num_rows("validation"))]
    assert len(validation) == 4 and sorted(train + validation, key=lambda r: r.prompt) == ROWS
    carve = RowSplit(
        len(ROWS), mode, 0.1
    )  # what rewind.engine.data.userdata carves a pair dataset's examples with
    assert validation == [ROWS[i] for i in carve.rows("validation", np.arange(4)).tolist()]
    if mode == "tail":
        assert validation == ROWS[-4:]
    else:
        assert validation != ROWS[-4:] and validation != ROWS[:4]  # (a fixed pseudo-random choice)
    assert [FileRows(ROWS, mode=mode, fraction=0.1).row("validation", i) for i in range(4)] == validation


def test_validation_rows_of_their_own_and_indices_are_checked():
    rows = FileRows(ROWS[:30], ROWS[30:])
    assert rows.num_rows("train") == 30 and rows.row("validation", 0) == ROWS[30]
    with pytest.raises(IndexError, match="validation row 10 out of range"):
        rows.row("validation", 10)
    with pytest.raises(ValueError, match="carved 'random' or 'tail'"):
        FileRows(ROWS, mode="file")
