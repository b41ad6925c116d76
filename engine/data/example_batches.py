"""Post-training examples (rewind.engine.data.examples) as the token rows a step reads, and a step's rows.

Every form is `tokens` int64 (n, block_size + 1) and a bool mask over the block_size *targets*: position t
predicts tokens[:, t + 1] and counts where the mask is set. A response is followed by the end token
(rewind.engine.data.examples.end_token), and the mask holds the response's targets and the end token's.
Padding is right padding with `pad_id` and is told apart by position, never by id: the pad id may be a real
token (a tokenizer's pad is its <|endoftext|>), and an end token in the mask stays there.

- `sft_batch`: one row per example, left-truncated to block_size + 1 tokens (the end of a long prompt is
  what the response depends on) as rewind.engine.data.datasets.PairDataset's rows are, through the same code.
- `packed_sft_batch`: examples laid one after another into windows of block_size + 1 tokens, with
  `documents` (n, block_size) int64: the example of each input position, 0, 1, ... in each window (the
  padding after the last is one more), non-decreasing, what model.forward(..., documents=) takes to keep
  attention within an example and restart its positions. An example is never cut: one that does not fit
  what is left of a window starts the next, one longer than a window is left-truncated as `sft_batch`
  does and fills a window alone. So each example's targets, and the tokens before each target within its
  example, are those of `sft_batch`; no target in the mask crosses from one example into the next.
  `packed_row_count`: how many examples a step of so many windows takes.
- `preference_batch`: 2n rows, [chosen rows; rejected rows]: row i is prompt i + chosen i + end, row n + i
  prompt i + rejected i + end, each as `sft_batch` makes it; a row's sequence log-probability is its sum
  over the mask.
- `prompt_tokens` / `completion_batch`: a GRPO step's prompts (left-truncated) and, once sampled, its
  training rows of prompt + completion.

`step_rows`: a step's rows, the stages' shares of the batch, each read the way its stage trains. A
`pretrain` stage's share is drawn as it always was (rewind.engine.data.cursors.assemble_batch: a dataset's
rows at its cursor, the built-in tasks several examples to a row). An `sft` stage reads prompt/response
examples (rewind.engine.data.example_sources: the embedded tasks' examples, or a jsonl / parquet dataset's)
at the same cursor positions, through the same keyed permutation, and lays them one to a row (prompt +
response + end token, the loss on the response and the end token) or, with `packing`, several to a window,
each attending to itself alone (`documents`). A packed share takes as many examples as fill its windows, so
the cursor moves by what was read: the count is on record in StepCommitted's cursors, never recomputed as
steps x batch. A step that draws no sft rows is exactly `assemble_batch`'s (no documents), so a run without
sft stages computes what it always did.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rewind.engine.data.cursors import assemble_batch, sample_indices, split_rows
from rewind.engine.data.datasets import pack_pairs
from rewind.engine.data.example_sources import ExampleSources
from rewind.engine.data.examples import PreferenceRow, PromptRow, SftRow
from rewind.engine.data.registry import DatasetRegistry
from rewind.states.config import Config, Stage
from rewind.states.stagekinds import rules_of

# Positions read at a time while finding how many examples fill a packed share's windows.
_LOOKAHEAD = 64


@dataclass(frozen=True)
class RowBatch:
    """tokens int64 (n, block_size + 1); loss_mask bool (n, block_size) over the targets; documents int64
    (n, block_size) per input position for packed rows, else None."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    documents: torch.Tensor | None = None


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")


def sft_batch(rows: Sequence[SftRow], block_size: int, end_id: int, pad_id: int = 0) -> RowBatch:
    """One row per example: prompt + response + end, left-truncated, right-padded (module doc)."""
    _check_block_size(block_size)
    tokens, loss_mask = pack_pairs(
        [(list(r.prompt), list(r.response)) for r in rows], block_size, pad_id, end_id
    )
    return RowBatch(torch.from_numpy(tokens), torch.from_numpy(loss_mask))


def _windows(rows: Iterable[SftRow], width: int) -> Iterator[int]:
    """The window each example goes to, in order: the next one when it does not fit what is left."""
    window, used = -1, width  # the first example opens a window
    for row in rows:
        size = min(len(row.prompt) + len(row.response) + 1, width)
        if used + size > width:
            window, used = window + 1, 0
        used += size
        yield window


def packed_row_count(rows: Iterable[SftRow], block_size: int, num_windows: int) -> int:
    """How many of `rows`, from the first, `packed_sft_batch` lays into at most `num_windows` windows: what a
    step of num_windows packed windows consumes. Reads no row past the first one that does not fit."""
    _check_block_size(block_size)
    count = 0
    for window in _windows(rows, block_size + 1):
        if window >= num_windows:
            break
        count += 1
    return count


def packed_sft_batch(rows: Sequence[SftRow], block_size: int, end_id: int, pad_id: int = 0) -> RowBatch:
    """The examples packed into as few windows as their order allows (module doc)."""
    _check_block_size(block_size)
    width = block_size + 1
    windows: list[list[tuple[list[int], int]]] = []
    for row, window in zip(rows, _windows(rows, width), strict=True):
        ids = [*row.prompt, *row.response, end_id][-width:]
        # The response and end tokens kept, as targets; the first token of a window is never one.
        num_targets = min(len(row.response) + 1, len(ids) - 1)
        if window == len(windows):
            windows.append([])
        windows[-1].append((ids, num_targets))
    tokens = np.full((len(windows), width), pad_id, dtype=np.int64)
    loss_mask = np.zeros((len(windows), block_size), dtype=bool)
    documents = np.empty((len(windows), width), dtype=np.int64)
    for w, window in enumerate(windows):
        start = 0
        for document, (ids, num_targets) in enumerate(window):
            end = start + len(ids)
            tokens[w, start:end] = ids
            documents[w, start:end] = document
            # Target t is tokens[t + 1]: the last num_targets tokens of [start, end) are targets from end - num_targets - 1.
            loss_mask[w, end - num_targets - 1 : end - 1] = True
            start = end
        documents[w, start:] = len(window)  # the padding, a document of its own
    return RowBatch(
        torch.from_numpy(tokens), torch.from_numpy(loss_mask), torch.from_numpy(documents[:, :-1].copy())
    )


def preference_batch(
    rows: Sequence[PreferenceRow], block_size: int, end_id: int, pad_id: int = 0
) -> RowBatch:
    """[chosen rows; rejected rows], 2 * len(rows) rows (module doc)."""
    chosen = sft_batch([SftRow(r.prompt, r.chosen) for r in rows], block_size, end_id, pad_id)
    rejected = sft_batch([SftRow(r.prompt, r.rejected) for r in rows], block_size, end_id, pad_id)
    return RowBatch(
        torch.cat([chosen.tokens, rejected.tokens]), torch.cat([chosen.loss_mask, rejected.loss_mask])
    )


def prompt_tokens(rows: Sequence[PromptRow], max_prompt_tokens: int) -> list[list[int]]:
    """Each row's prompt, its last `max_prompt_tokens` tokens when longer: what the sampler is given."""
    if max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    return [list(row.prompt[-max_prompt_tokens:]) for row in rows]


@dataclass(frozen=True)
class CompletionBatch:
    """tokens int64 (n, block_size + 1): prompt + completion, right-padded; completion_mask bool
    (n, block_size) over the targets that are completion tokens (the end token included when sampled);
    truncated bool (n,): the completion has no end token (it ran out of new tokens). The mask's positions,
    row by row, are the completions' tokens in order: per-token values of the completions concatenated (the
    sampler's log-probs) land on them as `values = zeros(mask.shape); values[completion_mask] = concatenated`."""

    tokens: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor


def completion_batch(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    end_id: int,
    pad_id: int = 0,
    block_size: int | None = None,
) -> CompletionBatch:
    """The training rows of sampled completions, one per (prompt, completion) pair (a prompt repeated for
    each completion of its group). A completion ends at its first end token, which it keeps: tokens a
    sampler wrote after it are not part of it. `block_size`: the rows' (None: the longest row's length
    minus 1, at least 1); a row longer than block_size + 1 is a ValueError (prompts are cut before sampling)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    kept, truncated = [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        if not prompt:
            raise ValueError("a completion's prompt holds no token")
        completion = list(completion)
        ends = end_id in completion
        kept.append(completion[: completion.index(end_id) + 1] if ends else completion)
        truncated.append(not ends)
    lengths = [len(p) + len(c) for p, c in zip(prompts, kept, strict=True)]
    if block_size is None:
        block_size = max(max(lengths, default=0) - 1, 1)
    elif max(lengths, default=0) > block_size + 1:
        raise ValueError(
            f"a prompt and completion of {max(lengths)} tokens exceed block_size + 1 = {block_size + 1}"
        )
    _check_block_size(block_size)
    tokens = np.full((len(kept), block_size + 1), pad_id, dtype=np.int64)
    mask = np.zeros((len(kept), block_size), dtype=bool)
    for row, (prompt, completion) in enumerate(zip(prompts, kept, strict=True)):
        tokens[row, : len(prompt)] = prompt
        tokens[row, len(prompt) : len(prompt) + len(completion)] = completion
        mask[row, len(prompt) - 1 : len(prompt) + len(completion) - 1] = True
    return CompletionBatch(
        torch.from_numpy(tokens), torch.from_numpy(mask), torch.tensor(truncated, dtype=torch.bool)
    )


# --- a step's rows ---------------------------------------------------------------------------------------


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
    if not any(n and rules_of(stage).reads == "examples" for n, stage in zip(rows_per_stage, stages, strict=True)):
        tokens, mask, after, _ = assemble_batch(seed, config, rows_per_stage, cursors, datasets)
        return StepRows(tokens, mask, None, after)
    after = dict(cursors)
    parts: list[RowBatch] = []
    for i, (n, stage) in enumerate(zip(rows_per_stage, stages, strict=True)):
        if n == 0:
            continue
        if rules_of(stage).reads == "examples":  # an sft stage's share: its prompt/response examples
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
    block_size, packing = config.architecture.block_size, stage.sft.packing
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
