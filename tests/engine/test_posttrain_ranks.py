"""Every post-training loss is the same over one micro-batch, over several, and over two ranks under
torchrun (gloo): the gradient of a grpo update for each loss_type (grpo, bnpo, dapo, dr_grpo: the
normaliser counted once over every micro-batch and rank) and of a dpo step for each variant (sigmoid,
robust, ipo, hinge: each micro-batch divides by the step's pair count), from the same model and rows.
One launch of two processes computes them all (each a sharded model, FSDP2, each rank its share of
the rows) and writes rank 0's gathered gradients; this process computes the one-process ones."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rewind.engine.data.registry import DatasetRegistry
from rewind.engine.model.layout import build_model, eval_mode
from rewind.engine.posttrain.dpo_step import dpo_train_step, preference_rows
from rewind.engine.posttrain.grpo_step import grpo_train_step
from rewind.engine.step.step import build_optimizer
from rewind.states.config_reading import loads_config
from tests.conftest import REPO
from tests.engine.test_dpo import DPO_TEXT
from tests.engine.test_grpo import SETTINGS, TEXT, _rows

pytestmark = pytest.mark.distributed
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")
VARIANTS = ("sigmoid", "robust", "ipo", "hinge")
TOLERANCE = 1e-5  # of the gradient's norm: float32 sums in another order (docs/distributed.md)


def grpo_config(loss_type: str, per_device: int = -1):
    text = TEXT.replace(SETTINGS, SETTINGS.replace(" }", f', loss_type = "{loss_type}", kl_beta = 0.0 }}'))
    return _unclipped(text, per_device)


def dpo_config(variant: str, per_device: int = -1):
    smoothing = ", label_smoothing = 0.1" if variant == "robust" else ""
    text = DPO_TEXT.replace("sft_weight = 0.1 }", f'sft_weight = 0.1, loss = "{variant}"{smoothing} }}')
    return _unclipped(text, per_device)


def _unclipped(text: str, per_device: int):
    """The config with `per_device` rows a micro-batch, its gradients not clipped (the clip would hide
    a scale the loss types differ by)."""
    text = text.replace("[training]", f"[training]\nper_device_batch_size = {per_device}")
    return loads_config(text.replace("[optimization]", "[optimization]\ngrad_clip = 0.0"))


def grpo_gradient(loss_type: str, per_device: int = -1, place=None) -> dict[str, torch.Tensor]:
    config = grpo_config(loss_type, per_device)
    model = build_model(config, None)
    rows = _rows(model, seed=3)  # old log-probs from the whole model, as the rollout file holds them
    model = place(model, config) if place else model
    optimizer, seen = _capturing(model, config)
    grpo_train_step(model, optimizer, rows, config=config, stage=config.stages[2], lr=0.0)
    return seen


def dpo_gradient(variant: str, per_device: int = -1, place=None) -> dict[str, torch.Tensor]:
    config = dpo_config(variant, per_device)
    model = build_model(config, None)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)  # a reference apart from the model: non-zero log-ratios
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.01 * torch.randn(parameter.shape, generator=generator))
    eval_mode(reference)
    batch, _ = preference_rows(config, config.stages[2], 8, {}, DatasetRegistry(config).examples)
    if place:
        model, reference = place(model, config), place(reference, config)
    optimizer, seen = _capturing(model, config)
    dpo_train_step(model, optimizer, batch, config=config, stage=config.stages[2], lr=0.0, reference=reference)
    return seen


def _capturing(model, config):
    """An optimizer whose step keeps the step's whole gradient (gathered from the ranks) and updates
    nothing: the step drops the gradients right after it."""
    from rewind.engine.model.placement import full_tensor

    optimizer, seen = build_optimizer(model, config), {}

    def step() -> None:
        for name, p in model.named_parameters():
            if p.grad is not None:
                seen[name] = full_tensor(p.grad).detach().clone()

    optimizer.step = step
    return optimizer, seen


SCRIPT = textwrap.dedent(
    """
    import json, sys
    from rewind.engine.model.placement import join_process_group, leave_process_group, place
    from tests.engine.test_posttrain_ranks import LOSS_TYPES, VARIANTS, dpo_gradient, grpo_config, grpo_gradient

    join_process_group(grpo_config("dapo").compute)
    seen = {}
    for loss_type in LOSS_TYPES:
        seen[f"grpo/{loss_type}"] = {k: v.tolist() for k, v in grpo_gradient(loss_type, place=place).items()}
    for variant in VARIANTS:
        seen[f"dpo/{variant}"] = {k: v.tolist() for k, v in dpo_gradient(variant, place=place).items()}
    import torch.distributed as dist
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as out:
            json.dump(seen, out)
    leave_process_group()  # a rank exiting with the group still up can abort the other (gloo)
    """
)


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    norm = torch.cat([v.flatten() for v in a.values()]).norm()
    return float(torch.cat([(a[k] - b[k]).flatten() for k in a]).norm() / norm)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    work = tmp_path_factory.mktemp("ranks")
    script, out = work / "ranks.py", work / "gradients.json"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command = [*launcher, str(script), str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(out.read_text())
    return {key: {k: torch.tensor(v) for k, v in grads.items()} for key, grads in seen.items()}


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_grpo_gradient_is_the_same_in_micro_batches_and_over_two_ranks(loss_type, two_ranks):
    whole = grpo_gradient(loss_type)
    assert _distance(whole, grpo_gradient(loss_type, per_device=1)) < TOLERANCE  # 8 micro-batches of 1
    assert _distance(whole, two_ranks[f"grpo/{loss_type}"]) < TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_a_dpo_gradient_is_the_same_in_micro_batches_and_over_two_ranks(variant, two_ranks):
    whole = dpo_gradient(variant)
    assert _distance(whole, dpo_gradient(variant, per_device=1)) < TOLERANCE  # 8 micro-batches of 1 pair
    assert _distance(whole, two_ranks[f"dpo/{variant}"]) < TOLERANCE


def test_the_normalisers_differ_so_the_comparison_can_tell_them_apart():
    """grpo (each completion's mean), dapo (the step's token count) and dr_grpo (completions x
    max_new_tokens) give other gradients from the same rows; bnpo counts what dapo counts here (the
    step's tokens over every micro-batch and rank: docs/posttraining.md), so it gives dapo's."""
    gradients = {loss_type: grpo_gradient(loss_type) for loss_type in LOSS_TYPES}
    distinct = [gradients[k] for k in ("grpo", "dapo", "dr_grpo")]
    assert all(_distance(a, b) > 1e-3 for n, a in enumerate(distinct) for b in distinct[n + 1 :])
    assert _distance(gradients["bnpo"], gradients["dapo"]) == 0.0
    dpo = [dpo_gradient(variant) for variant in VARIANTS]
    assert all(_distance(a, b) > 1e-3 for n, a in enumerate(dpo) for b in dpo[n + 1 :])
