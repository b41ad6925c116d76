"""rewind's model as a transformers model (rewind.engine.model.hf_models): each block kind's architecture computes
rewind's logits in float32, and its adapters, renamed for peft, what rewind's adapted model computes.

For every (norm, mlp) a random model, plain or grown (a stack prepended), with norm gains and biases moved
off their init, is written as config.json + model.safetensors and loaded by `AutoModelForCausalLM`: the
logits (of order five) match rewind's forward to 1e-5 (a tanh GELU in place of the exact one misses by far more: the
check tells the variants apart). A layout of LoRA trunks on float and NF4 stacks gets random adapters;
peft loads them, renamed, onto the transformers model of the unmerged base and computes the adapted
model's logits, as does the merged base alone. Masked objectives are refused in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from rewind.engine.model import hf_models
from rewind.engine.model.layout import build_model, build_plain, eval_mode, model_from_weights
from rewind.engine.model.layout import lora_config as rewind_lora_config
from rewind.states.config import ArchitectureSection, Config, ObjectiveSection, RunSection
from rewind.states.growth import initial_layout
from rewind.states.state import ModelLayout, StackLayout

pytest.importorskip("transformers")

ARCH = ArchitectureSection(block_size=16, vocab_size=64, num_layers=2, num_heads=2, d_model=32, rope_base=5000.0)
GROWN = ModelLayout(stacks=[StackLayout(stack=1, num_blocks=1), StackLayout(stack=0, num_blocks=2)], version=1)
KINDS = [("rmsnorm", "swiglu"), ("rmsnorm", "gelu"), ("layernorm", "gelu"), ("layernorm", "swiglu")]
CLASSES = {
    ("rmsnorm", "swiglu"): "LlamaForCausalLM",
    ("rmsnorm", "gelu"): "ArceeForCausalLM",
    ("layernorm", "gelu"): "Starcoder2ForCausalLM",
    ("layernorm", "swiglu"): "StableLmForCausalLM",
}


def config_of(norm: str, mlp: str, **objective) -> Config:
    arch = msgspec.structs.replace(ARCH, norm=norm, mlp=mlp)
    return Config(run=RunSection(seed=3), architecture=arch, objective=ObjectiveSection(**objective))


def tokens(batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, ARCH.vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))


def loud(model: torch.nn.Module) -> torch.nn.Module:
    """Weights that make every part of the block matter: matrices 10x their init (activations of order
    one, where GELU's variants differ; logits of order ten), norm gains and biases off their init (ones,
    zeros), so a bias left behind or misplaced shows."""
    with torch.no_grad():
        for index, (name, parameter) in enumerate(model.named_parameters()):
            if "norm" in name:
                parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(index)) * 0.3)
            else:
                parameter.mul_(10.0)
    return model


def write_hf(directory: Path, config: Config, weights: dict[str, torch.Tensor], layout: ModelLayout, **keys) -> Path:
    family = hf_models.family_of(config)
    num_layers = sum(spec.num_blocks for spec in layout.stacks)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(hf_models.hf_weights(weights, layout, family), directory / "model.safetensors", metadata={"format": "pt"})
    hf_config = hf_models.hf_config(family, config.architecture, num_layers=num_layers)
    (directory / "config.json").write_text(json.dumps({**hf_config, **keys}))
    return directory


def transformers_model(directory: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).eval()


@pytest.mark.parametrize("layout", [initial_layout(2), GROWN], ids=["plain", "grown"])
@pytest.mark.parametrize(("norm", "mlp"), KINDS, ids=["-".join(k) for k in KINDS])
def test_each_block_kind_is_a_transformers_model_with_rewinds_logits(tmp_path, norm, mlp, layout):
    config = config_of(norm, mlp)
    model = loud(eval_mode(build_plain(config, layout)))
    hf = transformers_model(write_hf(tmp_path / "hf", config, model.state_dict(), layout))
    assert type(hf).__name__ == CLASSES[(norm, mlp)] and hf.dtype == torch.float32
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        assert (model(tokens()) - hf(tokens()).logits).abs().max().item() <= 1e-5


def test_the_check_tells_gelu_variants_apart(tmp_path):
    """The same weights under transformers' tanh approximation of GELU: far outside the tolerance."""
    config = config_of("rmsnorm", "gelu")
    model = loud(eval_mode(build_plain(config, None)))
    hf = transformers_model(write_hf(tmp_path / "hf", config, model.state_dict(), initial_layout(2), hidden_act="gelu_pytorch_tanh"))
    with torch.no_grad():
        assert (model(tokens()) - hf(tokens()).logits).abs().max().item() > 1e-4


def adapted_layout() -> ModelLayout:
    """A LoRA trunk (2 blocks, float) under an NF4 stack with its own adapters and a trainable one on top."""
    return ModelLayout(
        stacks=[
            StackLayout(stack=0, num_blocks=2, base="frozen", adapter_rank=4, adapter_alpha=6.0),
            StackLayout(stack=1, num_blocks=1, base="nf4", adapter_rank=2, adapter_alpha=3.0),
            StackLayout(stack=2, num_blocks=1),
        ],
        version=1,
    )


def random_adapters(config: Config, layout: ModelLayout) -> dict[str, torch.Tensor]:
    """Every adapter of the layout, lora_B included (zero at init), random."""
    generator = torch.Generator().manual_seed(2)
    return {
        name.replace(".default", ""): torch.randn(parameter.shape, generator=generator) * 0.1
        for name, parameter in build_model(config, layout).named_parameters()
        if ".lora_" in name
    }


# peft 0.21's PeftModel reads a property transformers 5 deprecated: not ours to fix, and harmless.
PEFT_ON_TRANSFORMERS_5 = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@PEFT_ON_TRANSFORMERS_5
@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_peft_computes_the_adapted_model_on_the_unmerged_base_and_the_merged_base_alone(tmp_path, mlp):
    from peft import PeftModel, set_peft_model_state_dict

    config = config_of("rmsnorm", mlp)
    layout = adapted_layout()
    family = hf_models.family_of(config)
    weights = {k: v.clone() for k, v in build_plain(config, layout).state_dict().items()}
    adapters = random_adapters(config, layout)
    adapted = eval_mode(model_from_weights(config, layout, weights, adapters, complete=True)[0])
    with torch.no_grad():
        want = adapted(tokens())

    renamed, modules = hf_models.hf_adapters(adapters, layout, family)
    split = 3 + (2 if mlp == "swiglu" else 1) + 2  # q, k, v; the MLP's input projections; o and down
    assert len(modules) == 3 * split and len(renamed) == 2 * len(modules)
    assert modules["model.layers.0.self_attn.k_proj"] == (4, 6.0) and modules["model.layers.2.mlp.down_proj"] == (2, 3.0)
    assert not any(".layers.3." in name for name in modules)  # the trainable stack has no adapters
    base = computed(weights, {}, layout, config)
    with torch.random.fork_rng(devices=[]):  # peft initialises lora_A from the global RNG
        peft = PeftModel(transformers_model(write_hf(tmp_path / "base", config, base, layout)), rewind_lora_config(modules))
    loaded = set_peft_model_state_dict(peft, {f"base_model.model.{k}": v for k, v in renamed.items()})
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if ".lora_" in k]
    merged = transformers_model(write_hf(tmp_path / "merged", config, computed(weights, adapters, layout, config), layout))
    with torch.no_grad():
        unadapted = transformers_model(tmp_path / "base")(tokens()).logits
        assert (want - peft.eval()(tokens()).logits).abs().max().item() <= 1e-5
        assert (want - merged(tokens()).logits).abs().max().item() <= 1e-5
    assert (want - unadapted).abs().max().item() > 1e-3  # the adapters change what is computed


def computed(weights, adapters, layout, config) -> dict[str, torch.Tensor]:
    return hf_models.computed_weights(weights, adapters, layout, config.architecture)


def test_an_nf4_stack_is_exported_as_its_dequantised_weights():
    """What the run's NF4 layer computes with (its output for the identity is that weight, transposed),
    not the float weights it was quantised from (what checkpoints and `--to` hold)."""
    from rewind.engine.model.layout import quantise_stack

    config = config_of("rmsnorm", "gelu")
    layout = adapted_layout()
    plain = build_plain(config, layout)
    weights = {k: v.clone() for k, v in plain.state_dict().items()}
    base = computed(weights, {}, layout, config)
    quantise_stack(plain.stack(1))
    layer = plain.stack(1).blocks[0].mlp.fc.train()  # training mode: F.linear with the dequantised weight
    with torch.no_grad():
        used = layer(torch.eye(ARCH.d_model)).T
    name = "stacks.1.blocks.0.mlp.fc.weight"
    assert torch.equal(base[name], used)
    assert not torch.equal(base[name], weights[name])
    assert torch.equal(base["stacks.0.blocks.0.mlp.fc.weight"], weights["stacks.0.blocks.0.mlp.fc.weight"])


@pytest.mark.parametrize(
    ("objective", "words"),
    [({"kind": "mlm"}, "mask token"), ({"kind": "diffusion"}, "and a time embedding")],
    ids=["mlm", "diffusion"],
)
def test_masked_objectives_are_refused_in_one_line(objective, words):
    with pytest.raises(hf_models.NotExpressible, match=r"^objective\.kind") as refused:
        hf_models.family_of(config_of("rmsnorm", "swiglu", **objective))
    assert words in str(refused.value) and "\n" not in str(refused.value)
