"""Post-training rows by (split, index), wherever they come from: what a stage's data cursor reads.

- `TaskRows`: one kind of row of an embedded task (rewind.engine.data.task_rows), made on demand; every index of
  the task's splits.
- `FileRows`: rows read from files (rewind.engine.data.rowfiles); the validation rows from files of their own, or
  carved out of the train files' rows by rewind.engine.data.tokens.RowSplit as a prompt/response dataset's
  examples are (rewind.engine.data.userdata: "random" or "tail", the same fraction), so the same files and
  settings give the same two splits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Literal, TypeVar

import numpy as np

from rewind.engine.data.rows import PreferenceRow, PromptRow, SftRow
from rewind.engine.data.task_rows import task_preference_row, task_prompt_row, task_sft_row
from rewind.engine.data.tasks import SPLITS, Encoder, num_task_samples
from rewind.engine.data.tokens import RowSplit

RowKind = Literal["sft", "preference", "prompt"]
Row = TypeVar("Row", SftRow, PreferenceRow, PromptRow)
_TASK_ROWS = {"sft": task_sft_row, "preference": task_preference_row, "prompt": task_prompt_row}


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (expected one of {', '.join(SPLITS)})")


class TaskRows:
    """Rows of `kind` of the embedded task `name`, tokenised by `encode` (None: UTF-8 bytes)."""

    def __init__(self, name: str, kind: RowKind, encode: Encoder | None = None):
        if kind not in _TASK_ROWS:
            raise ValueError(f"unknown row kind {kind!r} (expected one of {', '.join(_TASK_ROWS)})")
        self.name, self.kind, self._encode = name, kind, encode
        self._make = _TASK_ROWS[kind]

    def num_rows(self, split: str) -> int:
        _check_split(split)
        return num_task_samples(self.name, split)

    def row(self, split: str, index: int) -> SftRow | PreferenceRow | PromptRow:
        return self._make(self.name, split, index, self._encode)


class FileRows(Generic[Row]):
    """Rows held in memory: `train`, and `validation` when given, else carved from `train` by RowSplit
    (`mode` "random" or "tail", `fraction` of the rows to validation)."""

    def __init__(
        self,
        train: Sequence[Row],
        validation: Sequence[Row] | None = None,
        *,
        mode: str = "random",
        fraction: float = 0.05,
    ):
        if validation is not None:
            self._rows = {"train": list(train), "validation": list(validation)}
            return
        if mode not in ("random", "tail"):
            raise ValueError(f"rows are carved 'random' or 'tail', not {mode!r} (or give validation rows)")
        carve = RowSplit(len(train), mode, fraction)
        self._rows = {
            split: [train[i] for i in carve.rows(split, np.arange(carve.count(split))).tolist()]
            for split in SPLITS
        }

    def num_rows(self, split: str) -> int:
        _check_split(split)
        return len(self._rows[split])

    def row(self, split: str, index: int) -> Row:
        if not 0 <= index < self.num_rows(split):
            raise IndexError(f"{split} row {index} out of range [0, {self.num_rows(split)})")
        return self._rows[split][index]
