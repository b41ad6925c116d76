"""The GPT rack: shapes, causality, deterministic init, growth, checkpointing and keyed dropout."""

from __future__ import annotations

import msgspec
import pytest
import torch
import torch.nn.functional as F

from rewind.engine.model.model import GPT, Stack, init_new_stack
from rewind.states.config import ArchitectureSection

ARCH = ArchitectureSection(block_size=16, vocab_size=32, num_layers=2, num_heads=2, d_model=16)


def tokens(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, ARCH.vocab_size, (batch, length), generator=generator)


def lm_loss(model: GPT, idx: torch.Tensor, **kwargs) -> torch.Tensor:
    logits = model(idx[:, :-1], **kwargs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))


def state(model: GPT) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_forward_shape(norm):
    model = GPT(msgspec.structs.replace(ARCH, norm=norm))
    assert model(tokens(3, 7)).shape == (3, 7, ARCH.vocab_size)
    assert model(tokens(1, ARCH.block_size)).shape == (1, ARCH.block_size, ARCH.vocab_size)


def test_sequence_longer_than_block_size_is_refused():
    with pytest.raises(ValueError, match="block_size"):
        GPT(ARCH)(tokens(1, ARCH.block_size + 1))


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
def test_changing_a_future_token_leaves_earlier_logits_unchanged(norm):
    model = GPT(msgspec.structs.replace(ARCH, norm=norm), seed=1).eval()
    idx = tokens(2, 12)
    changed = idx.clone()
    changed[:, 8] = (changed[:, 8] + 1) % ARCH.vocab_size
    with torch.no_grad():
        before, after = model(idx), model(changed)
    assert torch.equal(before[:, :8], after[:, :8])
    assert not torch.allclose(before[:, 8:], after[:, 8:])


def test_parameter_names_are_stable():
    names = [name for name, _ in GPT(ARCH).named_parameters()]
    assert names[0] == "embed.weight"
    assert "stacks.0.blocks.1.attn.qkv.weight" in names
    assert "stacks.0.blocks.1.mlp.proj.weight" in names
    assert names[-2:] == ["norm.weight", "head.weight"]
    assert not any("rope" in name for name in GPT(ARCH).state_dict())  # rope tables are not saved


def test_init_ignores_global_rng_and_leaves_it_alone():
    torch.manual_seed(1)
    first = state(GPT(ARCH, seed=7))
    torch.manual_seed(2)
    rng_before = torch.get_rng_state()
    second = state(GPT(ARCH, seed=7))
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert_same_weights(first, second)


def test_init_depends_on_seed_and_parameter_name_only():
    model = GPT(ARCH, seed=3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    model.init_weights(3)
    assert_same_weights(state(model), state(GPT(ARCH, seed=3)))
    # A deeper model shares the names, hence the values, of everything but the residual scaling.
    deep = GPT(msgspec.structs.replace(ARCH, num_layers=4), seed=3).state_dict()
    shallow = model.state_dict()
    for name in ("embed.weight", "head.weight", "stacks.0.blocks.1.attn.qkv.weight"):
        assert torch.equal(deep[name], shallow[name])
    assert not torch.equal(GPT(ARCH, seed=4).state_dict()["embed.weight"], shallow["embed.weight"])


def test_init_distribution():
    model = GPT(msgspec.structs.replace(ARCH, norm="layernorm", d_model=64, num_layers=8), seed=0)
    weights = model.state_dict()
    assert torch.equal(weights["norm.weight"], torch.ones(64))
    assert torch.equal(weights["stacks.0.blocks.0.attn_norm.bias"], torch.zeros(64))
    assert weights["embed.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    assert weights["stacks.0.blocks.3.mlp.proj.weight"].std().item() == pytest.approx(0.02 / 4, rel=0.1)


def test_num_parameters():
    d, v, layers = ARCH.d_model, ARCH.vocab_size, ARCH.num_layers
    per_block = 2 * d + 3 * d * d + d * d + 2 * 4 * d * d
    assert GPT(ARCH).num_parameters() == 2 * v * d + d + layers * per_block
    assert GPT(msgspec.structs.replace(ARCH, d_ff=8)).num_parameters() < GPT(ARCH).num_parameters()


def test_default_is_one_stack_and_stack_sizes_are_honoured():
    assert GPT(ARCH).stack_sizes == [2]
    model = GPT(ARCH, [1, 3])
    assert model.stack_sizes == [1, 3]
    assert model.num_blocks == 4
    assert "stacks.1.blocks.2.attn.proj.weight" in model.state_dict()


def test_stacks_are_named_by_identity_and_run_in_order():
    # Growth itself (engine.growth) builds models like these: stack 1 prepended before stack 0.
    model = GPT(ARCH, [1, 2], stack_ids=[1, 0], seed=1)
    assert model.order == [1, 0] and model.stack_sizes == [1, 2]
    assert len(model.stack(0).blocks) == 2 and len(model.stack(1).blocks) == 1
    assert "stacks.0.blocks.1.attn.qkv.weight" in model.state_dict()
    assert "stacks.1.blocks.0.attn.qkv.weight" in model.state_dict()
    swapped = GPT(ARCH, [2, 1], stack_ids=[0, 1], seed=1)
    swapped.load_state_dict(model.state_dict())  # the same stacks, the other way round
    with torch.no_grad():
        assert not torch.equal(model(tokens()), swapped(tokens()))
    with pytest.raises(ValueError, match="distinct"):
        GPT(ARCH, [1, 1], stack_ids=[0, 0])


def test_a_new_stack_draws_from_its_own_stream():
    def drawn(stack_id: int) -> dict[str, torch.Tensor]:
        stack = Stack(ARCH, 1)
        init_new_stack(stack, seed=5, stack_id=stack_id, depth=3)
        return {k: v.clone() for k, v in stack.state_dict().items()}

    assert_same_weights(drawn(1), drawn(1))
    assert not torch.equal(drawn(1)["blocks.0.mlp.fc.weight"], drawn(2)["blocks.0.mlp.fc.weight"])
    initial = GPT(ARCH, seed=5).state_dict()["stacks.0.blocks.0.mlp.fc.weight"]
    assert not torch.equal(drawn(1)["blocks.0.mlp.fc.weight"], initial)


def test_function_preserving_init_makes_identity_blocks_that_can_learn():
    model = GPT(ARCH, seed=2).eval()
    grown = GPT(ARCH, [2, 2], stack_ids=[0, 1], seed=2).eval()
    init_new_stack(grown.stack(1), seed=2, stack_id=1, depth=4, function_preserving=True)
    grown.stack(0).load_state_dict(model.stack(0).state_dict())
    for part in ("embed", "norm", "head"):
        getattr(grown, part).load_state_dict(getattr(model, part).state_dict())
    idx = tokens()
    with torch.no_grad():
        assert torch.equal(model(idx), grown(idx))
    lm_loss(grown.train(), idx).backward()
    assert grown.stack(1).blocks[0].attn.proj.weight.grad.abs().sum() > 0  # the new blocks can learn


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_activation_checkpointing_gives_same_loss_and_grads(dropout):
    plain = GPT(msgspec.structs.replace(ARCH, dropout=dropout), [1, 2], seed=3)
    recomputed = GPT(
        msgspec.structs.replace(ARCH, dropout=dropout, activation_checkpointing=True), [1, 2], seed=3
    )
    idx = tokens(2, 13)
    losses = []
    for model in (plain, recomputed):
        loss = lm_loss(model, idx, dropout_seed=11)
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, a), (_, b) in zip(plain.named_parameters(), recomputed.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_dropout_masks_are_keyed_by_dropout_seed_not_global_rng():
    model = GPT(msgspec.structs.replace(ARCH, dropout=0.3), seed=0).train()
    idx = tokens()
    rng_before = torch.get_rng_state()
    first = model(idx, dropout_seed=1)
    torch.manual_seed(123)
    again = model(idx, dropout_seed=1)
    other = model(idx, dropout_seed=2)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    torch.set_rng_state(rng_before)
    model(idx, dropout_seed=1)
    assert torch.equal(torch.get_rng_state(), rng_before)  # forward drew nothing from the global RNG
    with pytest.raises(ValueError, match="dropout_seed"):
        model(idx)
    model.eval()
    assert torch.equal(model(idx), model(idx, dropout_seed=1))  # no dropout in eval mode


# --- the SwiGLU MLP ---------------------------------------------------------------------------------

SWIGLU = msgspec.structs.replace(ARCH, mlp="swiglu")


@pytest.mark.parametrize("d_ff", [0, 24])
def test_swiglu_fc_holds_gate_then_up_under_the_gelu_names(d_ff):
    arch = msgspec.structs.replace(SWIGLU, d_ff=d_ff)
    width = d_ff or 4 * arch.d_model
    model = GPT(arch, seed=1)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes["stacks.0.blocks.0.mlp.fc.weight"] == (2 * width, arch.d_model)
    assert shapes["stacks.0.blocks.0.mlp.proj.weight"] == (arch.d_model, width)
    gelu = GPT(msgspec.structs.replace(arch, mlp="gelu"), seed=1)
    assert list(shapes) == [name for name, _ in gelu.named_parameters()]  # LoRA targets, checkpoints: same names
    assert model(tokens(2, 9)).shape == (2, 9, arch.vocab_size)


def test_swiglu_computes_proj_of_silu_gate_times_up():
    mlp = GPT(SWIGLU, seed=4).stack(0).blocks[0].mlp
    x = torch.randn(2, 5, SWIGLU.d_model, generator=torch.Generator().manual_seed(0))
    width = 4 * SWIGLU.d_model
    fused = F.linear(x, mlp.fc.weight)
    with torch.no_grad():
        assert torch.equal(mlp(x), F.linear(F.silu(fused[..., :width]) * fused[..., width:], mlp.proj.weight))
        gate, up = F.linear(x, mlp.fc.weight[:width]), F.linear(x, mlp.fc.weight[width:])  # first rows: the gate
        torch.testing.assert_close(mlp(x), F.linear(F.silu(gate) * up, mlp.proj.weight), rtol=1e-6, atol=1e-6)


def test_swiglu_init_is_by_name_and_deterministic():
    a, b = GPT(SWIGLU, seed=6), GPT(SWIGLU, seed=6)
    assert_same_weights(state(a), state(b))
    gelu = state(GPT(ARCH, seed=6))
    fc = "stacks.0.blocks.0.mlp.fc.weight"
    # The same stream per name: every tensor shaped alike is the gelu model's, fc only is wider.
    assert all(torch.equal(t, gelu[n]) for n, t in state(a).items() if not n.endswith("mlp.fc.weight"))
    assert not torch.equal(state(GPT(SWIGLU, seed=7))[fc], state(a)[fc])


def test_swiglu_forward_backward_are_deterministic_and_causal():
    idx = tokens(2, 12)
    runs = []
    for _ in range(2):
        model = GPT(SWIGLU, seed=8).train()
        loss = lm_loss(model, idx)
        loss.backward()
        runs.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert torch.isfinite(runs[0][0])
    assert torch.equal(runs[0][0], runs[1][0])
    assert_same_weights(runs[0][1], runs[1][1])
    assert all(grad.abs().sum() > 0 for grad in runs[0][1].values())  # the gate and up halves both learn
    fc_grad = runs[0][1]["stacks.0.blocks.0.mlp.fc.weight"]
    half = fc_grad.shape[0] // 2
    assert fc_grad[:half].abs().sum() > 0 and fc_grad[half:].abs().sum() > 0
    model = GPT(SWIGLU, seed=8).eval()
    changed = idx.clone()
    changed[:, 8] = (changed[:, 8] + 1) % SWIGLU.vocab_size
    with torch.no_grad():
        assert torch.equal(model(idx)[:, :8], model(changed)[:, :8])


def test_swiglu_function_preserving_growth_keeps_outputs():
    model = GPT(SWIGLU, seed=2).eval()
    grown = GPT(SWIGLU, [2, 1], stack_ids=[0, 1], seed=2).eval()
    init_new_stack(grown.stack(1), seed=2, stack_id=1, depth=3, function_preserving=True)
    grown.stack(0).load_state_dict(model.stack(0).state_dict())
    for part in ("embed", "norm", "head"):
        getattr(grown, part).load_state_dict(getattr(model, part).state_dict())
    with torch.no_grad():
        assert torch.equal(model(tokens()), grown(tokens()))
