"""`rewind export RUN --adapters DIR`: the LoRA adapters in peft's layout, checked end to end.

A tiny run grows at its second stage: stack 0 becomes a LoRA trunk (trunk rank 4) under a new stack
(fp32, or nf4 with its own rank-2 adapters). Its adapters, exported, loaded with
`peft.PeftModel.from_pretrained` onto the base model `export --to` writes (built from the layout in
that file's metadata), compute the run's own logits bit for bit. Refusals (no adapters, DIR an existing
file or inside the run) exit with one line and write nothing.
"""

from __future__ import annotations

import itertools
import json
import shutil
import struct
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rewind.states.fold import fold
from rewind.states.history import config_in_force
from rewind.states.state import ModelLayout
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import run_cli
from tests.tools.rundir_forgery import tree_state

TARGETS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
# Two stages of 2 steps (4 rows of 32 tokens), one block per stack: a few seconds on one thread.
CONFIG = """
[run]
name = "export-adapters"
seed = 5

[architecture]
block_size = 32
vocab_size = 256
num_layers = 1
num_heads = 2
d_model = 32

[training]
batch_size = 4
tokens = [256, 256]
datasets = [[{{ name = "grammar" }}], [{{ name = "reverse" }}]]
validation_steps = 1

[optimization]
lr = 3e-3
schedule = "constant"

[logging]
report_interval = 1000
checkpoint_interval = 1000

[lora]
trunk_rank = 4
rank = 2
alpha_per_rank = 1.5

[[growth]]
at_stage = 1
num_blocks = 1
trunk = "lora"
precision = "{precision}"
"""


def train(base: Path, precision: str) -> Path:
    config, run = base / f"{precision}.toml", base / f"run-{precision}"
    config.write_text(CONFIG.format(precision=precision))
    code, _, err = run_cli("train", config, "--run-dir", run, "--no-progress")
    assert code == 0, err
    return run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """Stack 0 a LoRA trunk (rank 4, alpha 6) under a new fp32 stack 1."""
    return train(tmp_path_factory.mktemp("export-adapters"), "fp32")


@pytest.fixture(scope="module")
def nf4_run(tmp_path_factory) -> Path:
    """As lora_run, but stack 1 is NF4 and trains through its own adapters (rank 2, alpha 3)."""
    return train(tmp_path_factory.mktemp("export-adapters"), "nf4")


def export(run: Path, out: Path) -> tuple[Path, Path]:
    weights, adapters = out / "base.safetensors", out / "adapters"
    code, stdout, err = run_cli("export", run, "--to", weights, "--adapters", adapters)
    assert code == 0, err
    assert "(peft layout)" in stdout
    return weights, adapters


def peft_model(weights: Path, adapters: Path) -> torch.nn.Module:
    """The exported base (the layout from its metadata; NF4 stacks quantised as the run did) with the
    exported adapters loaded by peft."""
    from peft import PeftModel

    from rewind.engine.layout import build_plain, eval_mode, quantise_stack
    from rewind.engine.snapshot import load_model_tensors

    with safe_open(weights, "pt") as f:
        metadata = f.metadata()
    layout = msgspec.json.decode(metadata["layout"], type=ModelLayout)
    records = read_seq_events(metadata["run"])
    base = build_plain(config_in_force(records), layout)
    load_model_tensors(base, load_file(weights))
    for spec in layout.stacks:
        if spec.base == "nf4":
            quantise_stack(base.stack(spec.stack))
            base.is_loaded_in_4bit = True  # peft's 4-bit LoRA layer for Linear4bit bases
    return eval_mode(PeftModel.from_pretrained(base, adapters))


def runs_model(run: Path) -> torch.nn.Module:
    """rewind's own model of the run's last checkpoint."""
    from rewind.engine.checkpointing import load_model
    from rewind.engine.layout import eval_mode
    from rewind.stores.checkpoints import CheckpointStore

    records = read_seq_events(run)
    state = fold(e for _, e in records)
    ref = state.last_checkpoint
    model = load_model(
        config_in_force(records), CheckpointStore(run), ref.checkpoint, ref.files, state.layout
    )[0]
    return eval_mode(model)


def adapted_modules(run: Path) -> dict[str, tuple[int, float]]:
    """{module: (rank, alpha)} of every adapted linear layer of the run's final layout."""
    layout = fold(e for _, e in read_seq_events(run)).layout
    return {
        f"stacks.{s.stack}.blocks.{b}.{t}": (s.adapter_rank, s.adapter_alpha)
        for s in layout.stacks
        if s.adapter_rank > 0
        for b in range(s.num_blocks)
        for t in TARGETS
    }


@pytest.mark.parametrize("run_fixture", ["lora_run", "nf4_run"])
def test_peft_loads_the_exported_adapters_onto_the_exported_base_to_the_runs_logits_bitwise(
    run_fixture, request, tmp_path
):
    from peft.tuners.lora import LoraLayer

    run = request.getfixturevalue(run_fixture)
    weights, adapters = export(run, tmp_path)
    assert sorted(p.name for p in adapters.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    exported, own = peft_model(weights, adapters), runs_model(run)
    peft_layers = {
        name.removeprefix("base_model.model."): module
        for name, module in exported.named_modules()
        if isinstance(module, LoraLayer)
    }
    modules = adapted_modules(run)
    assert set(peft_layers) == set(modules)
    for name, (rank, alpha) in modules.items():  # rank_pattern and alpha_pattern reached every layer
        assert peft_layers[name].r["default"] == rank, name
        assert peft_layers[name].scaling["default"] == alpha / rank, name
    assert any(r != 4 for r, _ in modules.values()) == (run_fixture == "nf4_run")
    lora_b = [p for n, p in exported.named_parameters() if ".lora_B." in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # trained: the adapters change the outputs
    tokens = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = own(tokens), exported(tokens)
    assert torch.equal(want, got)


def test_the_adapter_file_is_plain_safetensors_with_only_peft_lora_keys(lora_run, tmp_path):
    _, adapters = export(lora_run, tmp_path)
    data = (adapters / "adapter_model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    assert header.pop("__metadata__") == {"format": "pt"}
    modules = adapted_modules(lora_run)
    assert set(header) == {f"base_model.model.{m}.lora_{ab}.weight" for m in modules for ab in "AB"}
    # No pickle anywhere: a JSON header, then raw little-endian float32 buffers that tile the rest.
    assert all(entry["dtype"] == "F32" for entry in header.values())
    spans = sorted(tuple(entry["data_offsets"]) for entry in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert 8 + length + spans[-1][1] == len(data)
    for name, entry in header.items():
        module = name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        rank, _ = modules[module]
        assert rank in entry["shape"], name
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    assert config["target_modules"] == sorted(modules)
    assert config["lora_dropout"] == 0.0 and config["bias"] == "none" and not config["use_rslora"]


def test_a_run_without_adapters_exits_1_and_writes_nothing(lora_run, tmp_path):
    # The log cut just after the growth's first step (a crash before the next checkpoint): the log's
    # layout has adapters, its last checkpoint (the stage-0 boundary) holds none.
    from rewind.states.events import StepCommitted
    from rewind.stores.eventlog import EventLog

    crashed = tmp_path / "crashed"
    shutil.copytree(lora_run, crashed)
    records = read_seq_events(crashed)
    grown = next(i for i, (_, e) in enumerate(records) if type(e).__name__ == "StackAppended")
    cut = next(i for i in range(grown, len(records)) if isinstance(records[i][1], StepCommitted))
    shutil.rmtree(crashed / "events")
    shutil.rmtree(crashed / "snapshots", ignore_errors=True)
    with EventLog.open(crashed, "w") as log:
        for _, event in records[: cut + 1]:
            log.append(event)
        log.commit()
    state = fold(e for _, e in read_seq_events(crashed))
    assert any(s.adapter_rank for s in state.layout.stacks) and state.last_checkpoint is not None
    before = tree_state(tmp_path)
    out = tmp_path / "adapters"
    code, stdout, err = run_cli("export", crashed, "--adapters", out)
    assert code == 1
    assert stdout == "" and err.count("\n") == 1 and "has no adapters" in err, err
    assert tree_state(tmp_path) == before


def test_adapters_onto_an_existing_file_exit_2_and_overwrite_nothing(lora_run, tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_bytes(b"not yours")
    before = tree_state(tmp_path)
    for target in (blocker, blocker / "inside", lora_run / "checkpoints" / "adapters"):
        run_before = tree_state(lora_run)
        code, stdout, err = run_cli("export", lora_run, "--adapters", target)
        assert code == 2, (target, err)
        assert stdout == "" and err.count("\n") == 1 and err.startswith("rewind: --adapters"), err
        assert tree_state(tmp_path) == before and tree_state(lora_run) == run_before
    assert blocker.read_bytes() == b"not yours"
