"""The `dpo` strategy: a step reads its pairs at the datasets' cursors as [chosen; rejected]; at the
reference (policy = reference, as on entering the stage) the log-ratios are exactly 0, the loss ln 2
and the accuracy 0; micro-batches of pairs give the gradient of the whole batch. (Killed and resumed:
test_posttrain_kill; two processes: test_distributed_posttrain.)"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rewind.engine.data.cursors import sample_indices
from rewind.engine.data.example_batches import preference_batch
from rewind.engine.data.examples import task_preference_row
from rewind.engine.data.registry import DatasetRegistry
from rewind.engine.model.layout import build_model, eval_mode
from rewind.engine.model.placement import Placement, PlacementError, check_compute
from rewind.engine.posttrain.dpo_step import dpo_train_step, preference_rows
from rewind.engine.step.step import build_optimizer
from rewind.states.config_reading import loads_config
from tests.conftest import EXAMPLES

TINY = (EXAMPLES / "tiny.toml").read_text()
SECOND = 'tokens = 12_800\ndatasets = [{ name = "reverse", rate = 1.0 }]\nbeta = 0.2\nrefresh_reference = true'
THIRD = 'datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]\nbeta = 0.2'
# pretrain on grammar -> sft on reverse -> dpo on sort and reverse (no fade into the dpo stage)
DPO_TEXT = TINY.replace(SECOND, 'strategy = "sft"\ntokens = 12_800\ndatasets = [{ name = "reverse", rate = 1.0 }]\noverlap = 0.0').replace(
    THIRD,
    'strategy = "dpo"\ndatasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]\n'
    "refresh_reference = true\ndpo = { beta = 0.1, sft_weight = 0.1 }",
)
DPO = loads_config(DPO_TEXT)
NEWLINE = 10


def test_a_dpo_step_reads_its_pairs_at_the_cursors_chosen_then_rejected():
    batch, cursors = preference_rows(DPO, DPO.stages[2], 8, {"reverse": 5}, DatasetRegistry(DPO).examples)
    assert cursors == {"sort": 4, "reverse": 9}
    rows = [task_preference_row("sort", "train", int(i)) for i in sample_indices(DPO.run.seed, "sort", 2**20, 0, 4)]
    rows += [
        task_preference_row("reverse", "train", int(i)) for i in sample_indices(DPO.run.seed, "reverse", 2**20, 5, 4)
    ]
    want = preference_batch(rows, 32, NEWLINE)
    assert torch.equal(batch.tokens, want.tokens) and torch.equal(batch.loss_mask, want.loss_mask)
    assert batch.tokens.shape == (16, 33)


def _step(config, model, reference, batch):
    return dpo_train_step(
        model, build_optimizer(model, config), batch, config=config, stage=config.stages[2], lr=0.0,
        reference=reference,
    )


def test_at_the_reference_the_log_ratios_are_zero_the_loss_ln2_and_the_accuracy_zero():
    config = loads_config(DPO_TEXT.replace("[architecture]", "[architecture]\ndropout = 0.1"))  # turned off
    model = build_model(config, None)
    reference = copy.deepcopy(model)
    eval_mode(reference)
    batch, _ = preference_rows(config, config.stages[2], 8, {}, DatasetRegistry(config).examples)
    result = _step(config, model, reference, batch)
    assert result.metrics["chosen_rewards"] == 0.0 and result.metrics["rejected_rewards"] == 0.0
    assert result.metrics["margin"] == 0.0 and result.metrics["accuracy"] == 0.0
    assert result.loss == pytest.approx(math.log(2), abs=1e-7)
    assert result.metrics["chosen_logps"] < 0 and result.finite


def test_micro_batches_of_pairs_give_the_whole_batch_s_figures_and_gradient():
    whole = DPO
    sliced = loads_config(DPO_TEXT.replace("[training]", "[training]\nper_device_batch_size = 2"))
    model = build_model(whole, None)
    reference = build_model(whole, None)  # another model: non-zero log-ratios
    torch.manual_seed(0)  # (only for the perturbation below; the run's own randomness is keyed)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    eval_mode(reference)
    batch, _ = preference_rows(whole, whole.stages[2], 8, {}, DatasetRegistry(whole).examples)
    a, b = (_step(config, copy.deepcopy(model), reference, batch) for config in (whole, sliced))
    assert a.loss == pytest.approx(b.loss, rel=1e-6) and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-5)
    for name in a.metrics:
        assert a.metrics[name] == pytest.approx(b.metrics[name], rel=1e-6, abs=1e-9), name
    assert a.metrics["margin"] != 0.0


def test_a_sharded_run_with_post_training_stages_passes_the_compute_checks():
    placement = Placement(device=torch.device("cpu"), rank=0, world_size=2, sharded=True)
    check_compute(DPO, placement)  # each rank trains its share of the pairs
    grpo = loads_config(DPO_TEXT.replace('strategy = "dpo"', 'strategy = "grpo"').replace(
        "refresh_reference = true\ndpo = { beta = 0.1, sft_weight = 0.1 }", "refresh_reference = true"))
    check_compute(grpo, placement)  # ... and of the completions
    with pytest.raises(PlacementError, match="cannot be split over 3 processes"):
        check_compute(grpo, Placement(device=torch.device("cpu"), rank=0, world_size=3, sharded=True))


def test_steps_on_the_same_pairs_lower_the_loss_and_widen_the_margin():
    """The loss's sign and the update's direction: trained on one batch of pairs against a fixed reference,
    the chosen responses gain on the rejected ones (from the recorded run: loss 0.693 -> 0.434, margin
    0 -> 0.61 over 30 steps at lr 1e-3)."""
    model = build_model(DPO, None)
    reference = copy.deepcopy(model)
    eval_mode(reference)
    batch, _ = preference_rows(DPO, DPO.stages[2], 8, {}, DatasetRegistry(DPO).examples)
    optimizer = build_optimizer(model, DPO)
    results = [_step_with(model, optimizer, reference, batch) for _ in range(30)]
    assert results[0].loss == pytest.approx(math.log(2), abs=1e-7)
    assert results[-1].loss < 0.55 and results[-1].metrics["margin"] > 0.3 and results[-1].metrics["accuracy"] == 1.0
    assert results[-1].metrics["chosen_rewards"] > results[-1].metrics["rejected_rewards"]


def _step_with(model, optimizer, reference, batch):
    return dpo_train_step(model, optimizer, batch, config=DPO, stage=DPO.stages[2], lr=1e-3, reference=reference)
