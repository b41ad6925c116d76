"""The transformers families of the Llama block both ways (rewind.engine.model.hf_families): a tiny random
Llama, Mistral, Qwen2 and Qwen3 made here by transformers and saved to a directory starts a run whose first
forward gives transformers' logits, and `rewind export --hf` of that run writes the family back with the
original tensors bit for bit, loaded by transformers with the same logits; a model_type rewind does not read
and a sliding window shorter than the run's rows are one line each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rewind.engine.model import hf_models
from rewind.engine.model.layout import build_plain, eval_mode
from rewind.engine.model.pretrained import PretrainedError, apply_pretrained, load_pretrained
from rewind.engine.model.pretrained_checks import causal_shapes
from rewind.engine.model.pretrained_llama import llama_directory
from rewind.states.config import ArchitectureSection, Config, RopeScalingSection
from rewind.states.config_reading import loads_config
from rewind.tools.export_source import export_source
from tests.engine.test_architectures import hf_shape, perturbed
from tests.engine.test_loop import run_cli
from tests.tools.test_export_hf import runs_model

transformers = pytest.importorskip("transformers")

BASE = {"block_size": 16, "vocab_size": 256, "num_layers": 2, "num_heads": 4, "d_model": 32, "d_ff": 48}
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# model_type, the architecture's options, transformers' extra config keys, the class an export writes
CASES = {
    "llama": ("llama", {"tie_embeddings": True, "norm_eps": 1e-6}, {}, "LlamaForCausalLM"),
    "llama_gqa_llama3": (
        "llama",
        {
            "num_kv_heads": 2,
            "head_dim": 16,
            "rope_base": 50.0,
            "rope_scaling": RopeScalingSection(type="llama3", **LLAMA3),
        },
        {
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 50.0, **LLAMA3},
            "max_position_embeddings": 128,
        },
        "LlamaForCausalLM",
    ),
    "mistral": (
        "mistral",
        {"num_kv_heads": 2},
        {"sliding_window": None},
        "LlamaForCausalLM",
    ),  # (written as a Llama)
    "qwen2": (
        "qwen2",
        {"num_kv_heads": 1, "qkv_bias": True, "rope_scaling": RopeScalingSection(type="linear", factor=4.0)},
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
        "Qwen2ForCausalLM",
    ),
    "qwen3": (
        "qwen3",
        {"num_kv_heads": 2, "head_dim": 16, "qk_norm": True, "norm_eps": 1e-6},
        {},
        "Qwen3ForCausalLM",
    ),
}


def architecture(options: dict) -> ArchitectureSection:
    return ArchitectureSection(**BASE, norm="rmsnorm", mlp="swiglu", **options)


def save_hf(directory: Path, model_type: str, arch: ArchitectureSection, **extra):
    """A transformers `model_type` of `arch`'s shape, every weight random (biases and norm gains off their
    zeros and ones), saved to `directory`; the model."""
    keys = {
        **hf_shape(arch), "max_position_embeddings": 64, "rope_theta": arch.rope_base,
        "bos_token_id": None, "eos_token_id": None, **extra,
    }  # fmt: skip
    config = transformers.AutoConfig.for_model(model_type, **keys)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = perturbed(transformers.AutoModelForCausalLM.from_config(config).float().eval())
    model.save_pretrained(directory)
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def toml_value(value: object) -> str:
    return (
        str(value).lower()
        if isinstance(value, bool)
        else f'"{value}"'
        if isinstance(value, str)
        else repr(value)
    )


def run_toml(arch: ArchitectureSection, source: Path) -> str:
    """A run of `arch` (every field stated) that starts from `source`."""
    fields = [name for name in ArchitectureSection.__struct_fields__ if name != "rope_scaling"]
    options = "\n".join(f"{name} = {toml_value(getattr(arch, name))}" for name in fields)
    rope = arch.rope_scaling
    scaling = "\n".join(f"{name} = {toml_value(getattr(rope, name))}" for name in rope.__struct_fields__)
    return f"""
[run]
name = "families"
seed = 3

[architecture]
{options}

[architecture.rope_scaling]
{scaling}

[training]
batch_size = 2
tokens = [64]
datasets = [[{{ name = "grammar" }}]]
validation_steps = 1

[pretrained]
path = "{source}"
"""


def run_from(tmp_path: Path, arch: ArchitectureSection, source: Path | None) -> Path:
    """A run of `arch` (from `source`, else from its own initialisation) stopped before its first step."""
    toml = run_toml(arch, source) if source else run_toml(arch, Path()).split("[pretrained]")[0]
    (tmp_path / "run.toml").write_text(toml)
    command = (
        "train",
        tmp_path / "run.toml",
        "--run-dir",
        tmp_path / "run",
        "--max-steps",
        "0",
        "--no-progress",
    )
    code, _, err = run_cli(*command)
    assert code == 0, err
    return tmp_path / "run"


@pytest.mark.parametrize("case", list(CASES))
def test_a_family_directory_is_read_with_its_logits(tmp_path, case):
    model_type, options, extra, _ = CASES[case]
    arch = architecture(options)
    hf = save_hf(tmp_path / "source", model_type, arch, **extra)
    config = loads_config(run_toml(arch, tmp_path / "source"))
    assert config.architecture == arch
    flat, _ = llama_directory(str(tmp_path / "source"), config, causal_shapes(arch))
    model = build_plain(config, None)
    apply_pretrained(model, flat)
    with torch.no_grad():
        assert relative(eval_mode(model)(tokens()), hf(tokens()).logits) <= 1e-5


EXPORTS = {
    **{case: (architecture(options), written) for case, (_, options, _, written) in CASES.items()},
    # Every family writes tie_word_embeddings, the head then not a tensor of its own.
    "arcee_tied": (ArchitectureSection(**BASE, mlp="gelu", tie_embeddings=True), "ArceeForCausalLM"),
}


@pytest.mark.parametrize("case", list(EXPORTS))
def test_an_export_is_the_family_that_computes_the_run(tmp_path, case):
    arch, written = EXPORTS[case]
    run = run_from(tmp_path, arch, None)
    code, _, err = run_cli("export", run, "--hf", tmp_path / "hf")
    assert code == 0, err
    ours, source = runs_model(run), export_source(str(run))
    family = hf_models.family_of(source.config)
    computed = hf_models.hf_weights(dict(ours.state_dict()), source.layout, family)
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == computed.keys() and all(torch.equal(exported[k], computed[k]) for k in computed)
    assert ("lm_head.weight" in exported) is not arch.tie_embeddings
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(back).__name__ == written
    with torch.no_grad():
        assert relative(back(tokens()).logits, ours(tokens())) <= 1e-5


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_from_a_family_exports_it_back_bit_for_bit(tmp_path, case):
    model_type, options, extra, written = CASES[case]
    arch = architecture(options)
    hf = save_hf(tmp_path / "source", model_type, arch, **extra)
    run = run_from(tmp_path, arch, tmp_path / "source")
    code, _, err = run_cli("export", run, "--hf", tmp_path / "hf")
    assert code == 0, err
    original, exported = (
        load_file(tmp_path / "source" / "model.safetensors"),
        load_file(tmp_path / "hf" / "model.safetensors"),
    )
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[name], original[name]) for name in original)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(back).__name__ == written
    with torch.no_grad():
        assert relative(back(tokens()).logits, hf(tokens()).logits) <= 1e-5


def test_a_model_type_rewind_does_not_read_is_one_line(tmp_path):
    arch = architecture({})
    save_hf(tmp_path / "gpt2", "llama", arch)
    config_path = tmp_path / "gpt2" / "config.json"
    config_path.write_text(
        config_path.read_text().replace('"llama"', '"gpt2"').replace("LlamaForCausalLM", "GPT2LMHeadModel")
    )
    with pytest.raises(PretrainedError) as caught:
        load_pretrained(str(tmp_path / "gpt2"), Config(architecture=arch))
    message = str(caught.value)
    assert (
        "'gpt2'" in message
        and "llama (LlamaForCausalLM)" in message
        and "qwen3 (Qwen3ForCausalLM)" in message
    )
    assert "\n" not in message


@pytest.mark.parametrize(("window", "refused"), [(8, True), (16, False), (None, False)])
def test_a_mistral_window_shorter_than_a_row_is_refused_by_name(tmp_path, window, refused):
    arch = architecture({})
    save_hf(tmp_path / "mistral", "mistral", arch, sliding_window=window)
    config = Config(architecture=arch)
    if not refused:
        assert load_pretrained(str(tmp_path / "mistral"), config).kind == "llama"
        return
    with pytest.raises(PretrainedError) as caught:
        load_pretrained(str(tmp_path / "mistral"), config)
    assert "has sliding_window 8, architecture.block_size is 16" in str(caught.value)


@pytest.mark.parametrize(
    ("model_type", "options", "words"),
    [
        (
            "qwen2",
            {"qkv_bias": False},
            "is a Qwen2ForCausalLM (q, k and v with biases), architecture.qkv_bias is False",
        ),
        (
            "qwen3",
            {"qk_norm": False},
            "is a Qwen3ForCausalLM (q_norm, k_norm), architecture.qk_norm is False",
        ),
        ("llama", {"num_kv_heads": 4}, "has num_key_value_heads 2, architecture.num_kv_heads is 4"),
        ("llama", {"head_dim": 8}, "has head_dim 16, architecture.head_dim is 8"),
        (
            "llama",
            {"rope_scaling": RopeScalingSection(type="linear", factor=2.0)},
            "has rope factor 4.0, architecture.rope_scaling.factor is 2.0",
        ),
        (
            "llama",
            {"tie_embeddings": True},
            "has tie_word_embeddings False, architecture.tie_embeddings is True",
        ),
    ],
)
def test_a_family_that_differs_from_the_run_is_one_line_naming_both(tmp_path, model_type, options, words):
    saved = {
        "num_kv_heads": 2,
        "head_dim": 16,
        "qkv_bias": model_type == "qwen2",
        "qk_norm": model_type == "qwen3",
    }
    extra = {}
    if model_type == "llama":
        saved["rope_scaling"] = RopeScalingSection(type="linear", factor=4.0)
        extra["rope_parameters"] = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    save_hf(tmp_path / "source", model_type, architecture(saved), **extra)
    run = architecture({**saved, **options})
    with pytest.raises(PretrainedError) as caught:
        load_pretrained(str(tmp_path / "source"), Config(architecture=run))
    assert words in str(caught.value) and "\n" not in str(caught.value)
