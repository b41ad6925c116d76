"""docs/from_trl.md cannot drift: every rewind setting it names exists with the default it quotes, every TRL
default it quotes is TRL 1.16.0's, every setting of a dpo and a grpo stage has its row, its TOML is TRL's
defaults, and the behaviours its rows state are rewind's (each against the formula TRL 1.16 computes,
written here from TRL's code: label smoothing, the sft term, bnpo, the advantages, the KL estimate, the
reward call, the logged reward and KL)."""

from __future__ import annotations

import ast
import math
import re
import sys
import tomllib

import msgspec
import pytest
import torch
import torch.nn.functional as F

from rewind.engine.posttrain.dpo_losses import dpo_loss
from rewind.engine.posttrain.grpo_losses import group_advantages, grpo_loss, grpo_normaliser, kl_estimate
from rewind.engine.posttrain.rewards import RewardError, score
from rewind.states.config import (
    ConfigError,
    DpoSettings,
    GrpoSettings,
    RewardSpec,
    TrainingSection,
)
from rewind.states.config_reading import loads_config
from tests.conftest import REPO

DOC = REPO / "docs" / "from_trl.md"

# TRL 1.16.0's defaults, read in trl/trainer/dpo_config.py and grpo_config.py (and transformers'
# TrainingArguments for the batch size and accumulation), as the page quotes them.
TRL_DPO = {"beta": 0.1, "loss_type": ["sigmoid"], "label_smoothing": 0.0, "loss_weights": None}
TRL_GRPO = {
    "num_generations": 8, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
    "max_completion_length": 512, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None,
    "repetition_penalty": 1.0, "num_iterations": 1, "epsilon": 0.2, "epsilon_high": None, "loss_type": "dapo",
    "scale_rewards": "group", "reward_weights": None, "beta": 0.0, "mask_truncated_completions": False,
    "disable_dropout": False, "use_bias_correction_kl": True,
}  # fmt: skip
SECTIONS = {"dpo": DpoSettings, "grpo": GrpoSettings, "training": TrainingSection}


def table(heading: str) -> list[list[str]]:
    """The rows (cells) of the table under `heading`, header and rule left out."""
    text = DOC.read_text()
    start = text.index(heading)
    body = text[start : text.find("\n## ", start + 1)]
    lines = [line for line in body.splitlines() if line.startswith("| ")][2:]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]


def spans(text: str) -> list[tuple[str, str | None]]:
    """(name, value or None) of every `name = value` and `name` code span of a cell."""
    found = []
    for span in re.findall(r"`([^`]+)`", text):
        m = re.fullmatch(r"([\w.]+)(?: = (.+))?", span)
        if m:
            found.append((m.group(1), m.group(2)))
    return found


def is_rewind_s(name: str) -> bool:
    return name.partition(".")[0] in SECTIONS or name in RewardSpec.__struct_fields__


def rewind_default(name: str):
    """The default of a rewind setting the page names (`grpo.kl_beta`, `training.batch_size`, `weight`)."""
    section, _, field = name.partition(".")
    struct, field = (SECTIONS[section], field) if field else (RewardSpec, section)
    assert field in struct.__struct_fields__, f"{name}: no such setting"
    return getattr(struct(), field)


def trl_defaults_quoted(cell: str) -> list[tuple[str, str]]:
    """The TRL spans a cell gives as defaults: inside "TRL's defaults (...)" or followed by "(TRL's default)"."""
    quoted = [spans(group) for group in re.findall(r"TRL's defaults \((.*?)\)", cell)]
    quoted.append(spans(" ".join(re.findall(r"`[^`]+` \(TRL's default\)", cell))))
    return [(name, value) for group in quoted for name, value in group if value is not None]


@pytest.mark.parametrize(("heading", "trl"), [("## DPO", TRL_DPO), ("## GRPO", TRL_GRPO)])
def test_every_name_and_default_the_tables_quote_is_rewind_s_or_trl_s(heading, trl):
    checked = 0
    for trl_cell, ours, differs, behaviour in table(heading):
        quoted = [(n, v) for n, v in spans(trl_cell) if v is not None and not v.endswith("w]")]
        for name, value in quoted + trl_defaults_quoted(differs) + trl_defaults_quoted(behaviour):
            assert name in trl and ast.literal_eval(value) == trl[name], f"TRL's {name} = {value}"
            checked += 1
        for name, value in spans(ours):  # rewind's column: the defaults
            if is_rewind_s(name):
                default = rewind_default(name)
                assert value is None or tomllib.loads(f"v = {value}")["v"] == default, f"{name} = {value}"
                checked += 1
        for name, value in spans(differs + " " + behaviour):  # what to write: a valid value of the setting
            if is_rewind_s(name) and "." in name:
                section, _, field = name.partition(".")
                rewind_default(name)
                if value is not None and not value.isidentifier():  # (`dpo.sft_weight = w`: a placeholder)
                    msgspec.convert({field: tomllib.loads(f"v = {value}")["v"]}, SECTIONS[section])
                checked += 1
    assert checked > 10


@pytest.mark.parametrize(("heading", "struct"), [("## DPO", DpoSettings), ("## GRPO", GrpoSettings)])
def test_every_setting_of_the_stage_has_its_row(heading, struct):
    text = " ".join(" ".join(row) for row in table(heading))
    prefix = heading.split()[1].lower()
    for field in struct.__struct_fields__:
        assert f"`{prefix}.{field}" in text or f"`[[stages.{prefix}.{field}]]`" in text, field


def test_trl_s_defaults_written_for_rewind_load_and_are_trl_s():
    (block,) = re.findall(r"```toml\n(.*?)```", DOC.read_text(), re.S)
    config = loads_config(block)
    dpo, grpo = config.stages[0].dpo, config.stages[1].grpo
    assert (dpo.beta, [dpo.loss], dpo.label_smoothing, dpo.sft_weight) == (
        TRL_DPO["beta"], TRL_DPO["loss_type"], TRL_DPO["label_smoothing"], 0.0,
    )  # fmt: skip
    assert (
        config.training.batch_size
        == TRL_GRPO["per_device_train_batch_size"] * TRL_GRPO["gradient_accumulation_steps"]
    )
    assert (grpo.group_size, grpo.max_new_tokens, grpo.temperature, grpo.num_iterations) == (
        TRL_GRPO["num_generations"], TRL_GRPO["max_completion_length"], TRL_GRPO["temperature"], TRL_GRPO["num_iterations"],
    )  # fmt: skip
    assert (grpo.epsilon_low, grpo.epsilon_high, grpo.kl_beta) == (0.2, 0.2, TRL_GRPO["beta"])
    assert (grpo.loss_type, grpo.scale_rewards, grpo.kl_estimator) == (TRL_GRPO["loss_type"], "group", "k3")
    assert grpo.mask_truncated_completions is TRL_GRPO["mask_truncated_completions"]
    assert config.stages[0].refresh_reference


# --- DPO ---------------------------------------------------------------------------------------------

PAIRS = [
    torch.tensor(v) for v in ([-3.0, -5.0, -2.5], [-4.0, -4.5, -6.0], [-3.5, -4.0, -2.0], [-3.0, -5.0, -5.0])
]
LENGTHS = torch.tensor([3, 5, 2]), torch.tensor([4, 4, 6])


def test_label_smoothing_makes_sigmoid_conservative_dpo_where_trl_s_sigmoid_ignores_it():
    x = 0.1 * ((PAIRS[0] - PAIRS[2]) - (PAIRS[1] - PAIRS[3]))
    trl_sigmoid = -F.logsigmoid(x)  # TRL 1.16: `sigmoid` reads no label_smoothing
    plain = dpo_loss(*PAIRS, beta=0.1, variant="sigmoid").losses
    smoothed = dpo_loss(*PAIRS, beta=0.1, variant="sigmoid", label_smoothing=0.2).losses
    assert torch.allclose(plain, trl_sigmoid)
    assert torch.allclose(smoothed, -0.8 * F.logsigmoid(x) - 0.2 * F.logsigmoid(-x))
    assert not torch.allclose(smoothed, trl_sigmoid, atol=1e-3)
    # robust is TRL's formula: (clean - flipped) / (1 - 2 ls)
    clean, flipped = -0.8 * F.logsigmoid(x), -0.2 * F.logsigmoid(-x)
    robust = dpo_loss(*PAIRS, beta=0.1, variant="robust", label_smoothing=0.2).losses
    assert torch.allclose(robust, (clean - flipped) / 0.6)


@pytest.mark.parametrize("loss", ["ipo", "hinge"])
def test_label_smoothing_with_ipo_or_hinge_is_a_config_error(loss):
    stage = (
        f'\n[[stages]]\nstrategy = "dpo"\ntokens = 5120\ndatasets = [{{ name = "sort" }}]\n'
        f'refresh_reference = true\ndpo = {{ loss = "{loss}", label_smoothing = 0.1 }}\n'
    )
    with pytest.raises(ConfigError, match="label_smoothing"):
        loads_config(stage)
    assert loads_config(stage.replace(", label_smoothing = 0.1", "")).stages[0].dpo.loss == loss


def test_the_logged_dpo_loss_leaves_the_sft_term_out_and_trl_s_is_their_sum():
    without = dpo_loss(*PAIRS, beta=0.1, chosen_lengths=LENGTHS[0], rejected_lengths=LENGTHS[1])
    with_sft = dpo_loss(
        *PAIRS, beta=0.1, chosen_lengths=LENGTHS[0], rejected_lengths=LENGTHS[1], sft_weight=0.5
    )
    assert float(with_sft.loss) == float(without.loss)  # what StepCommitted.loss holds
    nll_per_token = -PAIRS[0].sum() / LENGTHS[0].sum()  # TRL's "sft" loss_type in one micro-batch
    assert torch.allclose(with_sft.sft_loss, 0.5 * nll_per_token)
    trl_logged = without.loss + 0.5 * nll_per_token  # loss_type ["sigmoid", "sft"], loss_weights [1, 0.5]
    assert torch.allclose(with_sft.loss + with_sft.sft_loss, trl_logged)


def test_a_dpo_step_logs_the_preference_loss_alone_and_the_sft_term_apart():
    import copy

    from rewind.engine.data.registry import DatasetRegistry
    from rewind.engine.model.layout import build_model, eval_mode
    from rewind.engine.posttrain.dpo_step import dpo_train_step, preference_rows
    from rewind.engine.step.step import build_optimizer

    config = loads_config(
        "[architecture]\nblock_size = 32\nnum_layers = 1\nnum_heads = 2\nd_model = 16\n"
        '[[stages]]\nstrategy = "dpo"\ntokens = 1024\ndatasets = [{ name = "sort" }]\nrefresh_reference = true\n'
        "dpo = { sft_weight = 0.5 }\n"
    )
    model = build_model(config, None)
    reference = eval_mode(copy.deepcopy(model))
    batch, _ = preference_rows(config, config.stages[0], 8, {}, DatasetRegistry(config).examples)
    result = dpo_train_step(
        model, build_optimizer(model, config), batch, config=config, stage=config.stages[0], lr=0.0,
        reference=reference,
    )  # fmt: skip
    # At the reference the preference loss is ln 2; the sft term (0.5 x NLL per chosen token) is apart:
    # TRL's logged loss would be their sum.
    assert result.loss == pytest.approx(math.log(2), abs=1e-6)
    assert result.metrics["sft_loss"] > 1.0  # a random model's NLL per byte is about ln 256


# --- GRPO ----------------------------------------------------------------------------------------------


def _micro_batches():
    """Two micro-batches of unequal token counts (4 + 1 and 6 + 6 tokens)."""
    generator = torch.Generator().manual_seed(3)
    masks = [torch.tensor([[1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]]), torch.ones(2, 6, dtype=torch.int64)]
    logps = [-torch.rand(2, 6, generator=generator) for _ in masks]
    advantages = [torch.tensor([1.0, -0.5]), torch.tensor([0.25, -1.5])]
    return [m.bool() for m in masks], logps, advantages


def test_bnpo_normalises_over_the_step_as_dapo_where_trl_s_bnpo_takes_each_micro_batch():
    masks, logps, advantages = _micro_batches()
    losses = {}
    for loss_type in ("bnpo", "dapo"):
        n = grpo_normaliser(masks, loss_type, 6)
        losses[loss_type] = sum(
            float(grpo_loss(lp, lp, None, a, m, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.2, normaliser=n).loss)
            for lp, a, m in zip(logps, advantages, masks, strict=True)
        )  # fmt: skip
    assert grpo_normaliser(masks, "bnpo", 6) == grpo_normaliser(masks, "dapo", 6) == 17.0
    assert losses["bnpo"] == losses["dapo"]
    # TRL 1.16's bnpo: each micro-batch's token mean, divided by the accumulation steps
    trl_bnpo = sum(
        float((-a[:, None] * m).sum() / m.sum()) / 2 for a, m in zip(advantages, masks, strict=True)
    )
    assert abs(losses["bnpo"] - trl_bnpo) > 0.05
    # In one micro-batch the two are the same.
    m, lp, a = masks[0], logps[0], advantages[0]
    ours = grpo_loss(
        lp,
        lp,
        None,
        a,
        m,
        loss_type="bnpo",
        epsilon_low=0.2,
        epsilon_high=0.2,
        normaliser=grpo_normaliser([m], "bnpo", 6),
    )
    assert math.isclose(float(ours.loss), float((-a[:, None] * m).sum() / m.sum()), rel_tol=1e-6)


def _trl_advantages(rewards: torch.Tensor, scale: str) -> torch.Tensor:
    """TRL 1.16's advantages (its code's steps): nanmean per group, its nanstd (Bessel, NaN below two
    values), + 1e-4, NaN -> 0."""

    def nanstd(t: torch.Tensor, dim=None) -> torch.Tensor:
        mean = torch.nanmean(t, dim=dim, keepdim=True)
        variance = torch.nanmean((t - mean) ** 2, dim=dim, keepdim=True)
        count = (~torch.isnan(t)).sum(dim=dim, keepdim=True)
        return torch.sqrt(variance * torch.where(count > 1, count / (count - 1), torch.nan))

    centred = rewards - torch.nanmean(rewards, dim=1, keepdim=True)
    if scale == "none":
        return torch.nan_to_num(centred, nan=0.0)
    std = nanstd(rewards, dim=1) if scale == "group" else nanstd(rewards.reshape(-1)).reshape(1, 1)
    return torch.nan_to_num(centred / (std + 1e-4), nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trl_s_unscored_completions_included(scale):
    nan = math.nan
    rewards = torch.tensor(
        [[1.0, 0.0, nan, 0.5], [nan, nan, nan, nan], [0.3, nan, nan, nan], [2.0, 2.0, 2.0, 1.0]],
        dtype=torch.float64,
    )
    ours = group_advantages(rewards, scale_rewards=scale)
    assert torch.allclose(ours, _trl_advantages(rewards, scale), atol=1e-12)
    assert ours[0, 2] == 0 and bool((ours[1] == 0).all()) and ours[2, 0] == 0  # unscored, or alone: 0


def test_k3_is_trl_s_kl_and_the_loss_weights_it_by_the_ratio():
    generator = torch.Generator().manual_seed(5)
    logp, ref, old = (-torch.rand(3, 4, generator=generator) * 3 for _ in range(3))
    trl_k3 = torch.exp(ref - logp) - (ref - logp) - 1
    assert torch.allclose(kl_estimate(logp, ref, "k3"), trl_k3)
    mask = torch.ones(3, 4, dtype=torch.bool)
    zero = torch.zeros(3)  # no advantage: the loss is the KL term alone
    out = grpo_loss(
        logp,
        old,
        ref,
        zero,
        mask,
        loss_type="dapo",
        epsilon_low=0.2,
        epsilon_high=0.2,
        normaliser=12.0,
        kl_beta=0.5,
    )
    ratio = torch.exp(logp - old)  # TRL's use_bias_correction_kl = True: the term is beta * ratio * k3
    assert torch.allclose(out.loss, 0.5 * (ratio * trl_k3).sum() / 12.0)


# --- the reward call -----------------------------------------------------------------------------------

MODULE = """
calls = []

def recording(prompts, completions, completion_ids, **kwargs):
    calls.append((prompts, completions, completion_ids, kwargs))
    return [float(len(c)) for c in completions]

def trl_style(completions, **kwargs):
    return [0.0 for _ in completions]
"""


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    name = "from_trl_doc_rewards"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_reward_function_gets_three_lists_by_position_and_the_answer_by_keyword(reward_module):
    prompts, texts, ids = ["rev ab=", "rev ab="], ["ba", "b"], [[98, 97], [98]]
    rewards = score([f"{reward_module}:recording"], prompts, texts, ids, {"answer": ["ba", "ba"]})
    assert rewards.tolist() == [[2.0, 1.0]]
    (call,) = sys.modules[reward_module].calls
    assert call == (prompts, texts, ids, {"answer": ["ba", "ba"]})
    with pytest.raises(RewardError, match="trl_style failed: TypeError"):  # TRL's keyword-only style
        score([f"{reward_module}:trl_style"], prompts, texts, ids, {"answer": ["ba", "ba"]})


# --- the logged figures of a grpo step ---------------------------------------------------------------------


def test_a_grpo_step_logs_the_reward_over_scored_completions_and_the_weighted_kl_the_loss_uses():
    from rewind.engine.data.example_batches import completion_batch
    from rewind.engine.model.layout import build_model
    from rewind.engine.posttrain.grpo_step import grpo_train_step
    from rewind.engine.posttrain.rolloutreader import TrainingRows
    from rewind.engine.posttrain.rollouts import logprobs_of
    from rewind.engine.step.step import build_optimizer

    config = loads_config(
        "[architecture]\nblock_size = 32\nnum_layers = 1\nnum_heads = 2\nd_model = 16\n[training]\nbatch_size = 4\n"
        '[[stages]]\nstrategy = "grpo"\ntokens = 1024\ndatasets = [{ name = "sort" }]\nrefresh_reference = true\n'
        "[stages.grpo]\ngroup_size = 2\nmax_new_tokens = 6\nkl_beta = 0.1\ntemperature = 0.7\n"
    )
    model = build_model(config, None)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(11, 120, (4,), generator=generator).tolist() for _ in range(2)]
    completions = [[*torch.randint(11, 120, (n,), generator=generator).tolist(), 10] for n in (2, 5, 3, 4)]
    batch = completion_batch([prompts[i // 2] for i in range(4)], completions, 10, 0, 32)
    old = logprobs_of(model, batch.tokens, batch.completion_mask, config, 0.7)
    reference = old + 0.3 * torch.randn(old.shape, generator=generator) * batch.completion_mask
    rewards = torch.tensor([[1.0, math.nan, 0.0, 0.0]])
    rows = TrainingRows(
        batch.tokens, batch.completion_mask, old, reference, torch.tensor([1.0, 0.0, -1.0, 1.0]), rewards
    )
    optimizer = build_optimizer(model, config)
    stage = config.stages[0]
    first = grpo_train_step(model, optimizer, rows, config=config, stage=stage, lr=0.05)
    now = logprobs_of(model, batch.tokens, batch.completion_mask, config, 0.7)  # the second update's policy
    second = grpo_train_step(model, optimizer, rows, config=config, stage=stage, lr=0.05)
    mask = batch.completion_mask
    k3 = kl_estimate(now, reference, "k3")[mask]
    weighted = float((torch.exp(now - old)[mask] * k3).sum() / mask.sum())
    assert math.isclose(second.metrics["kl"], weighted, rel_tol=1e-5) and second.kl == second.metrics["kl"]
    assert abs(weighted - float(k3.mean())) > 1e-4 * abs(weighted)  # not the plain mean
    plain_first = float(kl_estimate(old, reference, "k3")[mask].mean())  # ratio 1 on the first update
    assert math.isclose(first.metrics["kl"], plain_first, rel_tol=1e-5)
    assert math.isclose(first.metrics["reward"], 1.0 / 3.0, rel_tol=1e-6) and first.metrics["unscored"] == 1.0


def test_the_quoted_defaults_are_trl_1_16_s_where_it_is_installed():
    """The table above was read in TRL 1.16.0's code; with that release installed, its config classes
    hold exactly those defaults (another release: skipped, the page quotes 1.16)."""
    trl = pytest.importorskip("trl")
    if not trl.__version__.startswith("1.16."):
        pytest.skip(f"the page quotes TRL 1.16; trl {trl.__version__} is installed")
    import dataclasses

    from trl import DPOConfig, GRPOConfig

    for config, quoted in ((DPOConfig, TRL_DPO), (GRPOConfig, TRL_GRPO)):
        fields = {f.name: f for f in dataclasses.fields(config)}
        for name, value in quoted.items():
            field = fields[name]
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            assert default == value, (config.__name__, name, default, value)
