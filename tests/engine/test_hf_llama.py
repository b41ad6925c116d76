"""rewind's model as transformers' LlamaForCausalLM (rewind.engine.model.hf_llama): the same logits in float32.

A random SwiGLU model, plain or grown (two stacks, the later one prepended), is written as config.json +
model.safetensors and loaded by `AutoModelForCausalLM.from_pretrained`; its logits match rewind's
forward to 1e-5. The rotary convention and frequencies are checked against transformers' own
functions, and the name mapping round-trips bit for bit. The other block kinds, adapters and refusals:
tests/engine/test_hf_models.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rewind.engine.model import hf_llama
from rewind.engine.model.layout import build_plain, eval_mode
from rewind.engine.model.model import GPT, rotate
from rewind.states.config import ArchitectureSection, Config, RunSection
from rewind.states.growth import initial_layout
from rewind.states.state import ModelLayout, StackLayout

ARCH = ArchitectureSection(
    block_size=16, vocab_size=64, num_layers=2, num_heads=2, d_model=32, mlp="swiglu", rope_base=5000.0
)
CONFIG = Config(run=RunSection(seed=3), architecture=ARCH)
GROWN = ModelLayout(stacks=[StackLayout(stack=1, num_blocks=1), StackLayout(stack=0, num_blocks=2)], version=1)


def tokens(batch: int = 2, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, ARCH.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def write_llama(directory: Path, weights: dict[str, torch.Tensor], layout: ModelLayout) -> Path:
    flat = hf_llama.flat_weights(weights, layout)
    num_layers = sum(spec.num_blocks for spec in layout.stacks)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(hf_llama.to_llama(flat), directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(hf_llama.llama_config(ARCH, num_layers=num_layers)))
    return directory


def transformers_logits(directory: Path, idx: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    with torch.no_grad():
        return model(idx).logits


@pytest.mark.parametrize("layout", [initial_layout(2), GROWN], ids=["plain", "grown"])
def test_transformers_computes_rewinds_logits(tmp_path, layout):
    model = eval_mode(build_plain(CONFIG, layout))
    if layout is GROWN:
        assert model.order == [1, 0]
    directory = write_llama(tmp_path / "hf", model.state_dict(), layout)
    config = json.loads((directory / "config.json").read_text())
    assert config["num_hidden_layers"] == model.num_blocks and config["tie_word_embeddings"] is False
    idx = tokens()
    with torch.no_grad():
        ours = model(idx)
    theirs = transformers_logits(directory, idx)
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_llama_config_is_what_transformers_reads():
    from transformers import LlamaConfig

    read = LlamaConfig.from_dict(hf_llama.llama_config(ARCH, num_layers=3, eos_token_id=7))
    assert (read.hidden_size, read.intermediate_size, read.num_hidden_layers) == (32, 128, 3)
    assert read.num_key_value_heads == read.num_attention_heads == 2
    assert read.rope_parameters["rope_theta"] == 5000.0 and read.rms_norm_eps == 1e-5
    assert read.max_position_embeddings == 16 and read.eos_token_id == 7 and read.bos_token_id is None
    assert not read.attention_bias and not read.mlp_bias and read.hidden_act == "silu"


def test_rotary_halves_convention_is_transformers_rotate_half():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = LlamaConfig.from_dict(hf_llama.llama_config(ARCH, num_layers=2))
    x = torch.randn(1, 2, 16, 16, generator=torch.Generator().manual_seed(1))  # (B, H, T, head size)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(16)[None])
    ours_cos, ours_sin = GPT._rope_tables(ARCH)
    # transformers repeats the frequencies over both halves; rewind keeps one half (same angles).
    torch.testing.assert_close(cos[0, :, :8], ours_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(cos[0, :, 8:], ours_cos, rtol=0, atol=1e-6)
    q, _ = apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(rotate(x, ours_cos, ours_sin), q, rtol=0, atol=1e-5)


def test_names_round_trip_bit_for_bit():
    flat = hf_llama.flat_weights(build_plain(CONFIG, GROWN).state_dict(), GROWN)
    assert sorted(k for k in flat if k.startswith("stacks.")) == sorted(
        f"stacks.0.blocks.{k}.{part}"
        for k in range(3)
        for part in ("attn_norm.weight", "attn.qkv.weight", "attn.proj.weight", "mlp_norm.weight", "mlp.fc.weight", "mlp.proj.weight")
    )
    llama = hf_llama.to_llama(flat)
    assert llama["model.layers.1.mlp.gate_proj.weight"].shape == (128, 32)
    assert torch.equal(llama["model.layers.0.self_attn.k_proj.weight"], flat["stacks.0.blocks.0.attn.qkv.weight"][32:64])
    back = hf_llama.from_llama(llama)
    assert back.keys() == flat.keys() and all(torch.equal(back[k], flat[k]) for k in flat)
    tied = {k: v for k, v in llama.items() if k != "lm_head.weight"}
    assert torch.equal(hf_llama.from_llama(tied, tied=True)["head.weight"], flat["embed.weight"])
    with pytest.raises(ValueError, match="k_proj"):
        hf_llama.from_llama({k: v for k, v in llama.items() if k != "model.layers.2.self_attn.k_proj.weight"})
    with pytest.raises(ValueError, match="rotary_emb"):
        hf_llama.from_llama({**llama, "model.layers.0.self_attn.rotary_emb.weight": torch.zeros(1)})
    old_release = {**llama, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)}  # a derived buffer
    assert hf_llama.from_llama(old_release).keys() == flat.keys()
    with pytest.raises(ValueError, match="no block"):
        hf_llama.flat_weights({"stacks.5.blocks.0.attn.qkv.weight": torch.zeros(1)}, GROWN)
