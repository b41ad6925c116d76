"""Starting weights (rewind.engine.model.pretrained): a transformers Llama directory or a rewind `--to` file.

Directories are written by transformers itself (`save_pretrained`, one file or shards, tied or not) and
load into a fresh rewind model that computes transformers' logits; a rewind export of a grown model
loads as one stack in its order, bit for bit. Every mismatch is one line naming both sides; pickles are
never read; the identity is the sha256 of the weight bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from rewind.engine.model.layout import build_plain, eval_mode
from rewind.engine.model.pretrained import PretrainedError, apply_pretrained, expected_shapes, load_pretrained
from rewind.states.config import ArchitectureSection, Config, ObjectiveSection, RunSection
from rewind.states.state import ModelLayout, StackLayout
from rewind.tools.export_cmd import model_metadata

ARCH = ArchitectureSection(block_size=16, vocab_size=64, num_layers=2, num_heads=2, d_model=32, mlp="swiglu")
CONFIG = Config(run=RunSection(seed=4), architecture=ARCH)


def tokens() -> torch.Tensor:
    return torch.randint(0, ARCH.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))


def llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=64, hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):  # transformers initialises from the global RNG: seeded, then restored
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**{**settings, **overrides})).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A Llama directory as transformers saves it, and its logits on `tokens()`."""
    model, directory = llama(), tmp_path_factory.mktemp("pretrained") / "llama"
    model.save_pretrained(directory)
    with torch.no_grad():
        return directory, model(tokens()).logits


def started_from(pretrained_tensors: dict[str, torch.Tensor], config: Config = CONFIG) -> torch.nn.Module:
    model = build_plain(config, None)
    apply_pretrained(model, pretrained_tensors)
    return eval_mode(model)


def test_a_transformers_llama_starts_a_run_with_its_logits(saved):
    directory, logits = saved
    loaded = load_pretrained(str(directory), CONFIG)
    assert loaded.kind == "llama"
    assert loaded.identity == hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()
    assert loaded.identity == load_pretrained(directory.name, CONFIG, base_dir=directory.parent).identity
    assert all(t.dtype == torch.float32 for t in loaded.tensors.values())
    with torch.no_grad():
        assert (started_from(loaded.tensors)(tokens()) - logits).abs().max().item() <= 1e-5


def test_sharded_and_tied_directories(tmp_path):
    model = llama(tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    names = sorted(p.name for p in (tmp_path / "sharded").iterdir())
    assert "model.safetensors.index.json" in names and sum(n.endswith(".safetensors") for n in names) > 1
    loaded = load_pretrained(str(tmp_path / "sharded"), CONFIG)
    shards = sorted(p for p in (tmp_path / "sharded").iterdir() if p.name.endswith(".safetensors"))
    assert loaded.identity == hashlib.sha256(b"".join(p.read_bytes() for p in shards)).hexdigest()
    assert torch.equal(loaded.tensors["head.weight"], loaded.tensors["embed.weight"])
    with torch.no_grad():
        assert (started_from(loaded.tensors)(tokens()) - model(tokens()).logits).abs().max().item() <= 1e-5


def edited(saved_dir: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the saved directory whose config.json has `changes` (None: the key removed)."""
    directory = tmp_path / "edited"
    directory.mkdir()
    (directory / "model.safetensors").write_bytes((saved_dir / "model.safetensors").read_bytes())
    config = json.loads((saved_dir / "config.json").read_text())
    for key, value in changes.items():
        config.pop(key, None) if value is None else config.__setitem__(key, value)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"num_hidden_layers": 4}, "has num_hidden_layers 4, architecture.num_layers is 2"),
        ({"hidden_size": 64}, "has hidden_size 64, architecture.d_model is 32"),
        ({"intermediate_size": 96}, "has intermediate_size 96, architecture.d_ff (0 = 4 * d_model) is 128"),
        ({"vocab_size": 65}, "has vocab_size 65, architecture.vocab_size is 64"),
        ({"num_key_value_heads": 1}, "has num_key_value_heads 1, architecture.num_heads"),
        ({"rms_norm_eps": 1e-6}, "has rms_norm_eps 1e-06, rewind's norm eps is 1e-05"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, "rope theta 500000.0, architecture.rope_base is 10000.0"),
        ({"rope_parameters": None, "rope_theta": 20.0}, "rope theta 20.0, architecture.rope_base"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}, "has rope type 'linear'"),
        ({"attention_bias": True}, "has attention_bias True"),
        ({"hidden_act": "gelu"}, "has hidden_act 'gelu'"),
        ({"max_position_embeddings": 8}, "has max_position_embeddings 8, architecture.block_size is 16"),
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "not a Llama"),
    ],
)
def test_a_llama_that_differs_is_one_line_naming_both_sides(saved, tmp_path, changes, words):
    directory = edited(saved[0], tmp_path, **changes)
    with pytest.raises(PretrainedError) as caught:
        load_pretrained(str(directory), CONFIG)
    message = str(caught.value)
    assert message.startswith(f"pretrained: {directory}/config.json has ") or "not a Llama" in message
    assert words in message and "\n" not in message


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (msgspec.structs.replace(CONFIG, architecture=msgspec.structs.replace(ARCH, mlp="gelu")), "architecture.mlp is 'gelu'"),
        (msgspec.structs.replace(CONFIG, architecture=msgspec.structs.replace(ARCH, norm="layernorm")), "architecture.norm"),
        (msgspec.structs.replace(CONFIG, objective=ObjectiveSection(kind="mlm")), "objective.kind is 'mlm'"),
    ],
)
def test_a_config_llama_cannot_be_is_refused(saved, config, words):
    with pytest.raises(PretrainedError, match=words):
        load_pretrained(str(saved[0]), config)


def test_what_is_not_a_safetensors_llama_is_refused(saved, tmp_path):
    with pytest.raises(PretrainedError, match="no such file or directory"):
        load_pretrained(str(tmp_path / "absent"), CONFIG)
    with pytest.raises(PretrainedError, match="give the directory that holds it"):
        load_pretrained(str(saved[0] / "config.json"), CONFIG)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PretrainedError, match=r"has no config\.json"):
        load_pretrained(str(tmp_path / "empty"), CONFIG)
    pickled = edited(saved[0], tmp_path)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")  # never unpickled: refused by name
    with pytest.raises(PretrainedError, match=r"only pickled weights \(pytorch_model\.bin\); rewind reads safetensors only"):
        load_pretrained(str(pickled), CONFIG)
    (pickled / "pytorch_model.bin").unlink()
    with pytest.raises(PretrainedError, match=r"has no model\.safetensors"):
        load_pretrained(str(pickled), CONFIG)
    (pickled / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(PretrainedError, match="not a readable safetensors file"):
        load_pretrained(str(pickled), CONFIG)


GROWN = ModelLayout(stacks=[StackLayout(stack=1, num_blocks=1), StackLayout(stack=0, num_blocks=2)], version=1)


def rewind_export(path: Path, config: Config, layout: ModelLayout) -> torch.nn.Module:
    """What `export --to` writes for a model of `layout` (its tensors and metadata), and the model."""
    model = eval_mode(build_plain(config, layout))
    save_file(dict(model.state_dict()), path, metadata={"run": "r", **model_metadata(config, layout)})
    return model


def test_a_grown_rewind_export_starts_a_run_as_one_stack_bit_for_bit(tmp_path):
    source = rewind_export(tmp_path / "grown.safetensors", CONFIG, GROWN)
    config = msgspec.structs.replace(CONFIG, architecture=msgspec.structs.replace(ARCH, num_layers=3))
    loaded = load_pretrained(str(tmp_path / "grown.safetensors"), config)
    assert loaded.kind == "rewind"
    assert loaded.identity == hashlib.sha256((tmp_path / "grown.safetensors").read_bytes()).hexdigest()
    assert torch.equal(loaded.tensors["stacks.0.blocks.0.attn.qkv.weight"], source.state_dict()["stacks.1.blocks.0.attn.qkv.weight"])
    with torch.no_grad():
        assert torch.equal(started_from(loaded.tensors, config)(tokens()), source(tokens()))
    with pytest.raises(PretrainedError) as caught:
        load_pretrained(str(tmp_path / "grown.safetensors"), CONFIG)
    assert str(caught.value) == (
        f"pretrained: {tmp_path}/grown.safetensors has architecture.num_layers 3, architecture.num_layers is 2"
    )


def test_a_rewind_export_that_differs_is_one_line(tmp_path):
    rewind_export(tmp_path / "plain.safetensors", CONFIG, ModelLayout(stacks=[StackLayout(stack=0, num_blocks=2)]))
    cases = [
        (msgspec.structs.replace(CONFIG, architecture=msgspec.structs.replace(ARCH, d_model=64)), "architecture.d_model 32, architecture.d_model is 64"),
        (msgspec.structs.replace(CONFIG, architecture=msgspec.structs.replace(ARCH, mlp="gelu")), "architecture.mlp 'swiglu', architecture.mlp is 'gelu'"),
        (msgspec.structs.replace(CONFIG, architecture=msgspec.structs.replace(ARCH, block_size=32)), "block_size 16, architecture.block_size is 32"),
        (msgspec.structs.replace(CONFIG, objective=ObjectiveSection(kind="mlm")), "objective.kind 'clm', objective.kind is 'mlm'"),
    ]
    for config, words in cases:
        with pytest.raises(PretrainedError) as caught:
            load_pretrained(str(tmp_path / "plain.safetensors"), config)
        assert words in str(caught.value) and "\n" not in str(caught.value)
    shorter = msgspec.structs.replace(CONFIG, architecture=msgspec.structs.replace(ARCH, block_size=8))
    assert load_pretrained(str(tmp_path / "plain.safetensors"), shorter).tensors.keys() == expected_shapes(shorter).keys()
    save_file({"embed.weight": torch.zeros(2, 2)}, tmp_path / "bare.safetensors")  # an export of an older release
    with pytest.raises(PretrainedError, match="carries no rewind architecture"):
        load_pretrained(str(tmp_path / "bare.safetensors"), CONFIG)


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"architecture": msgspec.structs.replace(ARCH, mlp="gelu", norm="layernorm", d_ff=24)},
        {"objective": ObjectiveSection(kind="mlm")},
        {"objective": ObjectiveSection(kind="diffusion", num_levels=4)},
    ],
)
def test_expected_shapes_are_the_models(change):
    config = msgspec.structs.replace(CONFIG, **change)
    model = build_plain(config, None)
    assert expected_shapes(config) == {name: tuple(t.shape) for name, t in model.state_dict().items()}


def test_apply_pretrained_wants_every_weight_and_its_shape(saved):
    tensors = load_pretrained(str(saved[0]), CONFIG).tensors
    with pytest.raises(PretrainedError, match=r"missing \['head.weight'\], unexpected \[\]"):
        apply_pretrained(build_plain(CONFIG, None), {k: v for k, v in tensors.items() if k != "head.weight"})
    with pytest.raises(PretrainedError, match=r"norm.weight is \[3\], the model's \[32\]"):
        apply_pretrained(build_plain(CONFIG, None), {**tensors, "norm.weight": torch.ones(3)})
