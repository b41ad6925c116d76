"""Post-training examples by dataset name and by (split, index): what a stage's data cursor reads.

- `ExampleSources`: the examples the post-training stages read, by dataset name: an embedded task's (made
  on demand) or a jsonl / parquet dataset's, tokenised with the run's tokenizer, prompt and responses apart
  (rewind.engine.data.examples); `mixture_rows` reads a stage's share of them at its cursors.
- `TaskRows`: one kind of example of an embedded task, made on demand; every index of the task's splits.
- `FileRows`: examples read from files; the validation examples from files of their own, or carved out of
  the train files' examples by rewind.engine.data.tokens.RowSplit as a prompt/response dataset's examples
  are (rewind.engine.data.userdata: "random" or "tail", the same fraction), so the same files and settings
  give the same two splits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Generic, Literal, TypeVar

import numpy as np

from rewind.engine.data.cursors import sample_indices, split_rows
from rewind.engine.data.datasets import DatasetError
from rewind.engine.data.documents import DocumentError, expand_inputs
from rewind.engine.data.examples import (
    ANSWER_FIELD,
    PreferenceRow,
    PromptRow,
    SftRow,
    end_token,
    read_preference_rows,
    read_prompt_rows,
    read_sft_rows,
    task_preference_row,
    task_prompt_row,
    task_sft_row,
)
from rewind.engine.data.tasks import SPLITS, Encoder, num_task_samples
from rewind.engine.data.tokens import RowSplit
from rewind.engine.data.userdata import DataHome
from rewind.states.config import Config, Stage

RowKind = Literal["sft", "preference", "prompt"]
Row = TypeVar("Row", SftRow, PreferenceRow, PromptRow)
_TASK_ROWS = {"sft": task_sft_row, "preference": task_preference_row, "prompt": task_prompt_row}


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (expected one of {', '.join(SPLITS)})")


class TaskRows:
    """Examples of `kind` of the embedded task `name`, tokenised by `encode` (None: UTF-8 bytes)."""

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
    """Examples held in memory: `train`, and `validation` when given, else carved from `train` by RowSplit
    (`mode` "random" or "tail", `fraction` of the examples to validation)."""

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


# The example kind each reading of rewind.states.stagekinds opens.
_READ_AS: dict[str, RowKind] = {"examples": "sft", "preferences": "preference", "prompts": "prompt"}


class ExampleSources:
    """The examples the post-training stages read, by dataset name and kind (an sft stage's
    prompt/response examples, a dpo stage's prompt/chosen/rejected ones, a grpo stage's prompts with their
    answers), opened on first use and kept."""

    def __init__(self, config: Config, home: DataHome):
        self.config, self.home = config, home
        self._opened: dict[tuple[str, RowKind], TaskRows | FileRows] = {}

    def sft(self, name: str) -> TaskRows | FileRows[SftRow]:
        return self.rows_of(name, "sft")

    def preferences(self, name: str) -> TaskRows | FileRows[PreferenceRow]:
        return self.rows_of(name, "preference")

    def prompts(self, name: str) -> TaskRows | FileRows[PromptRow]:
        return self.rows_of(name, "prompt")

    def of_kind(self, reads: str, name: str) -> TaskRows | FileRows:
        """Dataset `name`'s examples of the kind a stage kind reads (rewind.states.stagekinds: "examples",
        "preferences" or "prompts")."""
        return self.rows_of(name, _READ_AS[reads])

    def answer(self, name: str, row: PromptRow) -> str:
        """The answer a grpo stage's exact_match reward compares `row`'s completions with."""
        source = self.config.data.get(name)
        return row.fields[ANSWER_FIELD if source is None else source.answer_field]

    def reshuffles(self, name: str) -> bool:
        source = self.config.data.get(name)
        return source is None or source.on_epoch_end == "reshuffle"

    @property
    def end_id(self) -> int:
        return end_token(self.home.tokenizer)

    @property
    def pad_id(self) -> int:
        return self.home.tokenizer.pad_id

    def rows_of(self, name: str, kind: RowKind) -> TaskRows | FileRows:
        if (name, kind) not in self._opened:
            self._opened[name, kind] = self._open(name, kind)
        return self._opened[name, kind]

    def _open(self, name: str, kind: RowKind) -> TaskRows | FileRows:
        tokenizer = self.home.tokenizer
        encode = tokenizer.encode if tokenizer.identity else None  # byte level: the tasks' own ids
        source = self.config.data.get(name)
        if source is None:
            return TaskRows(name, kind, encode)
        if kind == "sft":
            fields = {"prompt_field": source.prompt_field, "response_field": source.response_field}
            read = read_sft_rows
        elif kind == "prompt":
            fields = {"prompt_field": source.prompt_field, "fields": (source.answer_field,)}
            read = read_prompt_rows
        else:
            fields = {f: getattr(source, f) for f in ("prompt_field", "chosen_field", "rejected_field")}
            read = read_preference_rows
        fields["end_id"] = self.end_id  # refused inside a response or an answer
        try:
            train = read(expand_inputs(self.home.resolve(source.path)), source.kind, encode, **fields)
            validation = None
            if source.validation_path:
                paths = expand_inputs(self.home.resolve(source.validation_path))
                validation = read(paths, source.kind, encode, **fields)
        except DocumentError as exc:
            raise DatasetError(f"dataset {name!r}: {exc}") from None
        mode = source.split or self.home.default_split
        return FileRows(train, validation, mode=mode, fraction=source.validation_fraction)


def mixture_rows(
    seed: int, stage: Stage, count: int, cursors: Mapping[str, int], examples: ExampleSources, kind: RowKind
) -> tuple[list[tuple[int, int, Row]], dict[str, int]]:
    """`count` examples of `kind` split over the stage's mixture (rewind.engine.data.cursors.split_rows), each
    dataset's share read at its cursor through its keyed permutation: (index in the mixture, row index,
    row) in mixture order, and the cursors after."""
    after, read = dict(cursors), []
    for s, (sampling, share) in enumerate(zip(stage.datasets, split_rows(stage.datasets, count), strict=True)):
        if share == 0:
            continue
        name, source = sampling.name, examples.rows_of(sampling.name, kind)
        start = after.get(name, 0)
        indices = sample_indices(seed, name, source.num_rows("train"), start, share, reshuffle=examples.reshuffles(name))
        read += [(s, int(i), source.row("train", int(i))) for i in indices.tolist()]
        after[name] = start + share
    return read, after
