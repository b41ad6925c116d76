"""Datasets by name: the built-in synthetic tasks and the user's data declared under `[data.NAME]`.

Every dataset serves rows of block_size + 1 tokens with a loss mask over the block_size targets, from
two splits, "train" and "validation":
- `BuiltinDataset`: a task of rewind.engine.data.tasks, byte level or through the run's tokenizer;
- `WindowedDataset`: a token stream (a token file, or documents tokenised into a prepared directory) cut
  into non-overlapping windows, the loss on every target, validation rows carved by `RowSplit`
  (rewind.engine.data.tokens);
- `PairDataset`: prompt/response examples, one per row, left-truncated and right-padded, the loss on the
  response only.
How each user source is opened and what identity it records: rewind.engine.data.userdata.

Opening them by name: rewind.engine.data.registry. Errors a user can cause raise `DatasetError` with one line
that names the dataset and, for files, the path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from rewind.engine.data import tasks
from rewind.engine.data.tokens import RowSplit, TokenFileError, TokenStream, holdout_problem
from rewind.states.config import BUILTIN_DATASETS

SPLITS = tasks.SPLITS
# Files up to this many tokens are scanned for out-of-vocabulary ids whenever they are opened (a few tens
# of ms); larger ones only when a run starts on them (`check_all`: before RunStarted, about 0.2 s per
# 2**27 tokens), and otherwise window by window as rows are read (a resume does not pay for a corpus).
EAGER_VOCAB_CHECK_TOKENS = 1 << 26

if tasks.TASK_NAMES != BUILTIN_DATASETS:
    # The config validates names without importing torch; the two lists must never drift apart.
    raise ImportError(f"engine tasks {tasks.TASK_NAMES} != states.config.BUILTIN_DATASETS {BUILTIN_DATASETS}")


class DatasetError(Exception):
    """A dataset cannot be opened or read: missing, unreadable, too small, or inconsistent with the config."""


class TokenIdError(DatasetError, TokenFileError):
    """A token id past the model's vocabulary, met in the rows a step reads (a file too large to scan
    whenever it is opened, in a run that did not scan it when it started). A TokenFileError too, so that
    it stops any command in one line, exit 1 (rewind.tools.cli), as a token file cut short does."""


class Dataset(ABC):
    """Rows of `block_size + 1` token ids with a bool loss mask over the `block_size` targets."""

    name: str
    block_size: int
    # Whether the loss mask marks answers (a task's answer, a response) rather than every next token of
    # running text: answer-token accuracy is reported only where this holds.
    has_answers: bool = False
    # Past the last train row: a new order for every epoch, or the first epoch's again (on_epoch_end).
    reshuffle: bool = True

    @abstractmethod
    def num_samples(self, split: str) -> int: ...

    @abstractmethod
    def sample(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int64 (block_size + 1,), loss_mask bool (block_size,)) of row `index` of `split`."""

    def batch(self, split: str, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens LongTensor (B, block_size + 1), loss_mask BoolTensor (B, block_size)) for the rows."""
        tokens = np.empty((len(indices), self.block_size + 1), dtype=np.int64)
        loss_mask = np.empty((len(indices), self.block_size), dtype=bool)
        for row, index in enumerate(indices):
            tokens[row], loss_mask[row] = self.sample(split, int(index))
        return torch.from_numpy(tokens), torch.from_numpy(loss_mask)

    def gather(self, split: str, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch` for row indices already known to be in range (a cursor's draw): a dataset whose batch
        checks them may skip that here."""
        return self.batch(split, indices)

    def _check(self, split: str, index: int) -> None:
        if split not in SPLITS:
            raise ValueError(f"dataset {self.name!r}: unknown split {split!r} (expected one of {SPLITS})")
        if not 0 <= index < self.num_samples(split):
            raise IndexError(
                f"dataset {self.name!r}: {split} index {index} out of [0, {self.num_samples(split)})"
            )


class BuiltinDataset(Dataset):
    """One of the synthetic tasks of `rewind.engine.data.tasks`, generated on demand."""

    def __init__(self, name: str, block_size: int, vocab_size: int, encode: tasks.Encoder | None = None):
        if name not in tasks.TASK_NAMES:
            raise DatasetError(
                f"dataset {name!r}: not a built-in dataset (built-ins: {', '.join(tasks.TASK_NAMES)})"
            )
        if block_size < tasks.min_block_size(name):
            raise DatasetError(
                f"dataset {name!r}: architecture.block_size {block_size} is too small, "
                f"one example needs block_size >= {tasks.min_block_size(name)}"
            )
        if encode is None and vocab_size < 128:
            raise DatasetError(
                f"dataset {name!r}: byte-level ASCII text needs architecture.vocab_size >= 128, got {vocab_size}"
            )
        self.name = name
        self.block_size = block_size
        self.has_answers = name != "grammar"
        self._encode = encode

    def num_samples(self, split: str) -> int:
        if split not in SPLITS:
            raise ValueError(f"dataset {self.name!r}: unknown split {split!r} (expected one of {SPLITS})")
        return tasks.num_task_samples(self.name, split)

    def sample(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        self._check(split, index)
        return tasks.task_sample(self.name, split, index, self.block_size, self._encode)


class WindowedDataset(Dataset):
    """A token stream cut into non-overlapping windows of block_size + 1; the loss covers every target.
    With a validation stream of its own (`validation`), every window of `train` is a train row. Every id
    is checked against vocab_size when opened (`check_all`, or a file of at most EAGER_VOCAB_CHECK_TOKENS),
    else as each window is read: an id found then is a TokenIdError (one line, exit 1)."""

    def __init__(
        self,
        name: str,
        train: TokenStream,
        block_size: int,
        vocab_size: int,
        *,
        split: str,
        fraction: float,
        validation: TokenStream | None = None,
        check_all: bool = False,
    ):
        self.name, self.block_size, self.vocab_size = name, block_size, vocab_size
        self.path = train.path
        self._width = block_size + 1
        self._streams = {"train": train, "validation": validation or train}
        num_windows = train.num_tokens // self._width
        num_validation_windows = validation.num_tokens // self._width if validation is not None else 0
        self.rows = RowSplit(num_windows, "file" if validation is not None else split, fraction, num_validation_windows)
        if self.rows.num_train == 0 or self.rows.num_validation == 0:
            sizes = f"{train.num_tokens} tokens make {num_windows} windows of {self._width} tokens"
            if validation is not None:
                sizes += f", {validation.path}: {validation.num_tokens} tokens make {num_validation_windows}"
            carved = holdout_problem(num_windows, fraction, "windows") if validation is None else ""
            raise DatasetError(
                f"dataset {name!r}: {self.path}: too small: {sizes}, leaving {self.rows.num_train} for train "
                f"and {self.rows.num_validation} for validation" + (f" ({carved})" if carved else "")
            )
        # Vocab check: whole streams now when asked or affordable, otherwise each window as it is read.
        self._check_lazily = False
        for stream in {id(s): s for s in self._streams.values()}.values():
            if int(np.iinfo(stream.dtype).max) >= vocab_size:
                if check_all or stream.num_tokens <= EAGER_VOCAB_CHECK_TOKENS:
                    if problem := self._vocab_problem(stream.path, stream.max_token()):
                        raise DatasetError(problem)
                else:
                    self._check_lazily = True

    def _vocab_problem(self, path: str, largest: int) -> str:
        if largest < self.vocab_size:
            return ""
        return f"dataset {self.name!r}: {path}: token id {largest} is outside architecture.vocab_size {self.vocab_size}"

    def num_samples(self, split: str) -> int:
        if split not in SPLITS:
            raise ValueError(f"dataset {self.name!r}: unknown split {split!r} (expected one of {SPLITS})")
        return self.rows.count(split)

    def _rows(self, split: str, indices: np.ndarray) -> np.ndarray:
        stream = self._streams[split]
        rows = stream.windows(self.rows.rows(split, indices), self._width)
        if self._check_lazily and rows.size and (problem := self._vocab_problem(stream.path, int(rows.max()))):
            raise TokenIdError(problem)
        return rows

    def sample(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        self._check(split, index)
        return self._rows(split, np.array([index], dtype=np.int64))[0], np.ones(self.block_size, dtype=bool)

    def batch(self, split: str, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        index_array = np.asarray(indices, dtype=np.int64).reshape(-1)
        if index_array.size and (index_array.min() < 0 or index_array.max() >= self.num_samples(split)):
            raise IndexError(f"dataset {self.name!r}: {split} indices out of [0, {self.num_samples(split)})")
        return self.gather(split, index_array)

    def gather(self, split: str, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.from_numpy(self._rows(split, indices))
        return tokens, torch.ones((len(indices), self.block_size), dtype=torch.bool)


class PairDataset(Dataset):
    """Prompt/response examples, one per row: prompt + response (+ the end-of-text token when the
    tokenizer has one) left-truncated to block_size + 1 tokens (the end of a long prompt is what the
    response depends on), right-padded, the loss on the response tokens only."""

    has_answers = True

    def __init__(self, name: str, rows: dict[str, tuple[np.ndarray, np.ndarray]], block_size: int, label: str):
        self.name, self.block_size, self.path = name, block_size, label
        self._rows = rows  # split -> (tokens (n, block_size + 1), loss_mask (n, block_size))
        for split in SPLITS:
            if len(rows[split][0]) == 0:
                raise DatasetError(f"dataset {name!r}: {label}: too small: no {split} examples")

    def num_samples(self, split: str) -> int:
        if split not in SPLITS:
            raise ValueError(f"dataset {self.name!r}: unknown split {split!r} (expected one of {SPLITS})")
        return len(self._rows[split][0])

    def sample(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        self._check(split, index)
        tokens, mask = self._rows[split]
        return tokens[index].copy(), mask[index].copy()


def pack_pairs(
    pairs: list[tuple[list[int], list[int]]], block_size: int, pad_id: int, end_id: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, loss_mask) rows of `PairDataset` for tokenised (prompt, response) pairs."""
    width = block_size + 1
    tokens = np.full((len(pairs), width), pad_id, dtype=np.int64)
    loss_mask = np.zeros((len(pairs), block_size), dtype=bool)
    for row, (prompt, response) in enumerate(pairs):
        answer = [*response, end_id] if end_id is not None else list(response)
        ids = ([*prompt, *answer])[-width:]
        num_answer = min(len(answer), len(ids) - 1)  # the first token is never a target
        tokens[row, : len(ids)] = ids
        if num_answer > 0:  # (an empty example scores nothing, its padding least of all)
            # Target t is ids[t + 1]: the answer's tokens at [len - num_answer, len) are targets from len - num_answer - 1.
            loss_mask[row, len(ids) - num_answer - 1 : len(ids) - 1] = True
    return tokens, loss_mask
