"""The live objects of a run, and how they are built from the folded state.

`Parts` holds what computes (model, optimizer, reference, datasets) and where tensors live (the
checkpoint store); it holds no control state (that is `fold(events)`) and nothing that writes the log
(that is `rewind.engine.journal.Journal`, which only the live loop has). `build_parts` is the one way
to get them: from a config and the state the log folds to, loading the tensors of the state's restore
checkpoint and of its reference. The live loop, resume, fork and replay all come through here, so a
resumed process holds exactly what the one that never stopped held.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from rewind.engine import layout as layouts
from rewind.engine.datasets import DatasetError
from rewind.engine.model import GPT
from rewind.engine.optimizer import AdamW
from rewind.engine.placement import is_sharded, place
from rewind.engine.pretrained import Pretrained, PretrainedError, apply_pretrained, load_pretrained
from rewind.engine.registry import DatasetRegistry
from rewind.engine.step import build_optimizer
from rewind.engine.userdata import DataPlace
from rewind.states.config import Config
from rewind.states.schedule import Schedule
from rewind.states.state import ModelLayout, State
from rewind.stores.checkpoints import CheckpointStore

if TYPE_CHECKING:
    from rewind.engine.trunkcache import TrunkReader


class RunError(Exception):
    """A run cannot be started or resumed as asked. exit_code: 2 usage/config, 1 state of the run."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Parts:
    """The live objects of a run (see the module docstring for what is not here, and why)."""

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
    # trunk_hashes: their files' sha256, known. (The model's structure is the folded state's layout.)
    trunk_sources: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    trunk_hashes: dict[int, str] = field(default_factory=dict)
    trunk_reader: TrunkReader = field(default_factory=lambda: _trunk_reader())


def _trunk_reader() -> TrunkReader:
    from rewind.engine.trunkcache import TrunkReader  # (it builds on Parts)

    return TrunkReader()


def build_model(config: Config, layout: ModelLayout | None = None) -> GPT:
    return layouts.build_model(config, layout)


def frozen_copy(
    model: nn.Module,
    config: Config,
    layout: ModelLayout | None,
    trunk_sources: dict[int, dict[str, torch.Tensor]] | None = None,
) -> nn.Module:
    """The KL reference: the model (of `layout`) as it is now, fixed, placed as the run computes.
    Parameters that do not train are shared, not copied: they cannot change while this model lives (a
    growth builds a new model from copies), so a frozen or NF4 trunk is held once, not twice. A sharded
    model cannot be copied (FSDP2 forbids it): its reference is built from its whole weights and
    sharded in turn, so the reference's forward is sharded too; its NF4 stacks (which hold no float
    weights) are quantised again from `trunk_sources`, the float weights they were quantised from."""
    if is_sharded(model):
        from rewind.engine.snapshot import cpu_copy

        nf4 = {s.stack for s in layouts.layout_of(config, layout).stacks if s.base == "nf4"}
        weights, adapters = {}, {}
        for name, tensor in model.state_dict().items():
            if layouts.is_adapter(name):
                adapters[layouts.unwrapped(name)] = cpu_copy(tensor)
            elif layouts.stack_of(name) not in nf4:
                weights[layouts.unwrapped(name)] = cpu_copy(tensor)
        for stack in nf4:
            weights.update((trunk_sources or {})[stack])
        reference = layouts.model_from_weights(config, layout, weights, adapters, complete=True)[0]
    else:
        shared = {id(p): p for p in model.parameters() if not p.requires_grad}
        reference = copy.deepcopy(model, memo=shared)
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    reference = place(reference, config)  # (a copy of a placed model: only sharding and compiling are new)
    layouts.eval_mode(reference)
    return reference


def open_datasets(config: Config, place: DataPlace) -> DatasetRegistry:
    """Open every dataset the config names now, so a bad one fails before any log is touched."""
    try:
        datasets = DatasetRegistry(config, place)
        for stage in config.stages:
            for sampling in stage.datasets:
                datasets[sampling.name]
        for name in config.training.evaluations:
            datasets[name]
    except DatasetError as exc:
        raise RunError(str(exc)) from None
    return datasets


def fresh_parts(
    config: Config, run_dir: str, datasets: DatasetRegistry, pretrained: Pretrained | None = None
) -> Parts:
    """Model and optimizer as a run starts with them: the seed's weights, or `pretrained`'s (loaded into
    the plain model before it is quantised or given adapters)."""
    if pretrained is None:
        model = build_model(config)
    else:
        plain = layouts.build_plain(config, None)
        apply_pretrained(plain, pretrained.tensors)
        model = layouts.shape(plain, config, None)
    model = place(model, config)  # on its device, sharded when the run is, before the optimizer sees it
    return Parts(
        config=config,
        run_dir=run_dir,
        schedule=Schedule(config),
        model=model,
        optimizer=build_optimizer(model, config),
        datasets=datasets,
        store=CheckpointStore(run_dir),
        param_names=layouts.parameter_names(model),
    )


def build_parts(config: Config, run_dir: str, state: State, datasets: DatasetRegistry) -> Parts:
    """The live objects a run has at `state`: built for `config`, then loaded with the tensors of the
    state's last checkpoint (its restore point) and of its reference, when it has them."""
    from rewind.engine.checkpointing import load_checkpoint  # checkpointing builds on Parts

    if state.last_checkpoint is not None:
        parts = fresh_parts(config, run_dir, datasets)
        load_checkpoint(parts, state)
        return parts
    return fresh_parts(config, run_dir, datasets, starting_weights(config, state))


def starting_weights(config: Config, state: State | None) -> Pretrained | None:
    """The pretrained weights a run of `config` starts from (None: the seed's), checked against the
    identity the run recorded (`state`; None at the start itself, which records it)."""
    if not config.pretrained.path:
        return None
    try:
        pretrained = load_pretrained(config.pretrained.path, config)
    except PretrainedError as exc:
        raise RunError(str(exc)) from None
    if state is not None and state.pretrained and pretrained.identity != state.pretrained:
        raise RunError(
            f"pretrained: {config.pretrained.path} changed since the run started (sha256 {pretrained.identity[:12]}, "
            f"recorded {state.pretrained[:12]})",
            1,
        )
    return pretrained
