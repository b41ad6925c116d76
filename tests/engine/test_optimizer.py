"""rewind's AdamW (engine/model/optimizer.py) against torch.optim.AdamW(foreach=False): the same bits after every
step, through LR changes, parameters without gradients, cleared state and state restored from a checkpoint's
form; and no torch._dynamo import on the way (the reason it exists)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rewind.engine.model.optimizer import AdamW
from rewind.engine.model.tensors import load_optimizer_tensors, optimizer_tensors

SETTINGS = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8}


def _params(seed: int) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,)]
    return [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    return [
        {"params": params[:1] + params[2:3], "weight_decay": 0.1},
        {"params": [params[1], params[3]], "weight_decay": 0.0},
    ]


def _grads(params: list[torch.nn.Parameter], step: int, skip: int | None) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    for index, parameter in enumerate(params):
        grad = torch.randn(parameter.shape, generator=generator) * (1 + step)
        parameter.grad = None if index == skip else grad


def _pair(seed: int = 0):
    ours, theirs = _params(seed), _params(seed)
    return (
        ours,
        AdamW(_groups(ours), **SETTINGS),
        theirs,
        torch.optim.AdamW(_groups(theirs), **SETTINGS, foreach=False),
    )


def _assert_same(ours, opt_ours, theirs, opt_theirs) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)
        state_a, state_b = opt_ours.state.get(a, {}), opt_theirs.state.get(b, {})
        assert state_a.keys() == state_b.keys()
        for key in state_a:
            assert state_a[key].dtype == state_b[key].dtype and torch.equal(state_a[key], state_b[key]), key


def _steps(ours, opt_ours, theirs, opt_theirs, steps: range) -> None:
    for step in steps:
        lr = 3e-3 * (0.5 + 0.5 * (step % 5) / 5)  # a schedule: the LR is set before each step
        skip = step % 3 if step % 4 == 0 else None  # now and then a parameter gets no gradient
        for params, optimizer in ((ours, opt_ours), (theirs, opt_theirs)):
            for group in optimizer.param_groups:
                group["lr"] = lr
            _grads(params, step, skip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        _assert_same(ours, opt_ours, theirs, opt_theirs)


def test_the_groups_hold_torchs_settings_in_torchs_order():
    _, ours, _, theirs = _pair()
    strip = lambda groups: [[(k, v) for k, v in g.items() if k != "params"] for g in groups]  # noqa: E731
    assert strip(ours.param_groups) == strip(theirs.param_groups)
    assert ours.defaults == theirs.defaults


def test_steps_are_torchs_bit_for_bit():
    pair = _pair()
    _steps(*pair, range(25))
    assert all(p.grad is None for p in pair[0])


def test_cleared_state_starts_again_like_torchs():
    pair = _pair(1)
    _steps(*pair, range(6))
    pair[1].state.clear()
    pair[3].state.clear()
    _steps(*pair, range(6, 14))


def test_restored_state_goes_on_like_torchs():
    """Save through the checkpoint's form (tensors.optimizer_tensors) and restore into a fresh optimizer
    over fresh parameters: the next steps equal torch's uninterrupted run, and the saved form equals what
    torch's optimizer saves (so checkpoints, and their names, are as they were)."""
    ours, opt_ours, theirs, opt_theirs = _pair(2)
    _steps(ours, opt_ours, theirs, opt_theirs, range(7))
    names = {p: f"p{i}" for i, p in enumerate(ours)}
    tensors, meta = optimizer_tensors(opt_ours, names)
    torch_tensors, torch_meta = optimizer_tensors(opt_theirs, {p: f"p{i}" for i, p in enumerate(theirs)})
    assert meta == torch_meta and tensors.keys() == torch_tensors.keys()
    assert all(torch.equal(tensors[k], torch_tensors[k]) for k in tensors)

    restored = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt_restored = AdamW(_groups(restored), **SETTINGS)
    load_optimizer_tensors(opt_restored, {p: f"p{i}" for i, p in enumerate(restored)}, tensors, meta)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    torch_restored = torch.optim.AdamW(_groups(twin), **SETTINGS, foreach=False)
    load_optimizer_tensors(torch_restored, {p: f"p{i}" for i, p in enumerate(twin)}, tensors, meta)

    def keys(groups):  # the settings, and where the parameters sit among them
        return [[(k, v) for k, v in g.items() if k != "params"] + [list(g).index("params")] for g in groups]

    assert keys(opt_restored.param_groups) == keys(torch_restored.param_groups)
    _steps(restored, opt_restored, theirs, opt_theirs, range(7, 15))


def test_a_state_of_settings_it_does_not_compute_is_refused():
    _, optimizer, _, _ = _pair()
    groups = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": list(range(2))}
        for g in optimizer.param_groups
    ]
    groups[1]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        optimizer.load_state_dict({"state": {}, "param_groups": groups})


def test_building_and_stepping_imports_no_dynamo():
    code = (
        "import sys, torch\n"
        "from rewind.engine.model.optimizer import AdamW\n"
        "p = torch.nn.Parameter(torch.ones(3))\n"
        "o = AdamW([{'params': [p]}], lr=1e-3, betas=(0.9, 0.95), eps=1e-8)\n"
        "p.sum().backward(); o.step(); o.zero_grad()\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
