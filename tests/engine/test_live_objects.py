"""The live objects: `Parts` is immutable (a transition returns new Parts, never patches one), and a
model's weights are split into base and adapters in one place, which checkpoints, references and
growth all read through."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rewind.engine.model.layout import base_and_adapters
from rewind.engine.run.checkpointing import model_groups
from rewind.engine.run.effects import apply_effect
from rewind.engine.run.growth import grow, plain_weights
from rewind.states.events import ReferenceRefreshed
from rewind.states.growth import grown_layout, growth_event, initial_layout
from rewind.states.plan import started_state
from tests.engine.test_growth import _config, _fresh


def _grown(parts, config):
    """`parts` after the config's first growth (stack 1 appended at step 10)."""
    before = initial_layout(config.architecture.num_layers)
    event = growth_event(config, 0, before, 10, 2560)
    return grow(parts, before, grown_layout(before, event), event)


def test_parts_are_immutable_and_a_transition_returns_new_ones(tmp_path):
    config = _config('trunk = "lora"')
    parts = _fresh(config, tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.reference = parts.model  # type: ignore[misc]
    _, state = started_state(config)
    event = ReferenceRefreshed(step=0, tokens=0, stage=0)
    refreshed = apply_effect(parts, state, state, event)  # (a refresh leaves the layout as it is)
    assert refreshed is not parts and parts.reference is None and refreshed.reference is not None
    assert (
        refreshed.model is parts.model and refreshed.optimizer is parts.optimizer
    )  # only the reference is new
    grown = _grown(refreshed, config)
    assert grown.reference is refreshed.reference and grown.model is not refreshed.model


def test_base_and_adapters_are_split_once_for_checkpoints_and_growth(tmp_path):
    config = _config('trunk = "lora"')
    grown = _grown(_fresh(config, tmp_path), config)
    base, adapters = base_and_adapters(grown.model)
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert not any(".base_layer." in n or ".default." in n for n in (*base, *adapters))  # unwrapped names
    groups = model_groups(grown)
    assert groups["adapters"].keys() == adapters.keys()
    left_out = {n for n in base if n.startswith(tuple(f"stacks.{s}." for s in grown.trunk_sources))}
    assert groups["model"].keys() == base.keys() - left_out
    whole = plain_weights(grown)  # the fixed stacks' float weights come back in, from their sources
    assert whole.keys() == base.keys()
    assert all(torch.equal(whole[n], base[n]) for n in groups["model"])
