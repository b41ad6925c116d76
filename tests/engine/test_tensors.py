"""Model and optimizer state through a checkpoint and back must continue training bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rewind.engine.model.layout import parameter_names
from rewind.engine.model.tensors import (
    TensorFitError,
    load_model_tensors,
    load_optimizer_tensors,
    model_tensors,
    optimizer_tensors,
)
from rewind.stores.checkpoints import CheckpointStore


class TwoHeads(nn.Module):
    """A trunk with two heads; the second head only trains once `use_second` is set, so until then
    its parameters have no gradient and AdamW keeps no state for them."""

    def __init__(self, seed: int):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh())
        self.first = nn.Linear(8, 2)
        self.second = nn.Linear(8, 2)
        self.register_buffer("num_calls", torch.zeros((), dtype=torch.int64))
        self.use_second = False
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.num_calls += 1
        hidden = self.trunk(inputs)
        out = self.first(hidden)
        return out + self.second(hidden) if self.use_second else out


def build(seed: int) -> tuple[TwoHeads, torch.optim.AdamW]:
    model = TwoHeads(seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        foreach=False,
    )
    return model, optimizer


def train(model: TwoHeads, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        generator = torch.Generator().manual_seed(1000 + step)  # the batch is a function of the step
        inputs = torch.randn(16, 4, generator=generator)
        targets = torch.randn(16, 2, generator=generator)
        for group in optimizer.param_groups:  # a schedule: the restored lr must not matter after this
            group["lr"] = 1e-2 * (0.9**step)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()


def assert_same_training_state(model_a, optimizer_a, model_b, optimizer_b) -> None:
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert state_a[key].dtype == state_b[key].dtype and torch.equal(state_a[key], state_b[key]), key
    names_a, names_b = parameter_names(model_a), parameter_names(model_b)
    by_name_a = {names_a[p]: s for p, s in optimizer_a.state.items()}
    by_name_b = {names_b[p]: s for p, s in optimizer_b.state.items()}
    assert by_name_a.keys() == by_name_b.keys()
    for name, fields in by_name_a.items():
        assert fields.keys() == by_name_b[name].keys(), name
        for field, value in fields.items():
            other = by_name_b[name][field]
            assert value.dtype == other.dtype and torch.equal(value, other), f"{name}.{field}"
    assert optimizer_a.state_dict()["param_groups"] == optimizer_b.state_dict()["param_groups"]


def checkpoint_and_restore(tmp_path, model, optimizer, seed: int = 99) -> tuple[TwoHeads, torch.optim.AdamW]:
    """Through the real store on disk, into a freshly built model and optimizer (different init)."""
    store = CheckpointStore(tmp_path / "run")
    tensors, meta = optimizer_tensors(optimizer, parameter_names(model))
    written = store.write(5, {"model": model_tensors(model), "optimizer": tensors}, {"optimizer": meta})
    groups = store.load(written.name, written.files)
    fresh_model, fresh_optimizer = build(seed)
    load_model_tensors(fresh_model, groups["model"])
    restored_meta = store.load_manifest(written.name).meta["optimizer"]
    load_optimizer_tensors(fresh_optimizer, parameter_names(fresh_model), groups["optimizer"], restored_meta)
    return fresh_model, fresh_optimizer


def test_resuming_from_a_checkpoint_continues_training_bit_for_bit(tmp_path):
    model, optimizer = build(seed=0)
    model.use_second = True
    train(model, optimizer, range(5))
    resumed_model, resumed_optimizer = checkpoint_and_restore(tmp_path, model, optimizer)
    resumed_model.use_second = True
    assert_same_training_state(model, optimizer, resumed_model, resumed_optimizer)
    train(model, optimizer, range(5, 10))
    train(resumed_model, resumed_optimizer, range(5, 10))
    assert_same_training_state(model, optimizer, resumed_model, resumed_optimizer)
    assert resumed_optimizer.state[resumed_model.first.weight]["step"].item() == 10


def test_a_parameter_without_optimizer_state_yet_round_trips(tmp_path):
    model, optimizer = build(seed=1)
    train(model, optimizer, range(5))  # the second head never had a gradient
    assert model.second.weight not in optimizer.state
    resumed_model, resumed_optimizer = checkpoint_and_restore(tmp_path, model, optimizer)
    assert resumed_model.second.weight not in resumed_optimizer.state
    model.use_second = resumed_model.use_second = True  # now it starts training, from fresh state
    train(model, optimizer, range(5, 10))
    train(resumed_model, resumed_optimizer, range(5, 10))
    assert_same_training_state(model, optimizer, resumed_model, resumed_optimizer)
    assert resumed_optimizer.state[resumed_model.second.weight]["step"].item() == 5


def test_optimizer_state_is_keyed_by_parameter_name_with_dtypes_kept():
    model, optimizer = build(seed=2)
    train(model, optimizer, range(2))
    tensors, meta = optimizer_tensors(optimizer, parameter_names(model))
    assert set(tensors) == {
        f"state.{name}.{field}"
        for name in (
            "trunk.0.weight",
            "trunk.0.bias",
            "trunk.1.weight",
            "trunk.1.bias",
            "first.weight",
            "first.bias",
        )
        for field in ("step", "exp_avg", "exp_avg_sq")
    }
    assert tensors["state.first.weight.step"].dtype == torch.float32  # a tensor, not an int
    assert tensors["state.first.weight.step"].shape == ()
    assert meta["class"] == "AdamW"
    first_group, second_group = meta["param_groups"]
    assert first_group["params"] == ["trunk.0.weight", "first.weight", "second.weight"]
    assert first_group["weight_decay"] == 0.1 and second_group["weight_decay"] == 0.0
    assert first_group["betas"] == (0.9, 0.95) and first_group["lr"] == pytest.approx(1e-2 * 0.9)


def test_saved_tensors_are_detached_contiguous_cpu_copies():
    model, _ = build(seed=3)
    tensors = model_tensors(model)
    assert tensors["num_calls"].dtype == torch.int64  # buffers included
    for key, tensor in tensors.items():
        assert tensor.device.type == "cpu" and tensor.is_contiguous() and not tensor.requires_grad, key
    tensors["first.weight"].add_(1.0)
    assert not torch.equal(tensors["first.weight"], model.first.weight)  # a copy, not a view


def test_loading_model_tensors_keeps_parameter_identity():
    model, _ = build(seed=4)
    weight = model.first.weight
    load_model_tensors(model, model_tensors(build(seed=5)[0]))
    assert model.first.weight is weight  # the optimizer still points at the live parameter
    assert torch.equal(model.first.weight, build(seed=5)[0].first.weight)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("first.bias"), "missing first.bias, unexpected none"),
        (lambda t: t.update(extra=torch.zeros(1)), "missing none, unexpected extra"),
        (lambda t: t.update({"first.bias": torch.zeros(3)}), r"first.bias is torch.float32 \[3\]"),
        (
            lambda t: t.update({"first.bias": torch.zeros(2, dtype=torch.float64)}),
            "torch.float64 .2., the model",
        ),
    ],
)
def test_model_tensors_that_do_not_fit_are_refused(edit, message):
    model, _ = build(seed=6)
    tensors = model_tensors(model)
    edit(tensors)
    before = model_tensors(model)
    with pytest.raises(TensorFitError, match=message):
        load_model_tensors(model, tensors)
    assert all(torch.equal(before[k], v) for k, v in model_tensors(model).items())  # nothing half-loaded


def test_optimizer_state_for_other_parameters_is_refused():
    model, optimizer = build(seed=7)
    train(model, optimizer, range(1))
    tensors, meta = optimizer_tensors(optimizer, parameter_names(model))
    other_model = TwoHeads(seed=8)
    regrouped = torch.optim.AdamW(other_model.parameters(), lr=1e-3)  # one group instead of two
    with pytest.raises(TensorFitError, match="2 optimizer groups, the optimizer 1"):
        load_optimizer_tensors(regrouped, parameter_names(other_model), tensors, meta)
    fresh_model, fresh_optimizer = build(seed=9)
    renamed = {p: f"renamed.{n}" for p, n in parameter_names(fresh_model).items()}
    with pytest.raises(TensorFitError, match=r"optimizer group 0 holds renamed\.trunk\.0\.weight"):
        load_optimizer_tensors(fresh_optimizer, renamed, tensors, meta)
    with pytest.raises(TensorFitError, match=r"'state\.nowhere\.exp_avg' fits no parameter"):
        load_optimizer_tensors(
            fresh_optimizer,
            parameter_names(fresh_model),
            {**tensors, "state.nowhere.exp_avg": torch.zeros(1)},
            meta,
        )
    sgd = torch.optim.SGD(fresh_model.parameters(), lr=0.1)
    with pytest.raises(TensorFitError, match="holds a AdamW state, the optimizer is a SGD"):
        load_optimizer_tensors(sgd, parameter_names(fresh_model), tensors, meta)


def test_unnamed_optimizer_parameters_are_refused():
    model, optimizer = build(seed=10)
    names = parameter_names(model)
    del names[model.first.weight]
    with pytest.raises(TensorFitError, match="param_names does not name"):
        optimizer_tensors(optimizer, names)


def test_non_tensor_state_and_tensor_hyperparameters_round_trip():
    """SGD keeps `momentum_buffer=None` before its first step; a tensor lr goes into the tensors."""
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.05), momentum=0.9)
    optimizer.state[model.weight]["note"] = 3  # a non-tensor state value
    tensors, meta = optimizer_tensors(optimizer, parameter_names(model))
    assert meta["state_scalars"] == {"weight": {"note": 3}}
    assert "group.0.lr" in tensors and "lr" not in meta["param_groups"][0]
    fresh = nn.Linear(3, 2)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=torch.tensor(0.5), momentum=0.1)
    load_optimizer_tensors(fresh_optimizer, parameter_names(fresh), tensors, meta)
    assert fresh_optimizer.param_groups[0]["momentum"] == 0.9
    assert torch.equal(fresh_optimizer.param_groups[0]["lr"], torch.tensor(0.05))
    assert fresh_optimizer.state[fresh.weight]["note"] == 3
