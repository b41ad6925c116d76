"""How the live objects of a run (`Parts`, rewind.engine.step.live) are built from the folded state.

`Parts` holds what computes (model, optimizer, reference, datasets) and where tensors live (the
checkpoint store); it holds no control state (that is `fold(events)`) and nothing that writes the log
(that is `rewind.engine.run.journal.Journal`, which only the live loop has). `build_parts` is the one way
to get them: from a config and the state the log folds to, loading the tensors of the state's restore
checkpoint and of its reference. The live loop, resume, fork and replay all come through here, so a
resumed process holds exactly what the one that never stopped held.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from rewind.engine.data.datasets import DatasetError
from rewind.engine.data.registry import DatasetRegistry
from rewind.engine.data.userdata import DataHome
from rewind.engine.model import layout as layouts
from rewind.engine.model.checkpoint_model import load_model
from rewind.engine.model.model import GPT
from rewind.engine.model.optimizer import AdamW
from rewind.engine.model.placement import place
from rewind.engine.model.pretrained import Pretrained, PretrainedError, apply_pretrained, load_pretrained
from rewind.engine.model.reference import reference_at
from rewind.engine.model.tensors import load_optimizer_tensors
from rewind.engine.step.kinds import spec_of
from rewind.engine.step.live import Parts
from rewind.engine.step.step import apply_hyperparameters, build_optimizer
from rewind.states.config import Config
from rewind.states.schedule import Schedule
from rewind.states.state import State
from rewind.stores.checkpoints import CheckpointStore
from rewind.stores.trunks import serialize


class RunError(Exception):
    """A run cannot be started or resumed as asked. exit_code: 2 usage/config, 1 state of the run."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def trunk_digests(sources: dict[int, dict[str, torch.Tensor]], known: dict[int, str]) -> dict[int, str]:
    """The sha256 of every fixed stack's file: the `known` ones (a checkpoint's record, or unchanged
    since), the others computed from the weights (what its file will hold: stores.trunks)."""
    return {stack: known[stack] if stack in known else serialize(tensors)[1] for stack, tensors in sorted(sources.items())}


def assembled(
    config: Config,
    run_dir: str,
    datasets: DatasetRegistry,
    model: GPT,
    *,
    moments: Callable[[AdamW, dict[nn.Parameter, str]], None] | None = None,
    sources: dict[int, dict[str, torch.Tensor]] | None = None,
    hashes: dict[int, str] | None = None,
    schedule: Schedule | None = None,
    store: CheckpointStore | None = None,
) -> Parts:
    """Parts around `model` (built, not yet placed): placed on its device (sharded when the run is) before
    the optimizer is built over its parameters; `moments` then fills the optimizer (a checkpoint's, or
    those a growth carries). The reference is the caller's (rewind.engine.model.reference)."""
    model = place(model, config)
    optimizer = build_optimizer(model, config)
    names = layouts.parameter_names(model)
    if moments is not None:
        moments(optimizer, names)
    return Parts(
        config=config,
        run_dir=run_dir,
        schedule=schedule if schedule is not None else Schedule(config),
        model=model,
        optimizer=optimizer,
        datasets=datasets,
        store=store if store is not None else CheckpointStore(run_dir),
        param_names=names,
        trunk_sources=sources or {},
        trunk_hashes=trunk_digests(sources or {}, hashes or {}),
    )


def open_datasets(config: Config, home: DataHome) -> DatasetRegistry:
    """Open every dataset the config names now, so a bad one fails before any log is touched, and check
    each stage as its kind requires (its examples read; a grpo stage's reward functions tried: KindError)."""
    try:
        datasets = DatasetRegistry(config, home)
        for stage in config.stages:
            for sampling in stage.datasets:
                datasets[sampling.name]
            spec_of(stage).check(stage, datasets, home.base_dir)
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
        model = layouts.build_model(config, None)
    else:
        plain = layouts.build_plain(config, None)
        apply_pretrained(plain, pretrained.tensors)
        model = layouts.shape(plain, config, None)
    return assembled(config, run_dir, datasets, model)


def build_parts(config: Config, run_dir: str, state: State, datasets: DatasetRegistry) -> Parts:
    """The live objects a run has at `state`: built for `config`, with the tensors of the state's last
    checkpoint (its restore point) and of its reference, when it has them."""
    if state.last_checkpoint is not None:
        return load_checkpoint(config, run_dir, state, datasets)
    return fresh_parts(config, run_dir, datasets, starting_weights(config, state))


def load_checkpoint(config: Config, run_dir: str, state: State, datasets: DatasetRegistry) -> Parts:
    """The live objects at the state's last checkpoint: its model (of the state's layout), an optimizer
    over what it trains holding its moments, and its reference (if any) from the checkpoint the
    reference points to. Every file is checked against the hashes the log recorded."""
    ref = state.last_checkpoint
    assert ref is not None
    store = CheckpointStore(run_dir)
    loaded = load_model(config, store, ref.checkpoint, ref.files, state.layout, with_optimizer=True)

    def moments(optimizer, names) -> None:  # the saved moments, under the settings of the config in force
        load_optimizer_tensors(optimizer, names, loaded.groups["optimizer"], loaded.meta["optimizer"])
        apply_hyperparameters(optimizer, config)

    parts = assembled(
        config, run_dir, datasets, loaded.model, moments=moments, sources=loaded.sources, hashes=loaded.hashes, store=store
    )
    return replace(parts, reference=reference_at(config, store, state, parts.model, loaded.sources))


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
