"""A checkpoint's model read back: the model of a layout holding a checkpoint's weights, its base weights
from the checkpoint's own files and its frozen stacks' (RUN/trunks/), each checked against its hash.

Resume (rewind.engine.run.parts), the KL reference (rewind.engine.model.reference), sample and the export tests
read a checkpoint's model through here; writing one is rewind.engine.run.checkpointing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rewind.engine.model import layout as layouts
from rewind.states.config import Config
from rewind.states.state import ModelLayout
from rewind.stores.checkpoints import CheckpointStore
from rewind.stores.trunks import TrunkStore

Groups = dict[str, dict[str, torch.Tensor]]


class Loaded(NamedTuple):
    """A checkpoint's model and what came with it."""

    model: torch.nn.Module
    groups: Groups  # the checkpoint's tensor groups read (the optimizer's only when asked for)
    meta: dict
    sources: dict[int, dict[str, torch.Tensor]]  # the float weights of its fixed stacks
    hashes: dict[int, str]  # their files' sha256


def load_model(
    config: Config,
    store: CheckpointStore,
    name: str,
    files: dict[str, str] | None,
    layout: ModelLayout | None,
    *,
    with_optimizer: bool = False,
) -> Loaded:
    """The model of `layout` with checkpoint `name`'s weights (the optimizer group only `with_optimizer`:
    a reference needs none). Its base weights are the checkpoint's own and its frozen stacks' files
    (RUN/trunks/), each checked against its hash."""
    manifest = store.load_manifest(name)
    present = {entry.name.removesuffix(".safetensors") for entry in manifest.files}
    wanted = ("model", "adapters", "optimizer") if with_optimizer else ("model", "adapters")
    groups = store.load(name, files, groups=[g for g in wanted if g in present])
    meta = manifest.meta
    trunks = TrunkStore(store.run_dir)
    tensors = dict(groups["model"])
    for digest in meta.get("trunks", {}).values():
        tensors.update(trunks.load(digest))
    hashes = {int(stack): digest for stack, digest in meta.get("trunks", {}).items()}
    model, sources = layouts.model_from_weights(
        config, layout, tensors, groups.get("adapters", {}), complete=True
    )
    return Loaded(model, groups, meta, sources, hashes)
