"""`rewind export RUN --hf DIR` end to end, and the `--to` file's model metadata.

A tiny SwiGLU run is trained through the command line (a subprocess, from tmp_path); its export loads
in transformers (`AutoModelForCausalLM`) as a LlamaForCausalLM with the logits of rewind's model of the
same checkpoint, and loads back through `load_pretrained` / `apply_pretrained` bit for bit, as does its
`--to` file. The tiny example (GELU MLP, the default) exports as an ArceeForCausalLM with the run's
logits, and transformers' greedy `generate` continues prompts as `rewind sample` does, without a warning.
A run that grew a LoRA trunk exports merged, with the adapted model's logits. Refusals (a masked
objective, a non-empty DIR) are one line, exit 2, and nothing is written. `rewind --help` names every
export.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rewind.engine.model.layout import build_plain, eval_mode
from rewind.engine.model.pretrained import apply_pretrained, load_pretrained
from rewind.states.config import Config
from rewind.states.fold import fold
from rewind.states.history import config_in_force
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import run_cli
from tests.tools.small_posttrain import train_small_posttrain

pytest.importorskip("transformers")

# 3 steps of 4 rows of 16 tokens: a couple of seconds.
CONFIG = """
[run]
name = "export-hf"
seed = 3

[architecture]
block_size = 16
vocab_size = 256
num_layers = {num_layers}
num_heads = 2
d_model = 32
mlp = "{mlp}"

[training]
batch_size = 4
tokens = {tokens}
datasets = {datasets}
validation_steps = 1

[optimization]
lr = 3e-3
schedule = "constant"

[logging]
report_interval = 1000
"""
# Stage 1 grows a stack on top of stack 0, which becomes a LoRA trunk (rank 4, alpha 6).
GROWTH = """
[lora]
trunk_rank = 4
alpha_per_rank = 1.5

[[growth]]
at_stage = 1
num_blocks = 1
trunk = "lora"
"""
ONE_STAGE = {"tokens": "[192]", "datasets": '[[{ name = "grammar" }]]'}
TWO_STAGES = {"tokens": "[128, 128]", "datasets": '[[{ name = "grammar" }], [{ name = "grammar" }]]'}


def write_config(base: Path, name: str, *, mlp: str = "swiglu", num_layers: int = 2, stages=ONE_STAGE, extra=""):
    path = base / f"{name}.toml"
    path.write_text(CONFIG.format(mlp=mlp, num_layers=num_layers, **stages) + extra)
    return path


@pytest.fixture(scope="module")
def swiglu_run(tmp_path_factory) -> Path:
    """Trained by the `rewind` command in its own process, run from its directory."""
    base = tmp_path_factory.mktemp("export-hf")
    write_config(base, "tiny")
    command = [sys.executable, "-m", "rewind.tools.cli", "train", "tiny.toml", "--run-dir", "run", "--no-progress"]
    done = subprocess.run(command, cwd=base, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return base / "run"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("export-hf-lora")
    config = write_config(base, "lora", num_layers=1, stages=TWO_STAGES, extra=GROWTH)
    code, _, err = run_cli("train", config, "--run-dir", base / "run", "--no-progress")
    assert code == 0, err
    return base / "run"


def runs_config(run: Path) -> Config:
    return config_in_force(read_seq_events(run))


def runs_model(run: Path) -> torch.nn.Module:
    """rewind's own model of the run's last checkpoint (adapters and all)."""
    from rewind.engine.model.checkpoint_model import load_model
    from rewind.stores.checkpoints import CheckpointStore

    records = read_seq_events(run)
    state = fold(e for _, e in records)
    ref = state.last_checkpoint
    return eval_mode(load_model(config_in_force(records), CheckpointStore(run), ref.checkpoint, ref.files, state.layout)[0])


def export_hf(run: Path, out: Path) -> str:
    code, stdout, err = run_cli("export", run, "--hf", out)
    assert code == 0, err
    return stdout


def transformers_model(directory: Path, architecture: str = "LlamaForCausalLM") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(model).__name__ == architecture and model.dtype == torch.float32
    return model


@contextlib.contextmanager
def transformers_log():
    """What transformers logs meanwhile (its logger does not propagate to the root, so caplog misses it)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def tokens(length: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (3, length), generator=torch.Generator().manual_seed(0))


def test_transformers_loads_the_export_with_the_runs_logits(swiglu_run, tmp_path):
    stdout = export_hf(swiglu_run, tmp_path / "hf")
    assert "(2 layers)" in stdout and "(transformers LlamaForCausalLM)" in stdout
    names = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"]  # bytes: no tokenizer file
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}  # noqa: SIM118 (safe_open is no dict)
    with torch.no_grad():
        ours, theirs = runs_model(swiglu_run)(tokens()), transformers_model(tmp_path / "hf")(tokens()).logits
    assert (ours - theirs).abs().max().item() <= 1e-5
    assert not list(tmp_path.glob(".hf.tmp-*"))  # the temporary directory became DIR


def test_the_export_and_the_to_file_start_a_run_bit_for_bit(swiglu_run, tmp_path):
    export_hf(swiglu_run, tmp_path / "hf")
    code, _, err = run_cli("export", swiglu_run, "--to", tmp_path / "model.safetensors")
    assert code == 0, err
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        metadata = f.metadata()
    assert metadata["rewind.format"] == "1"
    architecture = json.loads(metadata["rewind.architecture"])
    assert (architecture["num_layers"], architecture["mlp"], architecture["d_model"]) == (2, "swiglu", 32)
    assert json.loads(metadata["rewind.objective"])["kind"] == "clm"
    config = runs_config(swiglu_run)
    with torch.no_grad():
        want = runs_model(swiglu_run)(tokens())
        for source in (tmp_path / "hf", tmp_path / "model.safetensors"):
            loaded = load_pretrained(str(source), config)
            model = build_plain(config, None)
            apply_pretrained(model, loaded.tensors)
            assert torch.equal(eval_mode(model)(tokens()), want), source
            assert loaded.identity == load_pretrained(str(source), config).identity


def test_a_lora_trunk_run_exports_merged_with_the_adapted_logits(lora_run, tmp_path):
    stdout = export_hf(lora_run, tmp_path / "hf")
    assert "(2 layers, adapters merged)" in stdout
    own = runs_model(lora_run)
    assert any(".lora_B." in n and p.abs().sum() > 0 for n, p in own.named_parameters())  # trained adapters
    with torch.no_grad():
        ours, theirs = own(tokens()), transformers_model(tmp_path / "hf")(tokens()).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_an_export_never_ships_a_tokenizer_the_run_did_not_record(swiglu_run, tmp_path):
    """The run learned UTF-8 bytes: a tokenizer.json that appeared in RUN/data since is refused, not shipped.
    (A run with a tokenizer exports it: tests/docs/test_text_example.py loads it with AutoTokenizer.)"""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    run = tmp_path / "run"
    shutil.copytree(swiglu_run, run)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=40, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(["the cat sat on the mat"] * 4, trainer)
    (run / "data").mkdir(exist_ok=True)
    (run / "data" / "tokenizer.json").write_text(tokenizer.to_str())
    code, _, err = run_cli("export", run, "--hf", tmp_path / "hf")
    assert code == 1 and "not the tokenizer the run recorded" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "hf").exists()


def test_refusals_are_one_line_and_write_nothing(swiglu_run, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    code, _, err = run_cli("export", swiglu_run, "--to", tmp_path / "w.safetensors", "--hf", taken)
    assert code == 2 and "exists and is not empty; name a new or empty directory" in err
    assert err.count("\n") == 1 and not (tmp_path / "w.safetensors").exists()
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    code, _, err = run_cli("export", swiglu_run, "--hf", taken / "keep.txt")
    assert code == 2 and "exists and is not a directory" in err and err.count("\n") == 1
    export_hf(swiglu_run, tmp_path / "new" / "hf")  # missing parents are made
    code, _, err = run_cli("export", swiglu_run, "--hf", swiglu_run / "checkpoints" / "hf")
    assert code == 2 and "inside the run directory" in err and err.count("\n") == 1
    (tmp_path / "empty").mkdir()
    export_hf(swiglu_run, tmp_path / "empty")  # an empty DIR is taken
    assert (tmp_path / "empty" / "model.safetensors").is_file()


PROMPTS = ("The cat", "reverse abc=", "sort dcba=")


def test_a_gelu_run_is_arcee_with_the_runs_logits_and_greedy_text(straight, tmp_path):
    """The tiny example's model (RMSNorm, GELU MLP): transformers computes its logits, and greedy
    `generate(max_new_tokens=N)` gives `rewind sample`'s tokens, with no warning and nothing logged."""
    stdout = export_hf(straight, tmp_path / "hf")
    assert "(transformers ArceeForCausalLM)" in stdout
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["hidden_act"], config["model_type"], config["mlp_bias"]) == ("gelu", "arcee", False)
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {}  # no max_length
    model = transformers_model(tmp_path / "hf", "ArceeForCausalLM")
    with torch.no_grad():
        ours, theirs = runs_model(straight)(tokens(32)), model(tokens(32)).logits
    assert ours.abs().max() > 1.0 and (ours - theirs).abs().max().item() <= 1e-5
    block_size = runs_config(straight).architecture.block_size
    for prompt in PROMPTS:
        ids = list(prompt.encode())
        new = block_size - len(ids)  # transformers does not crop to the trained context: stay inside it
        code, out, err = run_cli("sample", straight, "--prompt", prompt, "--max-tokens", new, "--temperature", 0, "--json")
        assert code == 0, err
        with transformers_log() as logged, torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)
        assert [r.getMessage() for r in logged if r.levelno >= logging.WARNING] == []
        assert generated[0, len(ids) :].tolist() == json.loads(out)["tokens"], prompt


def test_generate_with_max_new_tokens_logged_a_warning_under_a_max_length(straight, tmp_path):
    """Why generation_config.json holds no max_length: with one, every generate(max_new_tokens=N) warns."""
    export_hf(straight, tmp_path / "hf")
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({"max_length": 32}))
    model = transformers_model(tmp_path / "hf", "ArceeForCausalLM")
    with transformers_log() as logged, torch.no_grad():
        model.generate(torch.tensor([[65, 66]]), max_new_tokens=2, do_sample=False)
    assert any("max_new_tokens" in r.getMessage() and r.levelno == logging.WARNING for r in logged)


def test_a_masked_objective_is_refused_in_one_line(tmp_path):
    config = write_config(tmp_path, "mlm", num_layers=1, stages={"tokens": "[64]", "datasets": '[[{ name = "grammar" }]]'}, extra='[objective]\nkind = "mlm"\n')
    code, _, err = run_cli("train", config, "--run-dir", tmp_path / "run", "--no-progress")
    assert code == 0, err
    code, _, err = run_cli("export", tmp_path / "run", "--to", tmp_path / "w.safetensors", "--hf", tmp_path / "hf")
    assert code == 2 and err.count("\n") == 1, err
    assert "no transformers model computes the run's model: objective.kind is 'mlm'" in err and "mask token" in err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "w.safetensors").exists()


def test_help_names_every_export():
    code, out, _ = run_cli("--help")
    assert code == 0
    listing = " ".join(out.split())
    line = listing[listing.index("export ") : listing.index(" sample ")]
    assert all(option in line for option in ("--to", "--hf", "--adapters", "tensorboard")), line
    code, out, _ = run_cli("export", "--help")
    assert code == 0 and all(option in out for option in ("--to", "--hf", "--adapters"))


@pytest.fixture(scope="module")
def posttrained(tmp_path_factory) -> Path:
    """The small post-training example (UTF-8 bytes, no <|endoftext|>) with 32 sft steps: enough for
    greedy text to end some responses with their newline."""
    run = tmp_path_factory.mktemp("export-posttrained") / "run"
    return train_small_posttrain(run, "--set", "stages[1].tokens=32768")


def test_a_post_trained_byte_model_exports_its_newline_as_the_end_token(posttrained, tmp_path):
    """A response ends with "\\n" where the tokenizer has no <|endoftext|> (docs/posttraining.md): that is
    the eos_token_id transformers' generate stops at, and its greedy text is `rewind sample`'s, which
    stops there too (a pretrained byte model's export has none: the gelu test above)."""
    export_hf(posttrained, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {"eos_token_id": 10}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"] == 10
    model = transformers_model(tmp_path / "hf", "ArceeForCausalLM")
    block_size = runs_config(posttrained).architecture.block_size
    ends = []
    for prompt in ("sort zyx=", "sort hello=", "sort dcba=", "sort bca="):
        ids = list(prompt.encode())
        new = block_size - len(ids)
        code, out, err = run_cli("sample", posttrained, "--prompt", prompt, "--max-tokens", new, "--temperature", 0, "--json")
        assert code == 0, err
        sampled = json.loads(out)
        assert sampled["end_token"] == 10
        with torch.no_grad():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False)[0, len(ids) :].tolist()
        if sampled["stopped"] == "eos":  # transformers keeps the end token, and stops after it
            ends.append(prompt)
            assert generated == [*sampled["tokens"], 10], prompt
        else:
            assert generated == sampled["tokens"] and 10 not in generated, prompt
    assert ends  # some greedy response ended with its newline, where generate stopped
