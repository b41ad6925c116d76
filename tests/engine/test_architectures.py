"""The architecture options of today's open models (architecture.num_kv_heads, head_dim, norm_eps, qkv_bias,
qk_norm, tie_embeddings, rope_scaling): each computes what transformers' model of it computes (a tiny
LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM built from its config, its weights copied into a rewind
model by hand), each trains and resumes bit for bit from the command line, and each bad value is one line
naming its field. With every option at its default a model is what it always was (tests/compat and the
model tests hold that); here, that the defaults add no parameter and leave the config's identity alone."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import pytest
import torch

from rewind.engine.model.attention_inputs import inverse_frequencies
from rewind.engine.model.hf_llama import unexported_options
from rewind.engine.model.model import GPT
from rewind.states.config import ArchitectureSection, RopeScalingSection
from rewind.states.config_error import ConfigError
from rewind.states.config_identity import config_hash
from rewind.states.config_reading import loads_config
from rewind.states.model_size import flops_per_token, matmul_parameters
from rewind.stores.runs import read_seq_events
from tests.conftest import EXAMPLES
from tests.engine.test_growth import final_tensors
from tests.engine.test_loop import assert_bitwise_equal

transformers = pytest.importorskip("transformers")

TINY = EXAMPLES / "tiny.toml"
LENGTH = 24  # tokens per row in the comparisons (block_size 32)


def hf_shape(arch: ArchitectureSection) -> dict:
    """`arch`'s shape under transformers' config names (a family's own keys are the caller's)."""
    return {
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.d_model,
        "intermediate_size": arch.d_ff,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads or arch.num_heads,
        "head_dim": arch.head_dim or arch.d_model // arch.num_heads,
        "rms_norm_eps": arch.norm_eps,
        "tie_word_embeddings": arch.tie_embeddings,
    }


def perturbed(model):
    """`model` with every weight moved off its initial value (biases and norm gains off their zeros and ones)."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def _hf_model(family: str, arch: ArchitectureSection, **extra):
    """A transformers causal LM of `family` with `arch`'s shape, every weight random (norm gains too)."""
    keys = {**hf_shape(arch), "max_position_embeddings": arch.block_size, "hidden_act": "silu", **extra}
    config_class = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[family]
    model_class = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
    }[family]
    torch.manual_seed(0)
    return perturbed(model_class._from_config(config_class(**keys), attn_implementation="eager").float().eval())


def _copy_into_rewind(hf, arch: ArchitectureSection) -> GPT:
    """A rewind model of `arch` holding `hf`'s weights, mapped here by hand."""
    model = GPT(arch).eval()
    source = dict(hf.state_dict())
    weights = {
        "embed.weight": source["model.embed_tokens.weight"],
        "norm.weight": source["model.norm.weight"],
    }
    if not arch.tie_embeddings:
        weights["head.weight"] = source["lm_head.weight"]
    for k in range(arch.num_layers):
        layer, block = f"model.layers.{k}.", f"stacks.0.blocks.{k}."
        attn = layer + "self_attn."
        weights[block + "attn_norm.weight"] = source[layer + "input_layernorm.weight"]
        weights[block + "mlp_norm.weight"] = source[layer + "post_attention_layernorm.weight"]
        weights[block + "attn.qkv.weight"] = torch.cat([source[f"{attn}{p}_proj.weight"] for p in "qkv"])
        weights[block + "attn.proj.weight"] = source[attn + "o_proj.weight"]
        weights[block + "mlp.fc.weight"] = torch.cat(
            [source[layer + "mlp.gate_proj.weight"], source[layer + "mlp.up_proj.weight"]]
        )
        weights[block + "mlp.proj.weight"] = source[layer + "mlp.down_proj.weight"]
        if arch.qkv_bias:
            weights[block + "attn.qkv.bias"] = torch.cat([source[f"{attn}{p}_proj.bias"] for p in "qkv"])
        if arch.qk_norm:
            weights[block + "attn.q_norm.weight"] = source[attn + "q_norm.weight"]
            weights[block + "attn.k_norm.weight"] = source[attn + "k_norm.weight"]
    own = dict(model.named_parameters())
    assert own.keys() == weights.keys()  # every parameter mapped, none left at its init
    with torch.no_grad():
        for name, tensor in weights.items():
            own[name].copy_(tensor)
    return model


def _relative_difference(arch: ArchitectureSection, family: str, **extra) -> float:
    hf = _hf_model(family, arch, **extra)
    model = _copy_into_rewind(hf, arch)
    tokens = torch.randint(0, arch.vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(tokens).logits
        got = model(tokens)
    return float((got - want).abs().max() / want.abs().max())


BASE = {"block_size": 32, "vocab_size": 64, "num_layers": 2, "num_heads": 4, "d_model": 32, "d_ff": 48}
LLAMA3 = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
# family, the options, transformers' extra config keys
CASES = {
    "plain": ("llama", {}, {}),
    "gqa": ("llama", {"num_kv_heads": 2}, {}),
    "mqa": ("llama", {"num_kv_heads": 1}, {}),
    "head_dim": ("llama", {"head_dim": 16, "num_kv_heads": 2}, {}),
    "norm_eps": ("llama", {"norm_eps": 1e-2}, {}),
    "qkv_bias": ("qwen2", {"qkv_bias": True, "num_kv_heads": 2}, {}),
    "qk_norm": ("qwen3", {"qk_norm": True, "head_dim": 16, "norm_eps": 1e-6}, {"attention_bias": False}),
    "tie_embeddings": ("llama", {"tie_embeddings": True}, {}),
    "rope_linear": (
        "llama",
        {"rope_scaling": RopeScalingSection(type="linear", factor=4.0)},
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
    ),
    "rope_llama3": (
        "llama",
        # Wavelengths (6.3, 16.7, 44, 118) below 64 / 4, between it and 64 / 1, above: every branch of the formula.
        {
            "rope_base": 50.0,
            "rope_scaling": RopeScalingSection(**LLAMA3, original_max_position_embeddings=64),
        },
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 50.0,
                **{k: v for k, v in LLAMA3.items() if k != "type"},
                "original_max_position_embeddings": 64,
            },
            "max_position_embeddings": 128,  # transformers warns of an original context as long as the new
        },
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_are_transformers_own(case):
    family, options, extra = CASES[case]
    arch = ArchitectureSection(**BASE, mlp="swiglu", norm="rmsnorm", **options)
    assert _relative_difference(arch, family, **extra) <= 1e-5


def test_llama3_scaling_moves_some_frequencies_and_keeps_others():
    """The comparison above means something: the llama3 case's frequencies are scaled, smoothed and kept."""
    options = CASES["rope_llama3"][1]
    arch = ArchitectureSection(**BASE, **options)
    plain = inverse_frequencies(ArchitectureSection(**BASE, rope_base=50.0))
    ratio = (plain / inverse_frequencies(arch)).tolist()
    assert ratio[0] == 1.0 and ratio[-1] == 8.0 and any(1.0 < r < 8.0 for r in ratio), ratio


def test_the_defaults_add_nothing():
    plain = ArchitectureSection(**BASE)
    spelled = ArchitectureSection(**BASE, num_kv_heads=4, head_dim=8)
    names = [name for name, _ in GPT(plain).named_parameters()]
    assert names == [name for name, _ in GPT(spelled).named_parameters()]
    assert not any(part in name for name in names for part in ("bias", "q_norm", "k_norm"))
    assert torch.equal(GPT(plain, seed=3).head.weight, GPT(spelled, seed=3).head.weight)
    assert config_hash(loads_config(TINY.read_text())) == config_hash(
        loads_config(
            TINY.read_text(),
            overrides=["architecture.norm_eps=1e-5", 'architecture.rope_scaling.type="none"'],
        )
    )


def test_tied_embeddings_are_one_parameter():
    model = GPT(ArchitectureSection(**BASE, tie_embeddings=True))
    assert model.head.weight is model.embed.weight
    assert "head.weight" not in dict(model.named_parameters())


def test_sizes_count_grouped_query_attention_and_the_head_width():
    plain = ArchitectureSection(**BASE)
    grouped = ArchitectureSection(**BASE, num_kv_heads=1, head_dim=16)
    model = GPT(grouped)
    matmuls = sum(
        p.numel()
        for name, p in model.named_parameters()
        if name.endswith(("qkv.weight", "proj.weight", "fc.weight"))
    )
    assert matmul_parameters(grouped) == matmuls + model.head.weight.numel()
    assert matmul_parameters(plain) == 2 * (4 * 32 * 32 + 2 * 32 * 48) + 32 * 64
    # attention's products scale with num_heads * head_dim (64 here), not d_model
    assert flops_per_token(grouped, 0) == 12 * 2 * 64 * 32


BAD = {
    "architecture.num_kv_heads=3": "architecture.num_kv_heads: 3 does not divide num_heads=2",
    "architecture.num_kv_heads=-1": "architecture.num_kv_heads: must be >= 0 (0 = num_heads), got -1",
    "architecture.head_dim=7": "architecture.head_dim: must be even for RoPE, got 7",
    "architecture.head_dim=-2": "architecture.head_dim: must be >= 0 (0 = d_model / num_heads), got -2",
    "architecture.norm_eps=0.0": "architecture.norm_eps: must be positive, got 0.0",
    "architecture.rope_scaling.factor=0.0": "architecture.rope_scaling.factor: must be positive, got 0.0",
    "architecture.rope_scaling.low_freq_factor=-1.0": (
        "architecture.rope_scaling.low_freq_factor: must be positive, got -1.0"
    ),
    "architecture.rope_scaling.high_freq_factor=1.0": (
        "architecture.rope_scaling.high_freq_factor: must be above low_freq_factor=1.0, got 1.0"
    ),
    "architecture.rope_scaling.original_max_position_embeddings=0": (
        "architecture.rope_scaling.original_max_position_embeddings: must be positive, got 0"
    ),
}


@pytest.mark.parametrize("override", list(BAD))
def test_a_bad_value_is_one_line_naming_its_field(override):
    with pytest.raises(ConfigError) as caught:
        loads_config(TINY.read_text(), overrides=[override])
    assert caught.value.problems == [BAD[override]]


def test_a_head_dim_frees_d_model_from_dividing_by_the_heads():
    config = loads_config(TINY.read_text(), overrides=["architecture.num_heads=3", "architecture.head_dim=8"])
    assert config.architecture.head_dim == 8
    with pytest.raises(ConfigError):
        loads_config(TINY.read_text(), overrides=["architecture.num_heads=3"])


def _train(run_dir, option: str, *more: str) -> None:
    sets = [
        "training.tokens=[768,512,512]",
        "logging.checkpoint_interval=2",
        "logging.keep_last_checkpoints=1",
    ]
    command = [
        sys.executable,
        "-m",
        "rewind.tools.cli",
        "train",
        str(TINY),
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]
    command += [part for override in (*sets, *option.split()) for part in ("--set", override)]
    done = subprocess.run([*command, *more], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


OPTIONS = {
    "gqa": "architecture.num_kv_heads=1",
    "head_dim": "architecture.head_dim=8",
    "norm_eps": "architecture.norm_eps=1e-6",
    "qkv_bias": "architecture.qkv_bias=true",
    "qk_norm": "architecture.qk_norm=true",
    "tie_embeddings": "architecture.tie_embeddings=true",
    "rope_linear": "architecture.rope_scaling.type=linear architecture.rope_scaling.factor=2.0",
    "rope_llama3": "architecture.rope_scaling.type=llama3 architecture.rope_scaling.original_max_position_embeddings=16",
}


@pytest.mark.slow
@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_model_with_the_option_trains_and_resumes_bit_for_bit(tmp_path, option):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    _train(straight, OPTIONS[option])
    _train(stopped, OPTIONS[option], "--max-steps", "3")
    _train(stopped, OPTIONS[option])
    want, got = final_tensors(straight), final_tensors(stopped)
    assert_bitwise_equal(want, got)
    recorded = read_seq_events(stopped)[0][1].config.architecture
    assert recorded != loads_config(TINY.read_text()).architecture  # the run has the option


def test_the_exports_name_the_options_they_do_not_write_yet():
    """The other block kinds' families are written with none of the options yet."""
    assert (
        unexported_options(ArchitectureSection(**BASE, num_kv_heads=4, head_dim=8, tie_embeddings=True)) == []
    )
    arch = ArchitectureSection(
        **BASE,
        num_kv_heads=2,
        head_dim=16,
        norm_eps=1e-6,
        qkv_bias=True,
        qk_norm=True,
        rope_scaling=RopeScalingSection(type="linear"),
    )
    assert unexported_options(arch) == [
        f"architecture.{name}"
        for name in ("num_kv_heads", "head_dim", "norm_eps", "qkv_bias", "qk_norm", "rope_scaling")
    ]
    # A Llama block writes them all (Llama, Qwen2 for qkv_bias, Qwen3 for qk_norm) but qkv_bias with qk_norm.
    llama_block = msgspec.structs.replace(arch, mlp="swiglu")
    assert unexported_options(msgspec.structs.replace(llama_block, qk_norm=False)) == []
    assert unexported_options(msgspec.structs.replace(llama_block, qkv_bias=False)) == []
    assert unexported_options(llama_block) == ["architecture.qkv_bias with architecture.qk_norm"]


def test_cached_decoding_and_packed_rows_serve_every_option():
    """The cache keeps the key/value heads alone, and packed rows restart the scaled RoPE positions."""
    from tests.engine.test_model_cache import assert_decoding_matches

    arch = ArchitectureSection(
        **BASE,
        num_kv_heads=2,
        head_dim=16,
        qkv_bias=True,
        qk_norm=True,
        tie_embeddings=True,
        rope_scaling=RopeScalingSection(type="linear", factor=2.0),
    )
    model = GPT(arch, seed=5).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # biases and norm gains off their zeros and ones
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    assert_decoding_matches(model, arch.vocab_size)
    tokens = torch.randint(0, arch.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = model(tokens, documents=torch.tensor([[0] * 5 + [1] * 7]))
        alone = model(tokens[:, 5:])
    torch.testing.assert_close(packed[:, 5:], alone)


def test_an_export_to_transformers_refuses_an_option_it_cannot_write_yet_in_one_line(tmp_path):
    run = tmp_path / "run"
    _train(run, OPTIONS["gqa"], "--max-steps", "2")
    done = subprocess.run(
        [sys.executable, "-m", "rewind.tools.cli", "export", str(run), "--hf", str(tmp_path / "hf")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "architecture.num_kv_heads" in lines[0], done.stderr
    assert not (tmp_path / "hf").exists()
