"""Datasets by name: the built-in synthetic tasks and the user's files declared under `[data.NAME]`.

Every dataset serves rows of block_size + 1 tokens with a loss mask over the block_size targets,
from two splits, "train" and "validation". User files:
- kind = "tokens": a flat binary file of uint16/uint32 token ids, memory-mapped read-only.
- kind = "jsonl": one JSON object per line, its text under `text_field`; documents are joined with
  "\\n" and tokenised as UTF-8 bytes (token id = byte value). The file is read whole into memory.
Both are cut into non-overlapping windows of block_size + 1 tokens (a trailing partial window is
dropped); the last `validation_fraction` of the windows (rounded down) is the validation split.

`DatasetRegistry` opens each dataset once per process and keeps it (the set of names is the
config's, so the cache is bounded). Errors a user can cause raise `DatasetError` with one line that
names the dataset and, for files, the path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import msgspec
import numpy as np
import torch

from rewind.engine import tasks
from rewind.states.config import BUILTIN_DATASETS, Config, DataSource

SPLITS = tasks.SPLITS
# Files up to this many tokens are scanned for out-of-vocabulary ids when opened (a few tens of ms);
# larger ones are checked window by window as rows are read.
EAGER_VOCAB_CHECK_TOKENS = 1 << 26

if tasks.TASK_NAMES != BUILTIN_DATASETS:
    # The config validates names without importing torch; the two lists must never drift apart.
    raise ImportError(f"engine tasks {tasks.TASK_NAMES} != states.config.BUILTIN_DATASETS {BUILTIN_DATASETS}")


class DatasetError(Exception):
    """A dataset cannot be opened or read: missing, unreadable, too small, or inconsistent with the config."""


class Dataset(ABC):
    """Rows of `block_size + 1` token ids with a bool loss mask over the `block_size` targets."""

    name: str
    block_size: int
    # Whether the loss mask marks answers (a task's answer, a response) rather than every next token of
    # running text: answer-token accuracy is reported only where this holds.
    has_answers: bool = False

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

    def _check(self, split: str, index: int) -> None:
        if split not in SPLITS:
            raise ValueError(f"dataset {self.name!r}: unknown split {split!r} (expected one of {SPLITS})")
        if not 0 <= index < self.num_samples(split):
            raise IndexError(
                f"dataset {self.name!r}: {split} index {index} out of [0, {self.num_samples(split)})"
            )


class BuiltinDataset(Dataset):
    """One of the synthetic tasks of `rewind.engine.tasks`, generated on demand."""

    def __init__(self, name: str, block_size: int, vocab_size: int):
        if name not in tasks.TASK_NAMES:
            raise DatasetError(
                f"dataset {name!r}: not a built-in dataset (built-ins: {', '.join(tasks.TASK_NAMES)})"
            )
        if block_size < tasks.min_block_size(name):
            raise DatasetError(
                f"dataset {name!r}: architecture.block_size {block_size} is too small, "
                f"one example needs block_size >= {tasks.min_block_size(name)}"
            )
        if vocab_size < 128:
            raise DatasetError(
                f"dataset {name!r}: byte-level ASCII text needs architecture.vocab_size >= 128, got {vocab_size}"
            )
        self.name = name
        self.block_size = block_size
        self.has_answers = name != "grammar"

    def num_samples(self, split: str) -> int:
        if split not in SPLITS:
            raise ValueError(f"dataset {self.name!r}: unknown split {split!r} (expected one of {SPLITS})")
        return tasks.num_task_samples(self.name, split)

    def sample(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        self._check(split, index)
        return tasks.task_sample(self.name, split, index, self.block_size)


class WindowedDataset(Dataset):
    """A flat array of token ids cut into non-overlapping windows; the loss covers every target."""

    def __init__(
        self,
        name: str,
        path: str,
        token_ids: np.ndarray,
        block_size: int,
        vocab_size: int,
        validation_fraction: float,
    ):
        self.name, self.path, self.block_size, self.vocab_size = name, path, block_size, vocab_size
        window = block_size + 1
        num_windows = len(token_ids) // window
        self.num_validation = int(num_windows * validation_fraction)
        self.num_train = num_windows - self.num_validation
        if self.num_train == 0 or self.num_validation == 0:
            raise DatasetError(
                f"dataset {name!r}: {path}: too small: {len(token_ids)} tokens make {num_windows} windows of "
                f"{window} tokens, leaving {self.num_train} for train and {self.num_validation} for validation"
            )
        # A view of the windows, row i = tokens [i * window, (i + 1) * window): no copy of a memmap.
        self._windows = token_ids[: num_windows * window].reshape(num_windows, window)
        # Vocab check: whole file now when it is affordable, otherwise each window as it is read.
        self._check_lazily = False
        if int(np.iinfo(token_ids.dtype).max) >= vocab_size:
            if len(token_ids) <= EAGER_VOCAB_CHECK_TOKENS:
                self._check_vocab(self._windows)
            else:
                self._check_lazily = True

    def _check_vocab(self, rows: np.ndarray) -> None:
        if rows.size and int(rows.max()) >= self.vocab_size:
            raise DatasetError(
                f"dataset {self.name!r}: {self.path}: token id {int(rows.max())} is outside "
                f"architecture.vocab_size {self.vocab_size}"
            )

    def num_samples(self, split: str) -> int:
        if split not in SPLITS:
            raise ValueError(f"dataset {self.name!r}: unknown split {split!r} (expected one of {SPLITS})")
        return self.num_train if split == "train" else self.num_validation

    def _rows(self, split: str, indices: np.ndarray) -> np.ndarray:
        offset = 0 if split == "train" else self.num_train
        rows = self._windows[indices + offset]  # fancy indexing copies only the selected windows
        if self._check_lazily:
            self._check_vocab(rows)
        return np.asarray(rows, dtype=np.int64)  # a plain writable ndarray, even from a memmap

    def sample(self, split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        self._check(split, index)
        return self._rows(split, np.array([index]))[0], np.ones(self.block_size, dtype=bool)

    def batch(self, split: str, indices: Sequence[int] | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        index_array = np.asarray(indices, dtype=np.int64).reshape(-1)
        if index_array.size and (index_array.min() < 0 or index_array.max() >= self.num_samples(split)):
            raise IndexError(f"dataset {self.name!r}: {split} indices out of [0, {self.num_samples(split)})")
        tokens = torch.from_numpy(self._rows(split, index_array))
        return tokens, torch.ones((len(index_array), self.block_size), dtype=torch.bool)


def _read_token_file(name: str, path: Path, dtype: str) -> np.ndarray:
    itemsize = np.dtype(dtype).itemsize
    try:
        num_bytes = path.stat().st_size
        if num_bytes % itemsize:
            raise DatasetError(
                f"dataset {name!r}: {path}: size {num_bytes} bytes is not a multiple of {itemsize} ({dtype})"
            )
        if num_bytes == 0:
            return np.zeros(0, dtype=dtype)  # mmap refuses empty files; "too small" is reported later
        return np.memmap(path, dtype=dtype, mode="r")
    except FileNotFoundError:
        raise DatasetError(f"dataset {name!r}: {path}: file not found") from None
    except OSError as exc:
        raise DatasetError(f"dataset {name!r}: {path}: cannot read: {exc.strerror or exc}") from None


def _read_jsonl_bytes(name: str, path: Path, text_field: str) -> np.ndarray:
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        raise DatasetError(f"dataset {name!r}: {path}: file not found") from None
    except OSError as exc:
        raise DatasetError(f"dataset {name!r}: {path}: cannot read: {exc.strerror or exc}") from None
    decoder = msgspec.json.Decoder()
    documents: list[str] = []
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue  # blank lines (a trailing newline, spacing) carry no document
        try:
            record = decoder.decode(line)
        except msgspec.DecodeError as exc:
            raise DatasetError(f"dataset {name!r}: {path}:{line_number}: not valid JSON: {exc}") from None
        if not isinstance(record, dict) or text_field not in record:
            raise DatasetError(f"dataset {name!r}: {path}:{line_number}: no {text_field!r} field")
        text = record[text_field]
        if not isinstance(text, str):
            raise DatasetError(
                f"dataset {name!r}: {path}:{line_number}: field {text_field!r} is {type(text).__name__}, not a string"
            )
        documents.append(text)
    return np.frombuffer("\n".join(documents).encode("utf-8"), dtype=np.uint8)


def open_user_dataset(
    name: str, source: DataSource, block_size: int, vocab_size: int, base_dir: str | Path | None = None
) -> WindowedDataset:
    path = Path(source.path).expanduser()
    if base_dir is not None and not path.is_absolute():
        path = Path(base_dir) / path
    if source.kind == "tokens":
        token_ids = _read_token_file(name, path, source.dtype)
    else:
        token_ids = _read_jsonl_bytes(name, path, source.text_field)
    return WindowedDataset(name, str(path), token_ids, block_size, vocab_size, source.validation_fraction)


def open_dataset(name: str, config: Config, *, base_dir: str | Path | None = None) -> Dataset:
    """Open dataset `name`: a built-in, or `config.data[name]` (relative paths resolved against
    `base_dir` when given, else the working directory)."""
    arch = config.architecture
    if name in config.data:
        return open_user_dataset(name, config.data[name], arch.block_size, arch.vocab_size, base_dir)
    if name in tasks.TASK_NAMES:
        return BuiltinDataset(name, arch.block_size, arch.vocab_size)
    known = ", ".join(sorted(config.dataset_names()))
    raise DatasetError(f"dataset {name!r}: unknown (known: {known})")


class DatasetRegistry(Mapping[str, Dataset]):
    """The datasets a config can name, each opened on first use and then kept for the process."""

    def __init__(self, config: Config, *, base_dir: str | Path | None = None):
        self.config = config
        self.base_dir = base_dir
        self._opened: dict[str, Dataset] = {}

    def __getitem__(self, name: str) -> Dataset:
        if name not in self._opened:
            if name not in self:
                raise KeyError(name)
            self._opened[name] = open_dataset(name, self.config, base_dir=self.base_dir)
        return self._opened[name]

    def __contains__(self, name: object) -> bool:
        # Mapping's default would open the dataset just to answer a membership question.
        return name in self.config.dataset_names()

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.config.dataset_names()))

    def __len__(self) -> int:
        return len(self.config.dataset_names())


def run_datasets(run_dir: str, config: Config) -> DatasetRegistry:
    """The datasets of run `run_dir` under `config` as the run itself reads them (for tools that score or
    sample a run from outside its training process)."""
    return DatasetRegistry(config)
