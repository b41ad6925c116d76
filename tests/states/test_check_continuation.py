"""A change of config against a run (rewind.states.check_continuation): which changes a fork from a
checkpoint may make, each refusal naming the fields, and the shapes an objective gives the weights."""

from __future__ import annotations

import msgspec
import pytest

from rewind.states.check_continuation import continuation_problem, model_vocab_size, num_time_levels
from rewind.states.config import GrowthStep, ObjectiveSection
from rewind.states.config_reading import loads_config

replace = msgspec.structs.replace

CONFIG = loads_config(
    """
[architecture]
block_size = 8
num_layers = 2

[[stages]]
tokens = 160
datasets = [{ name = "grammar" }]

[[stages]]
tokens = 160
datasets = [{ name = "sort" }]

[[growth]]
at_stage = 1
"""
)


def with_arch(**fields):
    return replace(CONFIG, architecture=replace(CONFIG.architecture, **fields))


def test_what_does_not_shape_the_weights_may_change():
    assert continuation_problem(CONFIG, CONFIG) == ""
    assert continuation_problem(CONFIG, with_arch(dropout=0.1, rope_base=500.0)) == ""
    assert continuation_problem(CONFIG, replace(CONFIG, run=replace(CONFIG.run, seed=7))) == ""
    # d_ff = 0 means 4 * d_model: the same shapes written out.
    assert continuation_problem(CONFIG, with_arch(d_ff=4 * CONFIG.architecture.d_model)) == ""


def test_the_shaping_architecture_fields_are_named_with_both_values():
    problem = continuation_problem(CONFIG, with_arch(d_model=32, num_layers=3))
    assert problem == (
        "architecture.num_layers (2 -> 3), architecture.d_model (64 -> 32), architecture.d_ff (256 -> 128) "
        "cannot change when continuing from a checkpoint: the weights have other shapes"
    )


def test_the_tokenizer_is_said_first():
    other = replace(
        CONFIG,
        tokenizer=replace(CONFIG.tokenizer, train_vocab_size=300),
        architecture=with_arch(d_model=32).architecture,
    )
    assert continuation_problem(CONFIG, other).startswith(
        "tokenizer: a run's tokenizer is fixed when it starts"
    )


def test_growths_already_performed_cannot_change_later_ones_may():
    moved = replace(CONFIG, growth=[replace(CONFIG.growth[0], num_blocks=2)])
    assert continuation_problem(CONFIG, moved, num_growths=0) == ""
    assert continuation_problem(CONFIG, moved, num_growths=1) == (
        "growth[0..0] already happened and cannot change when continuing from a checkpoint "
        "(the new config has 1 growth entries; change only later ones)"
    )
    more = replace(CONFIG, growth=[*CONFIG.growth, GrowthStep(at_tokens=200)])
    assert continuation_problem(CONFIG, more, num_growths=1) == ""
    targets = replace(CONFIG, lora=replace(CONFIG.lora, targets=["attn.qkv"]))
    assert continuation_problem(CONFIG, targets, num_growths=0) == ""
    assert continuation_problem(CONFIG, targets, num_growths=1).startswith("lora.targets cannot change")


@pytest.mark.parametrize(
    ("objective", "what"),
    [
        (ObjectiveSection(kind="mlm"), "vocabulary would change (256 -> 257)"),
        (ObjectiveSection(kind="diffusion"), "vocabulary"),
    ],
)
def test_an_objective_that_changes_the_model_is_refused(objective, what):
    problem = continuation_problem(CONFIG, replace(CONFIG, objective=objective))
    assert problem.startswith(f"objective: the model's {what}")


def test_time_levels_are_a_shape_too():
    depth = replace(CONFIG, objective=ObjectiveSection(kind="diffusion", time="depth"))
    problem = continuation_problem(depth, replace(depth, objective=replace(depth.objective, time="input")))
    assert problem.startswith("objective: the model's time levels would change (0 -> 16)")
    # A mask rate shapes nothing.
    assert (
        continuation_problem(depth, replace(depth, objective=replace(depth.objective, max_mask_rate=0.5)))
        == ""
    )


def test_the_shapes_an_objective_gives_the_model():
    assert model_vocab_size(ObjectiveSection(), 256) == 256
    assert model_vocab_size(ObjectiveSection(kind="mlm"), 256) == 257
    assert num_time_levels(ObjectiveSection(kind="diffusion", num_levels=8)) == 8
    assert num_time_levels(ObjectiveSection(kind="diffusion", time="depth")) == 0
    assert num_time_levels(ObjectiveSection(kind="mlm")) == 0
    with pytest.raises(ValueError, match=r"unknown objective\.kind 'gpt'"):
        model_vocab_size(ObjectiveSection(kind="gpt"), 256)  # type: ignore[arg-type]


def test_a_change_is_judged_by_the_tokenizer_alone_without_a_checkpoint_and_by_the_shapes_with_one():
    from rewind.states.check_continuation import change_problem
    from rewind.states.history import RestorePoint
    from rewind.states.state import State

    state = State()
    reshaped = with_arch(d_model=32)
    retokenised = replace(CONFIG, tokenizer=replace(CONFIG.tokenizer, train_vocab_size=300))
    at_start = RestorePoint(seq=0, state=state, checkpoint="")
    at_checkpoint = RestorePoint(seq=5, state=state, checkpoint="00000010-abcdef12")
    assert change_problem(CONFIG, reshaped, at_start) == ""  # no weights yet: any shape
    assert change_problem(CONFIG, reshaped, at_checkpoint) == continuation_problem(CONFIG, reshaped)
    assert change_problem(CONFIG, retokenised, at_start).startswith("tokenizer: a run's tokenizer is fixed")
    assert change_problem(CONFIG, retokenised, at_checkpoint).startswith("tokenizer: a run's tokenizer is fixed")
