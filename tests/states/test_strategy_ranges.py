"""Every number of a post-training stage's settings is checked at the range the stage computes with it
(rewind.states.stagekinds): a value the config check accepts never breaks the stage's math, and
one it refuses is said with its path before anything is recorded (issue 33, point 11:
grpo temperature = 1e-300 and epsilon_high = 1e308 passed the check and crashed at the stage).

The property test draws settings from the whole range of finite floats, keeps those the check accepts
and calls the pure helpers the stage calls with them: the sampler's draw and log-probs at the
temperature, the grpo and dpo losses and the reward weighting. At a stage's first step (the policy is
the reference and the old policy) every accepted value gives a finite loss and finite gradients; at any
step, no accepted value raises. Imports torch for that (the rules themselves stay pure)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.engine.posttrain.dpo_losses import DPO_VARIANTS, dpo_loss
from rewind.engine.posttrain.generation import _draw
from rewind.engine.posttrain.grpo_losses import KL_ESTIMATORS, LOSS_TYPES, grpo_loss, weighted_rewards
from rewind.engine.posttrain.response_logprobs import token_logprobs
from rewind.states.config_error import ConfigError
from rewind.states.config_reading import loads_config
from rewind.states.stagekinds.dpo import IPO_MIN_BETA
from rewind.states.stagekinds.rules import FLOAT32_MAX, FLOAT32_TINY, MIN_TEMPERATURE
from tests.conftest import EXAMPLES

TINY = (
    (EXAMPLES / "tiny.toml")
    .read_text()
    .replace("[training.fade]\noverlap = 0.5", "[training.fade]\noverlap = 0.0")
)
THIRD = 'datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]\nbeta = 0.2'
BOUNDARIES = (0.0, FLOAT32_TINY, FLOAT32_MAX, MIN_TEMPERATURE, IPO_MIN_BETA, 0.5, 1.0)


def _stage(strategy: str, table: str) -> str:
    return TINY.replace(
        THIRD, f'strategy = "{strategy}"\ndatasets = [{{ name = "sort", rate = 1.0 }}]\n{table}'
    )


def grpo_text(weight: float = 1.0, **values: float | str) -> str:
    fields = ", ".join(f"{k} = {v!r}" if isinstance(v, float) else f'{k} = "{v}"' for k, v in values.items())
    rewards = f'rewards = [{{ function = "exact_match", weight = {weight!r} }}]'
    return _stage("grpo", f"grpo = {{ {fields}{', ' if fields else ''}{rewards} }}")


def dpo_text(**values: float | str) -> str:
    fields = ", ".join(f"{k} = {v!r}" if isinstance(v, float) else f'{k} = "{v}"' for k, v in values.items())
    return _stage("dpo", f"dpo = {{ {fields} }}")


def problems(text: str) -> list[str]:
    try:
        loads_config(text)
    except ConfigError as error:
        return error.problems
    return []


def test_the_values_that_crashed_the_stage_are_refused_at_once_with_their_paths():
    said = problems(grpo_text(temperature=1e-300, epsilon_high=1e308, kl_beta=1e300, weight=1e-300))
    assert said == [
        "stages[2].grpo.temperature: must be at least 0.01 (the log-probs and the importance ratio move 1/T "
        "times as fast as the float32 logits), got 1e-300",
        "stages[2].grpo.epsilon_high: must be at most 3.4e38 (the stage computes with it in float32), got 1e+308",
        "stages[2].grpo.kl_beta: must be at most 3.4e38 (the stage computes with it in float32), got 1e+300",
        "stages[2].grpo.rewards[0].weight: must not lie in (0, 1.2e-38), below float32's normal numbers (the "
        "stage computes with it in float32), got 1e-300",
    ]


def test_a_dpo_stage_s_scales_are_float32_numbers_and_the_ipo_target_too():
    assert problems(dpo_text(beta=1e39, sft_weight=1e-39)) == [
        "stages[2].dpo.beta: must be at most 3.4e38 (the stage computes with it in float32), got 1e+39",
        "stages[2].dpo.sft_weight: must not lie in (0, 1.2e-38), below float32's normal numbers (the stage "
        "computes with it in float32), got 1e-39",
    ]
    assert problems(dpo_text(beta=1e-25, loss="ipo")) == [
        "stages[2].dpo.beta: the ipo loss needs at least 2.8e-20 (its target 1 / (2 beta), squared, is a "
        "float32), got 1e-25"
    ]
    assert problems(dpo_text(beta=1e-25, loss="sigmoid")) == []


def test_the_bounds_themselves_are_accepted():
    assert (
        problems(grpo_text(temperature=MIN_TEMPERATURE, epsilon_high=FLOAT32_MAX, kl_beta=FLOAT32_MAX)) == []
    )
    assert problems(grpo_text(kl_beta=FLOAT32_TINY, weight=FLOAT32_TINY)) == []
    assert problems(dpo_text(beta=IPO_MIN_BETA, loss="ipo", sft_weight=FLOAT32_MAX)) == []


def test_a_refused_setting_records_nothing(tmp_path, rewind_cli):
    config = tmp_path / "run.toml"
    config.write_text(grpo_text(temperature=1e-300, epsilon_high=1e308))
    code, _, err = rewind_cli("train", config, "--run-dir", tmp_path / "run", "--no-progress")
    assert code == 2, err
    assert "stages[2].grpo.temperature: must be at least 0.01" in err and "Traceback" not in err
    assert "stages[2].grpo.epsilon_high: must be at most 3.4e38" in err
    assert not (tmp_path / "run").exists()


def test_the_learning_rate_a_step_takes_is_a_float32_number(tmp_path, rewind_cli):
    """lr = 1e308, or lr_scale = 1e308 on a stage, passed the check and raised inside torch's optimizer
    at the first step, after RunStarted."""
    assert problems(TINY.replace("lr = 3e-3", "lr = 1e308")) == [
        "optimization.lr: must be at most 3.4e38 (the optimizer updates float32 weights with it), got 1e+308"
    ]
    scaled = TINY.replace(
        "beta = 0.2\nrefresh_reference = true", "beta = 0.2\nrefresh_reference = true\nlr_scale = 1e300"
    )
    assert problems(scaled) == [
        "stages[1].lr_scale: the learning rate 0.003 x lr_scale 1e+300 must be at most 3.4e38 (the optimizer "
        "updates float32 weights with it)"
    ]
    config = tmp_path / "run.toml"
    config.write_text(scaled)
    code, _, err = rewind_cli("train", config, "--run-dir", tmp_path / "run", "--no-progress")
    assert code == 2 and "stages[1].lr_scale: the learning rate" in err, err
    assert not (tmp_path / "run").exists()


# --- the property: what the check accepts, the stage's math holds ---------------------------------------


def _finite_floats() -> st.SearchStrategy[float]:
    """Any finite non-negative float, spread over the exponents, with the bounds and their neighbours."""
    spread = st.builds(lambda m, e: m * 10.0**e, st.floats(1.0, 9.99), st.integers(-320, 307))
    edges = st.sampled_from(BOUNDARIES).flatmap(
        lambda b: st.sampled_from([b, math.nextafter(b, 0.0), math.nextafter(b, math.inf)])
    )
    return st.one_of(spread, edges, st.floats(0.0, 2.0))


def _logits(rows: int, generator: torch.Generator) -> torch.Tensor:
    """Logits as a model gives them (a spread of tens), float32, one row per completion token."""
    return torch.randn(rows, 1, 11, generator=generator) * 30.0


def _grpo_first_and_later(settings_: object, logp: torch.Tensor) -> None:
    s = settings_
    mask = torch.ones_like(logp, dtype=torch.bool)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    for loss_type in LOSS_TYPES:
        for estimator in KL_ESTIMATORS:
            policy = logp.clone().requires_grad_(True)
            out = grpo_loss(
                policy, logp, logp, advantages, mask, loss_type=loss_type, epsilon_low=s.epsilon_low,
                epsilon_high=s.epsilon_high, normaliser=4.0, kl_beta=s.kl_beta, kl_estimator=estimator,
            )  # fmt: skip
            out.loss.backward()
            assert torch.isfinite(out.loss) and torch.isfinite(policy.grad).all(), (loss_type, estimator)
            # a later update of the window: the policy has moved; nothing raises (the loss may overflow,
            # which the run's on_nonfinite handles)
            grpo_loss(
                logp + 0.5, logp, logp, advantages, mask, loss_type=loss_type, epsilon_low=s.epsilon_low,
                epsilon_high=s.epsilon_high, normaliser=4.0, kl_beta=s.kl_beta, kl_estimator=estimator,
            )  # fmt: skip


@settings(max_examples=150)
@given(
    temperature=_finite_floats(), epsilon_low=st.floats(0.0, 1.0), epsilon_high=_finite_floats(),
    kl_beta=_finite_floats(), weight=_finite_floats(), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_any_accepted_grpo_setting_keeps_the_sampler_and_the_loss_finite(
    temperature, epsilon_low, epsilon_high, kl_beta, weight, seed
):
    text = grpo_text(
        weight=weight,
        temperature=temperature,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        kl_beta=kl_beta,
    )
    if problems(text):
        return
    s = loads_config(text).stages[2].grpo
    generator = torch.Generator().manual_seed(seed)
    logits = _logits(4, generator)
    drawn = _draw(logits[:, 0], s.temperature, [(seed, 2, 0, row, 0) for row in range(4)], 0)
    assert ((drawn >= 0) & (drawn < 11)).all()
    logp = token_logprobs(logits, drawn[:, None], torch.ones(4, 1, dtype=torch.bool), s.temperature)
    assert torch.isfinite(logp).all(), s.temperature
    _grpo_first_and_later(s, logp.detach())
    rewards = weighted_rewards(torch.tensor([[0.0, 1.0, 1.0, 0.0]]), [r.weight for r in s.rewards])
    assert torch.isfinite(rewards).all()


@settings(max_examples=100)
@given(
    beta=_finite_floats(), label_smoothing=st.floats(0.0, 0.5), sft_weight=_finite_floats(),
    variant=st.sampled_from(DPO_VARIANTS), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_any_accepted_dpo_setting_keeps_the_first_step_s_loss_finite(
    beta, label_smoothing, sft_weight, variant, seed
):
    text = dpo_text(beta=beta, label_smoothing=label_smoothing, sft_weight=sft_weight, loss=variant)
    if problems(text):
        return
    s = loads_config(text).stages[2].dpo
    generator = torch.Generator().manual_seed(seed)
    chosen, rejected = -torch.rand(4, generator=generator) * 50, -torch.rand(4, generator=generator) * 50
    lengths = torch.tensor([3, 5, 7, 9])
    policy = chosen.clone().requires_grad_(True)
    out = dpo_loss(
        policy, rejected, chosen, rejected, beta=s.beta, variant=s.loss, label_smoothing=s.label_smoothing,
        chosen_lengths=lengths, rejected_lengths=lengths, sft_weight=s.sft_weight,
    )  # fmt: skip
    out.loss.backward()  # the preference loss (the sft term is sft_weight x the NLL, as large as asked)
    assert torch.isfinite(out.loss) and torch.isfinite(policy.grad).all(), (s.beta, s.loss)
    later = dpo_loss(
        chosen + 1.0, rejected - 1.0, chosen, rejected, beta=s.beta, variant=s.loss,
        label_smoothing=s.label_smoothing, chosen_lengths=lengths, rejected_lengths=lengths, sft_weight=s.sft_weight,
    )  # fmt: skip
    assert later.losses.shape == (4,)


@pytest.mark.parametrize("temperature", [MIN_TEMPERATURE, 1.0, 1e300])
def test_the_sampler_s_log_probs_are_finite_at_the_accepted_extremes(temperature):
    logits = torch.tensor([[[-1e4, 0.0, 1e4]]])
    logp = token_logprobs(logits, torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.bool), temperature)
    assert torch.isfinite(logp).all()
