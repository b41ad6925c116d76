"""The shapes the control state and the events share: a model's layout, the KL reference, the last
optimizer reset, a checkpoint's reason. No logic; `rewind.states.state` and `rewind.states.events`
both build on them (the state holds events, and a fork's seed, an event's field, holds state)."""

from __future__ import annotations

from typing import Literal

import msgspec

CheckpointReason = Literal["interval", "boundary", "reference", "final", "stop"]
# How a stack's base weights are held: trained, fixed, or fixed and quantised to NF4 (bitsandbytes).
BaseMode = Literal["trainable", "frozen", "nf4"]


class Reference(msgspec.Struct, frozen=True, kw_only=True):
    stage: int
    step: int
    checkpoint: str
    layout: ModelLayout | None = None  # the model's structure then (None: the initial model)


class OptimizerResetRef(msgspec.Struct, frozen=True, kw_only=True):
    """The last OptimizerReset: the LR schedule counts from `step` when `lr_restarted`."""

    stage: int
    step: int
    lr_restarted: bool


class StackLayout(msgspec.Struct, frozen=True, kw_only=True):
    """One stack of the model as the log made it. `stack` is its identity (0 = the initial stack, then
    1, 2, ... in the order they joined), independent of where it sits, so a prepend renames nothing:
    parameter names, optimizer moments, dropout streams and checkpoint keys follow the identity."""

    stack: int
    num_blocks: int
    base: BaseMode = "trainable"
    dtype: Literal["fp32", "bf16"] = "fp32"  # its base weights' dtype (an nf4 base is fp32 before quantising)
    adapter_rank: int = 0  # LoRA adapters on its linear layers (0 = none)
    adapter_alpha: float = 0.0
    adapters_train: bool = False
    joined_step: int = 0


class ModelLayout(msgspec.Struct, frozen=True, kw_only=True):
    """The model's structure and what of it trains: everything needed to build it before loading any
    tensor. `stacks` run from the input side to the output side; `version` counts the growths (the
    trunk's version, which names its activation cache)."""

    stacks: list[StackLayout]
    embed_trains: bool = True
    head_trains: bool = True  # the final norm and the head
    version: int = 0
    growth: int = -1  # the config.growth entry that made it (-1 = the initial model)
