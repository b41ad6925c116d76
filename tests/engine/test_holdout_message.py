"""A dataset too small to hold out any validation row says how many rows its validation_fraction needs (or
the other ways out), for each kind of dataset: rows (sft, dpo, grpo jsonl) and token files.
docs/posttraining.md's three-row example met "no validation examples" with no way forward."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rewind.engine.data.datasets import DatasetError
from rewind.engine.data.registry import open_dataset
from rewind.engine.data.tokens import RowSplit, holdout_problem
from rewind.states.config import DataSource
from tests.engine.test_datasets import TAIL, make_config, write_tokens


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.07, 0.1, 0.3, 0.333, 0.5, 0.9])
def test_the_rows_it_names_are_the_fewest_that_hold_one_out(fraction):
    said = holdout_problem(1, fraction)
    needed = int(said.split("it needs at least ")[1].split(" ")[0]) if said else 1
    assert RowSplit(needed, "tail", fraction).num_validation == 1
    assert needed == 1 or RowSplit(needed - 1, "tail", fraction).num_validation == 0
    assert holdout_problem(needed, fraction) == "" and (needed == 1 or holdout_problem(needed - 1, fraction))
    for rows in range(1, needed):
        larger = holdout_problem(rows, fraction).partition("a validation_fraction of at least ")[2]
        assert not larger or RowSplit(rows, "tail", float(larger), 0).num_validation >= 1


def test_what_it_says():
    assert holdout_problem(3, 0.05) == (
        "3 rows with validation_fraction 0.05 hold out none for validation: it needs at least 20 rows, "
        "or a validation_path, or a validation_fraction of at least 0.34"
    )
    assert holdout_problem(1, 0.5) == (
        "1 row with validation_fraction 0.5 holds out none for validation: it needs at least 2 rows, "
        "or a validation_path"
    )


def _jsonl(path, rows: int) -> str:
    path.write_text("".join(json.dumps({"q": f"q{i}", "a": f"a{i}", "b": f"b{i}"}) + "\n" for i in range(rows)))
    return str(path)


@pytest.mark.parametrize(
    "fields",
    [
        {"response_field": "a"},  # sft
        {"chosen_field": "a", "rejected_field": "b"},  # dpo
        {"answer_field": "a"},  # grpo
    ],
)
def test_rows_too_few_to_hold_one_out(tmp_path, fields):
    source = DataSource(kind="jsonl", path=_jsonl(tmp_path / "qa.jsonl", 3), prompt_field="q", **fields)
    with pytest.raises(DatasetError) as raised:
        open_dataset("qa", make_config(qa=source), TAIL)
    assert str(raised.value) == f"dataset 'qa': {tmp_path / 'qa.jsonl'}: too small: {holdout_problem(3, 0.05)}"


def test_a_token_file_too_small_to_hold_a_window_out(tmp_path):
    write_tokens(tmp_path / "t.bin", np.arange(9 * 10))  # 10 windows of 9 tokens
    source = DataSource(kind="tokens", path=str(tmp_path / "t.bin"), validation_fraction=0.05)
    with pytest.raises(DatasetError) as raised:
        open_dataset("toks", make_config(8, 256, toks=source), TAIL)
    assert str(raised.value).endswith(
        "leaving 10 for train and 0 for validation (10 windows with validation_fraction 0.05 hold out none for "
        "validation: it needs at least 20 windows, or a validation_path, or a validation_fraction of at least 0.1)"
    )
