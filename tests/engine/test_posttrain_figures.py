"""What a boundary evaluation of a post-training run records (rewind.engine.posttrain.posttrain_figures): nothing for a
pretraining run; the figures of rewind.engine.posttrain.posttrain_eval on each evaluated task's held-out prompts, with the
first grpo stage's G, temperature and new-token limit; against a reference equal to the model a win rate of
exactly 0.5 and, after a dpo stage, implicit rewards of exactly 0 (margin 0, accuracy 0: strictly above)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from rewind.engine.data.registry import DatasetRegistry
from rewind.engine.model.layout import build_model, eval_mode, quantise_stack
from rewind.engine.posttrain import posttrain_eval as pe
from rewind.engine.posttrain.posttrain_figures import boundary_figures, sampling_settings
from rewind.states.config_reading import loads_config
from tests.engine.test_dpo import DPO_TEXT, TINY
from tests.engine.test_posttrain_eval import Oracle, _right_when_even, _sorted


def _with_grpo():
    """test_dpo's run (pretrain, sft, dpo) with a last grpo stage: G = 2, T = 0.7, 10 new tokens (sort's
    longest answer and its end)."""
    return loads_config(_with_grpo_text())


def _with_grpo_text() -> str:
    dpo = "dpo = { beta = 0.1, sft_weight = 0.1 }"
    return DPO_TEXT.replace(dpo, dpo + "\noverlap = 0.0") + (
        '\n[[stages]]\nstrategy = "grpo"\ntokens = 6_144\ndatasets = [{ name = "sort", rate = 1.0 }]\n'
        "grpo = { group_size = 2, temperature = 0.7, max_new_tokens = 10 }\n"
    )


def _parts(config, reference=True):
    model = build_model(config, None)
    return SimpleNamespace(
        config=config, model=model, reference=copy.deepcopy(model) if reference else None,
        datasets=DatasetRegistry(config),
    )  # fmt: skip


def test_a_run_of_pretraining_stages_records_no_post_training_figures():
    config = loads_config(TINY)
    assert sampling_settings(config) is None
    assert boundary_figures(_parts(config), 0) == {}


@pytest.mark.parametrize("boundary", [-1, 1, 2])
def test_the_figures_are_posttrain_eval_s_on_the_held_out_prompts(boundary):
    config = _with_grpo()
    settings = sampling_settings(config)
    assert (settings.group_size, settings.temperature, settings.max_new_tokens) == (2, 0.7, 10)
    parts = _parts(config, reference=boundary >= 0)
    figures = boundary_figures(parts, boundary)
    assert set(figures) == {"reverse", "sort"}  # the evaluated tasks
    for task, got in figures.items():
        rows = pe.held_out_rows(task, config.training.eval_samples)
        judge = {"max_new_tokens": 10}
        assert got["pass@1"] == pe.pass_at_1(parts.model, rows, **judge)
        sampled = {"temperature": 0.7, "seed": config.run.seed, **judge}
        assert got["pass@2"] == pe.pass_at_k(parts.model, rows, k=2, **sampled)
        assert got["reward"] == pe.mean_reward(parts.model, rows, samples=2, **sampled)
        if boundary < 0:
            assert "win_rate" not in got  # no reference before training
        else:
            assert got["win_rate"] == 0.5  # the reference is the model: every prompt a tie
        if boundary == 2:  # the dpo stage: at its reference every implicit reward is 0
            assert got["dpo_accuracy"] == 0.0 and got["dpo_margin"] == 0.0
        else:
            assert "dpo_accuracy" not in got and "dpo_margin" not in got
    assert boundary_figures(parts, boundary) == figures  # keyed draws: the same figures again


def test_a_model_that_differs_from_its_reference_has_dpo_figures_of_its_own():
    config = _with_grpo()
    parts = _parts(config)
    noise = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in parts.reference.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=noise))
    figures = boundary_figures(parts, 2)["sort"]
    assert figures["dpo_margin"] != 0.0 and 0.0 <= figures["dpo_accuracy"] <= 1.0


def test_with_models_that_answer_the_figures_count_the_prompts_each_gets_right():
    """An oracle always right against a reference right on the prompts whose answer has an even length:
    pass@1, pass@G and the reward are 1, the win rate counts the prompts only the oracle gets right
    (test_posttrain_eval's oracles, on the run's own held-out sort prompts)."""
    config = loads_config(_with_grpo_text().replace('evaluations = ["reverse", "sort"]', 'evaluations = ["sort"]'))
    parts = _parts(config)
    parts.model, parts.reference = Oracle(), Oracle(_right_when_even)
    figures = boundary_figures(parts, 1)["sort"]
    rows = pe.held_out_rows("sort", config.training.eval_samples)
    even = sum(len(_sorted(row.text)) % 2 == 0 for row in rows)
    assert 0 < even < len(rows)  # both kinds: a win rate of 0.5 or 1.0 would be wrong
    assert figures == {"pass@1": 1.0, "pass@2": 1.0, "reward": 1.0, "win_rate": (len(rows) - even / 2) / len(rows)}
    parts.model, parts.reference = parts.reference, parts.model
    assert boundary_figures(parts, 1)["sort"]["win_rate"] == (even / 2) / len(rows)


def test_a_reference_s_nf4_layers_keep_the_mode_the_run_gave_them():
    """A reference is held in eval_mode (its Linear4bit layers in train mode: their eval mode repacks the
    weight for another kernel); measuring the figures leaves it so, and the model training."""
    config = _with_grpo()
    parts = _parts(config)
    quantise_stack(parts.reference.stacks["0"])
    eval_mode(parts.reference)
    quantised = [m for m in parts.reference.modules() if type(m).__name__ == "Linear4bit"]
    assert quantised and all(m.training for m in quantised) and not parts.reference.training
    boundary_figures(parts, 2)
    assert all(m.training for m in quantised) and not parts.reference.training
    assert parts.model.training and all(m.training for m in parts.model.modules())
