"""The examples post-training stages read, by dataset name: an embedded task's (rewind.engine.data.task_rows,
made on demand) or a jsonl / parquet dataset's rows, tokenised with the run's tokenizer, prompt and
responses apart, the validation rows carved as the dataset's pair rows are (the same files and settings
give the same two splits)."""

from __future__ import annotations

from collections.abc import Mapping

from rewind.engine.data.cursors import sample_indices, split_rows
from rewind.engine.data.datasets import DatasetError
from rewind.engine.data.documents import DocumentError, expand_inputs
from rewind.engine.data.row_sources import FileRows, Row, RowKind, TaskRows
from rewind.engine.data.rowfiles import read_preference_rows, read_prompt_rows, read_sft_rows
from rewind.engine.data.rows import PreferenceRow, PromptRow, SftRow, end_token
from rewind.engine.data.task_rows import ANSWER_FIELD
from rewind.engine.data.userdata import DataHome
from rewind.states.config import Config, Stage


class ExampleSources:
    """The examples the post-training stages read, by dataset name and kind (an sft stage's
    prompt/response rows, a dpo stage's prompt/chosen/rejected rows, a grpo stage's prompts with their
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
