"""Datasets by name for one run: the built-in tasks and `[data.NAME]`, opened on first use and kept.

The registry carries the run's `DataHome` (rewind.engine.data.userdata): its tokenizer (the built-in tasks
are encoded through it too, so one run can mix a user's corpus with the tasks), where relative paths
point and where documents are tokenised to. The set of names is the config's, so the cache is bounded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from rewind.engine.data import tasks
from rewind.engine.data.datasets import BuiltinDataset, Dataset, DatasetError
from rewind.engine.data.example_sources import ExampleSources
from rewind.engine.data.userdata import DataHome, open_user_dataset
from rewind.states.config import Config


def open_dataset(name: str, config: Config, home: DataHome | None = None) -> Dataset:
    """Open dataset `name`: a built-in, or `config.data[name]`."""
    home = home or DataHome()
    arch = config.architecture
    if name in config.data:
        return open_user_dataset(name, config.data[name], arch.block_size, arch.vocab_size, home)
    if name in tasks.TASK_NAMES:
        # Byte level without a tokenizer file: the tasks' own fast path, the same ids.
        encode = home.tokenizer.encode if home.tokenizer.identity else None
        return BuiltinDataset(name, arch.block_size, arch.vocab_size, encode)
    known = ", ".join(sorted(config.dataset_names()))
    raise DatasetError(f"dataset {name!r}: unknown (known: {known})")


class DatasetRegistry(Mapping[str, Dataset]):
    """The datasets a config can name, each opened on first use and then kept for the process."""

    def __init__(self, config: Config, home: DataHome | None = None):
        self.config = config
        self.home = home or DataHome()
        self._opened: dict[str, Dataset] = {}
        self.examples = ExampleSources(config, self.home)  # the same datasets as an sft stage reads them

    def __getitem__(self, name: str) -> Dataset:
        if name not in self._opened:
            if name not in self:
                raise KeyError(name)
            self._opened[name] = open_dataset(name, self.config, self.home)
        return self._opened[name]

    def __contains__(self, name: object) -> bool:
        # Mapping's default would open the dataset just to answer a membership question.
        return name in self.config.dataset_names()

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.config.dataset_names()))

    def __len__(self) -> int:
        return len(self.config.dataset_names())
