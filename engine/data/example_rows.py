"""A step's rows: the stages' shares of the batch, each read the way its stage trains.

A `pretrain` stage's share is drawn as it always was (rewind.engine.data.cursors.assemble_batch: a
dataset's rows at its cursor, the built-in tasks several examples to a row). An `sft` stage reads
prompt/response examples (rewind.engine.data.row_sources: the embedded tasks' examples, or a jsonl /
parquet dataset's prompt/response rows) at the same cursor positions, through the same keyed
permutation, and lays them one to a row (prompt + response + end token, the loss on the response
and the end token) or, with `packing`, several to a window, each attending to itself alone
(`documents`). A packed share takes as many examples as fill its windows, so the cursor moves by
what was read: the count is on record in StepCommitted's cursors, never recomputed as steps x batch.

A step that draws no sft rows is exactly `assemble_batch`'s (no documents), so a run without sft
stages computes what it always did.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from rewind.engine.data.cursors import assemble_batch, sample_indices, split_rows
from rewind.engine.data.example_sources import ExampleSources
from rewind.engine.data.registry import DatasetRegistry
from rewind.engine.data.row_batches import RowBatch, packed_row_count, packed_sft_batch, sft_batch
from rewind.engine.data.rows import SftRow
from rewind.states.config import Config, Stage

# Positions read at a time while finding how many examples fill a packed share's windows.
_LOOKAHEAD = 64


@dataclass(frozen=True)
class StepRows:
    """tokens (B, block + 1), loss_mask (B, block), documents (B, block) or None (one document to a row),
    cursors after the step."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    documents: torch.Tensor | None
    cursors: dict[str, int]


def step_rows(
    config: Config, rows_per_stage: Sequence[int], cursors: Mapping[str, int], datasets: DatasetRegistry
) -> StepRows:
    """One step's rows, stage by stage in order, and the cursors after it (module doc)."""
    seed, stages = config.run.seed, config.stages
    if not any(n and stage.strategy == "sft" for n, stage in zip(rows_per_stage, stages, strict=True)):
        tokens, mask, after, _ = assemble_batch(seed, config, rows_per_stage, cursors, datasets)
        return StepRows(tokens, mask, None, after)
    after = dict(cursors)
    parts: list[RowBatch] = []
    for i, (n, stage) in enumerate(zip(rows_per_stage, stages, strict=True)):
        if n == 0:
            continue
        if stage.strategy == "sft":
            parts += _example_rows(config, stage, n, after, datasets.examples)
            continue
        only_this = [n if j == i else 0 for j in range(len(stages))]
        tokens, mask, after, _ = assemble_batch(seed, config, only_this, after, datasets)
        parts.append(RowBatch(tokens, mask))
    return _joined(parts, after)


def _example_rows(
    config: Config, stage: Stage, rows: int, cursors: dict[str, int], examples: ExampleSources
) -> Iterator[RowBatch]:
    """Stage `stage`'s `rows` rows, dataset by dataset of its mixture; moves `cursors` past what it read."""
    block_size, packing = config.architecture.block_size, stage.sft_settings.packing
    for sampling, count in zip(stage.datasets, split_rows(stage.datasets, rows), strict=True):
        if count == 0:
            continue
        name, source = sampling.name, examples.sft(sampling.name)
        start, total, reshuffle = cursors.get(name, 0), source.num_rows("train"), examples.reshuffles(name)
        if packing:
            ahead = _rows_from(config.run.seed, name, source, start, reshuffle)
            count_read = packed_row_count(ahead, block_size, count)
        else:
            count_read = count
        indices = sample_indices(config.run.seed, name, total, start, count_read, reshuffle=reshuffle)
        read = [source.row("train", int(i)) for i in indices]
        build = packed_sft_batch if packing else sft_batch
        cursors[name] = start + count_read
        yield build(read, block_size, examples.end_id, examples.pad_id)


def _rows_from(seed: int, name: str, source, start: int, reshuffle: bool) -> Iterator[SftRow]:
    """The examples at cursor positions start, start + 1, ... (read a few at a time, as far as asked)."""
    total = source.num_rows("train")
    position = start
    while True:
        for index in sample_indices(seed, name, total, position, _LOOKAHEAD, reshuffle=reshuffle):
            yield source.row("train", int(index))
        position += _LOOKAHEAD


def _joined(parts: list[RowBatch], cursors: dict[str, int]) -> StepRows:
    tokens = torch.cat([p.tokens for p in parts])
    mask = torch.cat([p.loss_mask for p in parts])
    if all(p.documents is None for p in parts):
        return StepRows(tokens, mask, None, cursors)
    # Rows of one document each (unpacked, or pretraining's) get document 0 throughout.
    documents = torch.cat(
        [p.documents if p.documents is not None else torch.zeros_like(p.loss_mask, dtype=torch.long) for p in parts]
    )
    return StepRows(tokens, mask, documents, cursors)
