"""[pretrained] sources that lie about themselves: a config.json or an export's metadata with values of
the wrong type or size, weight files whose tensors have other shapes than the config's model. Each is one
line naming the file and the field (or tensor), before any tensor is read, and a run is never started
from them (exit 2, nothing recorded)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from rewind.engine.model import pretrained_files
from rewind.engine.model.layout import build_plain, eval_mode
from rewind.engine.model.pretrained import PretrainedError, load_pretrained
from rewind.states.config import ArchitectureSection, Config, RunSection
from rewind.states.state import ModelLayout, StackLayout
from rewind.tools.export_cmd import model_metadata
from tests.engine.test_loop import run_cli

ARCH = ArchitectureSection(block_size=16, vocab_size=256, num_layers=2, num_heads=2, d_model=32, mlp="swiglu")
CONFIG = Config(run=RunSection(seed=4), architecture=ARCH)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=256, hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=16, rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    directory = tmp_path_factory.mktemp("hostile") / "llama"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**settings)).save_pretrained(directory)
    return directory


def copied(
    llama_dir: Path, tmp_path: Path, config_text: str | None = None, tensors: dict | None = None
) -> Path:
    """A copy of the Llama directory with config.json's text and/or the weight file replaced."""
    directory = tmp_path / "copy"
    directory.mkdir()
    (directory / "config.json").write_text(config_text or (llama_dir / "config.json").read_text())
    save_file(
        tensors if tensors is not None else load_file(llama_dir / "model.safetensors"),
        directory / "model.safetensors",
    )
    return directory


def refused(path: Path, config: Config = CONFIG) -> str:
    """load_pretrained's one line, with no tensor read (safetensors' loader is never reached)."""
    read = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pretrained_files, "read_weights", lambda *a: read.append(a))
        with pytest.raises(PretrainedError) as caught:
            load_pretrained(str(path), config)
    message = str(caught.value)
    assert "\n" not in message and read == []
    return message


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ('"abc"', "rope_theta: Expected `float`, got `str`"),
        ("null", "rope_theta: Expected `float`, got `null`"),
        ("1" + "0" * 400, "rope_theta: Number out of range"),
        ("-1.0", "rope_theta: Expected `float` > 0.0"),
    ],
    ids=["string", "null", "10**400", "negative"],
)
def test_a_rope_theta_that_is_no_positive_number_is_one_line(llama_dir, tmp_path, value, words):
    text = (llama_dir / "config.json").read_text()
    hf = json.loads(text)
    hf.pop("rope_parameters")
    text = json.dumps(hf)[:-1] + f', "rope_theta": {value}}}'  # (json.dumps cannot write 10**400 as a number)
    directory = copied(llama_dir, tmp_path, text)
    assert refused(directory) == f"pretrained: {directory}/config.json: {words}"


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("architectures", 5, "architectures: Expected `array | null`, got `int`"),
        ("hidden_size", "32", "hidden_size: Expected `int`, got `str`"),
        ("num_hidden_layers", 10**12, "num_hidden_layers: Expected `int` <= 2147483647"),
        ("rope_parameters", {"rope_theta": "abc"}, "rope_parameters.rope_theta: Expected `float`, got `str`"),
        ("tie_word_embeddings", "false", "tie_word_embeddings: Expected `bool`, got `str`"),
    ],
)
def test_config_json_values_of_the_wrong_type_or_size_are_one_line(llama_dir, tmp_path, key, value, words):
    hf = json.loads((llama_dir / "config.json").read_text()) | {key: value}
    directory = copied(llama_dir, tmp_path, json.dumps(hf))
    assert refused(directory) == f"pretrained: {directory}/config.json: {words}"


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("model.layers.1.self_attn.k_proj.weight", (32, 16)),  # torch.cat of q, k, v failed: a traceback
        ("model.layers.0.mlp.up_proj.weight", (128, 16)),  # likewise gate and up
        ("model.layers.0.self_attn.v_proj.weight", (16, 32)),  # (concatenated, then a misfit of 80 rows)
    ],
)
def test_weights_whose_header_shapes_differ_from_the_models_are_named_before_reading(
    llama_dir, tmp_path, name, shape
):
    tensors = load_file(llama_dir / "model.safetensors")
    tensors[name] = torch.zeros(shape)
    directory = copied(llama_dir, tmp_path, tensors=tensors)
    expected = list(load_file(llama_dir / "model.safetensors")[name].shape)
    assert refused(directory) == (
        f"pretrained: {directory}/model.safetensors: {name} is {list(shape)} in its header, the config's model's {expected}"
    )


def test_a_llama_layer_the_model_has_not_is_refused_before_reading(llama_dir, tmp_path):
    tensors = load_file(llama_dir / "model.safetensors")
    tensors["model.layers.7.self_attn.q_proj.weight"] = torch.zeros(32, 32)
    tensors["model.layers.7.self_attn.k_proj.weight"] = torch.zeros(32, 16)  # would not concatenate either
    directory = copied(llama_dir, tmp_path, tensors=tensors)
    assert "tensor 'model.layers.7.self_attn.k_proj.weight' is not one of the config's model's" in refused(
        directory
    )


def test_an_untouched_llama_still_loads(llama_dir):
    assert load_pretrained(str(llama_dir), CONFIG).kind == "llama"


# --- a rewind export ---------------------------------------------------------------------------------

LAYOUT = ModelLayout(stacks=[StackLayout(stack=0, num_blocks=2)])


def export(path: Path, *, architecture: object = None, layout: object = None) -> Path:
    """An `export --to` file of a fresh model, its metadata's architecture or layout (JSON) replaced."""
    model = eval_mode(build_plain(CONFIG, LAYOUT))
    metadata = model_metadata(CONFIG, LAYOUT)
    if architecture is not None:
        metadata["rewind.architecture"] = json.dumps(architecture)
    if layout is not None:
        metadata["layout"] = json.dumps(layout)
    save_file(dict(model.state_dict()), path, metadata=metadata)
    return path


def architecture(**changes) -> dict:
    return msgspec.to_builtins(ARCH) | changes


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"block_size": "64"}, "rewind.architecture.block_size: Expected `int`, got `str`"),
        ({"d_model": None}, "rewind.architecture.d_model: Expected `int`, got `null`"),
        ({"rope_base": "x"}, "rewind.architecture.rope_base: Expected `float`, got `str`"),
    ],
)
def test_export_metadata_of_the_wrong_type_is_one_line(tmp_path, changes, words):
    path = export(tmp_path / "w.safetensors", architecture=architecture(**changes))
    assert refused(path) == f"pretrained: {path}: {words}"


def test_a_layout_of_a_billion_blocks_is_refused_before_any_table_of_them(tmp_path, monkeypatch):
    from rewind.engine.model import pretrained_checks
    def no_table(layout):
        raise AssertionError("a table of the layout's blocks was built")

    monkeypatch.setattr(pretrained_checks, "block_prefixes", no_table)
    layout = {"stacks": [{"stack": 0, "num_blocks": 10**9}]}
    path = export(tmp_path / "w.safetensors", layout=layout)
    assert refused(path) == (
        f"pretrained: {path}: layout: its stacks hold 1,000,000,000 blocks, its architecture.num_layers is 2"
    )
    path = export(
        tmp_path / "v.safetensors",
        layout={"stacks": [{"stack": 0, "num_blocks": 3}, {"stack": 1, "num_blocks": -1}]},
    )
    assert refused(path) == f"pretrained: {path}: layout.stacks[1].num_blocks: must be >= 1, got -1"


def test_an_export_tensor_of_another_shape_is_named_before_reading(tmp_path):
    path = export(tmp_path / "w.safetensors")
    tensors = load_file(path)
    tensors["stacks.0.blocks.1.mlp.fc.weight"] = torch.zeros(3, 32)
    save_file(tensors, path, metadata=model_metadata(CONFIG, LAYOUT))
    assert refused(path) == (
        f"pretrained: {path}: stacks.0.blocks.1.mlp.fc.weight is [3, 32] in its header, the config's model's [256, 32]"
    )


# --- a run started from them --------------------------------------------------------------------------

RUN_CONFIG = """
[architecture]
block_size = 16
vocab_size = 256
num_layers = 2
num_heads = 2
d_model = 32
mlp = "swiglu"
[training]
batch_size = 2
tokens = [128]
datasets = [[{{ name = "grammar" }}]]
[pretrained]
path = "{path}"
"""


@pytest.mark.parametrize("source", ["export", "llama"])
def test_a_run_from_a_lying_source_is_one_line_exit_2_and_records_nothing(llama_dir, tmp_path, source):
    if source == "export":
        path = export(tmp_path / "w.safetensors", architecture=architecture(block_size="64"))
        words = "rewind.architecture.block_size: Expected `int`, got `str`"
    else:
        hf = json.loads((llama_dir / "config.json").read_text()) | {
            "rope_parameters": None,
            "rope_theta": "abc",
        }
        path = copied(llama_dir, tmp_path, json.dumps(hf))
        words = "config.json: rope_theta: Expected `float`, got `str`"
    (tmp_path / "run.toml").write_text(RUN_CONFIG.format(path=path))
    code, _, err = run_cli("train", tmp_path / "run.toml", "--run-dir", tmp_path / "run", "--no-progress")
    assert code == 2 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and words in err, err
    assert not (tmp_path / "run" / "events").exists()
