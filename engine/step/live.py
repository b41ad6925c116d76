"""The live objects of a run: what computes (model, optimizer, reference, datasets) and where tensors
live (the checkpoint store). Built from the folded state by rewind.engine.run.parts, the one way to get
them; a stage kind's spec (rewind.engine.step.kinds) computes with them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rewind.engine.data.registry import DatasetRegistry
from rewind.engine.model.model import GPT
from rewind.engine.model.optimizer import AdamW
from rewind.engine.model.trunkreader import TrunkReader
from rewind.states.config import Config
from rewind.states.schedule import Schedule
from rewind.stores.checkpoints import CheckpointStore


@dataclass(frozen=True)
class Parts:
    """The live objects of a run (see the module docstring for what is not here, and why). Immutable: a
    transition that changes which objects the run computes with returns new Parts (dataclasses.replace);
    the model and optimizer are torch objects that compute in place, as they must."""

    config: Config
    run_dir: str
    schedule: Schedule
    model: GPT
    optimizer: AdamW
    datasets: DatasetRegistry
    store: CheckpointStore
    reference: nn.Module | None = None
    param_names: dict[nn.Parameter, str] = field(default_factory=dict)
    # For each stack whose base is frozen or quantised, its float base weights under their unwrapped
    # names: what checkpoints store of it (once, stores.trunks) and what NF4 is quantised from.
    # trunk_hashes: the sha256 of each one's file. (The model's structure is the folded state's layout.)
    trunk_sources: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    trunk_hashes: dict[int, str] = field(default_factory=dict)
    trunk_reader: TrunkReader = field(default_factory=TrunkReader)
    # What a stage kind keeps across the steps of this process, by name (a rollout stage: its window's
    # batch, read from its file once; a distill stage: its teacher). Caches of what the state names only.
    kind_state: dict[str, Any] = field(default_factory=dict)
