"""`rewind export RUN --hf HF --adapters DIR`: the LoRA adapters in peft's layout, for the transformers
model `--hf` writes, checked end to end on the progressive example (shortened: tests/tools/progressive_run.py).

Its final model is a GELU model (ArceeForCausalLM) of 4 stacks, an NF4 trunk of three stacks training
through adapters of ranks 8, 4 and 2 under a float stack. `PeftModel.from_pretrained(AutoModelForCausalLM
.from_pretrained(HF), DIR)` computes the run's logits and greedy `generate` gives `rewind sample`'s tokens,
as does `--hf` alone (adapters merged). What each export holds of the NF4 stacks is checked tensor by
tensor. Refusals (no adapters, `--adapters` without `--hf`, DIR an existing file or inside the run) exit
with one line and write nothing.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import logging
import re
import runpy
import shlex
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rewind.states.fold import fold
from rewind.states.history import config_in_force
from rewind.stores.runs import read_seq_events
from rewind.stores.trunks import checkpoint_weights
from tests.conftest import EXAMPLES, REPO
from tests.engine.test_loop import run_cli
from tests.tools.progressive_run import progressive_run
from tests.tools.rundir_forgery import tree_state
from tests.tools.test_export_hf import transformers_log

pytest.importorskip("peft")
pytest.importorskip("transformers")

# peft 0.21's PeftModel reads a property transformers 5 deprecated: not ours to fix, and harmless.
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

# rewind's adapted layer -> ArceeForCausalLM's projections (a fused qkv is three).
ARCEE_PROJECTIONS = {
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.proj": ("self_attn.o_proj",),
    "mlp.fc": ("mlp.up_proj",),
    "mlp.proj": ("mlp.down_proj",),
}
PROMPTS = ("add 12+34=", "rev abcd=", "sort dcba=")


@pytest.fixture(scope="module")
def progressive(tmp_path_factory) -> Path:
    return progressive_run(tmp_path_factory)


@pytest.fixture(scope="module")
def exported(progressive, tmp_path_factory) -> tuple[Path, str]:
    """`--to`, `--hf` and `--adapters` of the run together, and what the command printed."""
    out = tmp_path_factory.mktemp("exported")
    code, stdout, err = run_cli(
        "export", progressive, "--to", out / "w.safetensors", "--hf", out / "hf", "--adapters", out / "adapters"
    )
    assert code == 0, err
    return out, stdout


def final_layout(run: Path):
    return fold(e for _, e in read_seq_events(run)).layout


def expected_modules(run: Path) -> dict[str, tuple[int, float]]:
    """{Arcee module: (rank, alpha)} of every adapted projection of the run's final model."""
    layout = final_layout(run)
    targets = config_in_force(read_seq_events(run)).lora.targets
    blocks = [(spec, j) for spec in layout.stacks for j in range(spec.num_blocks)]
    return {
        f"model.layers.{k}.{projection}": (spec.adapter_rank, spec.adapter_alpha)
        for k, (spec, _) in enumerate(blocks)
        if spec.adapter_rank > 0
        for target in targets
        for projection in ARCEE_PROJECTIONS[target]
    }


def runs_model(run: Path) -> torch.nn.Module:
    """rewind's own model of the run's last checkpoint (NF4 trunk, adapters and all)."""
    from rewind.engine.model.checkpoint_model import load_model
    from rewind.engine.model.layout import eval_mode
    from rewind.stores.checkpoints import CheckpointStore

    records = read_seq_events(run)
    state = fold(e for _, e in records)
    ref = state.last_checkpoint
    model = load_model(config_in_force(records), CheckpointStore(run), ref.checkpoint, ref.files, state.layout)[0]
    return eval_mode(model)


def peft_model(hf: Path, adapters: Path) -> torch.nn.Module:
    """The public route, and nothing else: transformers loads HF, peft loads the adapters onto it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf), adapters).eval()


def rewind_greedy(run: Path, prompt: str, new: int) -> list[int]:
    code, out, err = run_cli("sample", run, "--prompt", prompt, "--max-tokens", new, "--temperature", 0, "--json")
    assert code == 0, err
    return json.loads(out)["tokens"]


def assert_computes_the_run(model: torch.nn.Module, run: Path) -> None:
    """The run's logits to float32 rounding, and `rewind sample`'s greedy tokens from `generate`, which
    logs no warning."""
    tokens = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = runs_model(run)(tokens), model(tokens).logits
    assert want.abs().max() > 1.0 and (want - got).abs().max().item() <= 1e-4
    continuations = []
    for prompt in PROMPTS:
        ids = list(prompt.encode())
        new = 32 - len(ids)  # the trained context: transformers does not crop, rewind sample does
        with transformers_log() as logged, torch.no_grad():
            generated = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=new, do_sample=False)
        assert [r.getMessage() for r in logged if r.levelno >= logging.WARNING] == []
        continuations.append(generated[0, len(ids) :].tolist())
        assert continuations[-1] == rewind_greedy(run, prompt, new), prompt
    assert len({token for c in continuations for token in c}) > 2  # text, not one token repeated


def test_peft_loads_the_adapters_onto_the_hf_base_with_the_runs_logits_and_greedy_text(progressive, exported):
    from peft.tuners.lora import LoraLayer

    out, stdout = exported
    assert "the base of --adapters: adapters not merged" in stdout
    assert "(peft layout, for the ArceeForCausalLM of --hf)" in stdout
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    model = peft_model(out / "hf", out / "adapters")
    assert type(model).__name__ == "PeftModelForCausalLM"
    assert type(model.get_base_model()).__name__ == "ArceeForCausalLM"
    layers = {
        name.removeprefix("base_model.model."): module
        for name, module in model.named_modules()
        if isinstance(module, LoraLayer)
    }
    modules = expected_modules(progressive)
    assert set(layers) == set(modules) and {r for r, _ in modules.values()} == {8, 4, 2}
    for name, (rank, alpha) in modules.items():  # rank_pattern and alpha_pattern reached every layer
        assert layers[name].r["default"] == rank and layers[name].scaling["default"] == alpha / rank, name
    lora_b = [p for n, p in model.named_parameters() if ".lora_B." in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # trained: the adapters change the outputs
    assert_computes_the_run(model, progressive)
    # adapter_config.json names HF as the base: peft's AutoPeftModelForCausalLM loads both from DIR alone.
    from peft import AutoPeftModelForCausalLM

    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        by_config = AutoPeftModelForCausalLM.from_pretrained(out / "adapters").eval()(tokens).logits
        assert torch.equal(by_config, model(tokens).logits)


def test_hf_alone_merges_the_adapters_and_computes_the_same(progressive, tmp_path):
    from transformers import AutoModelForCausalLM

    code, stdout, err = run_cli("export", progressive, "--hf", tmp_path / "hf")
    assert code == 0, err
    assert "adapters merged" in stdout
    assert_computes_the_run(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval(), progressive)


def test_what_each_export_holds_of_an_nf4_stack(progressive, exported, tmp_path):
    """`--to`: the float weights the run keeps (and quantises on load). `--hf` with `--adapters`: those
    weights quantised and dequantised, what the run's NF4 layers compute with. `--hf` alone: that plus
    the merged adapters. `--adapters`: the checkpoint's adapters, a fused layer's split."""
    out, _ = exported
    state = fold(e for _, e in read_seq_events(progressive))
    assert [s.base for s in final_layout(progressive).stacks] == ["nf4", "nf4", "nf4", "trainable"]
    ref = state.last_checkpoint
    checkpoint = checkpoint_weights(str(progressive), ref.checkpoint, ref.files)
    bottom = f"stacks.{final_layout(progressive).stacks[0].stack}.blocks.0.attn"
    qkv = torch.cat([load_file(out / "hf" / "model.safetensors")[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])

    to_file = load_file(out / "w.safetensors")
    assert to_file.keys() == checkpoint["model"].keys()
    assert all(torch.equal(to_file[k], checkpoint["model"][k]) for k in to_file)
    layer = runs_model(progressive).get_submodule(f"{bottom}.qkv").base_layer
    assert type(layer).__name__ == "Linear4bit" and layer.training  # F.linear with the dequantised weight
    with torch.no_grad():
        used = layer(torch.eye(qkv.shape[1])).T
    assert torch.equal(qkv, used) and not torch.equal(qkv, to_file[f"{bottom}.qkv.weight"])

    peft = load_file(out / "adapters" / "adapter_model.safetensors")
    a, b = (checkpoint["adapters"][f"{bottom}.qkv.lora_{x}.weight"] for x in "AB")
    for p in "qkv":
        assert torch.equal(peft[f"base_model.model.model.layers.0.self_attn.{p}_proj.lora_A.weight"], a)
    split_b = [peft[f"base_model.model.model.layers.0.self_attn.{p}_proj.lora_B.weight"] for p in "qkv"]
    assert torch.equal(torch.cat(split_b), b)

    code, _, err = run_cli("export", progressive, "--hf", tmp_path / "merged")
    assert code == 0, err
    merged = torch.cat([load_file(tmp_path / "merged" / "model.safetensors")[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    spec = final_layout(progressive).stacks[0]
    torch.testing.assert_close(merged, used + spec.adapter_alpha / spec.adapter_rank * (b @ a), rtol=0, atol=1e-6)
    assert (merged - used).abs().max() > 1e-4


def test_the_adapter_file_is_plain_safetensors_with_only_peft_lora_keys(progressive, exported):
    out, _ = exported
    data = (out / "adapters" / "adapter_model.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    assert header.pop("__metadata__") == {"format": "pt"}
    modules = expected_modules(progressive)
    assert set(header) == {f"base_model.model.{m}.lora_{ab}.weight" for m in modules for ab in "AB"}
    # No pickle anywhere: a JSON header, then raw little-endian float32 buffers that tile the rest.
    assert all(entry["dtype"] == "F32" for entry in header.values())
    spans = sorted(tuple(entry["data_offsets"]) for entry in header.values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    assert 8 + length + spans[-1][1] == len(data)
    for name, entry in header.items():
        rank, _ = modules[name.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]]
        assert rank in entry["shape"], name
    config = json.loads((out / "adapters" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["target_modules"] == sorted(modules)
    assert config["base_model_name_or_path"] == str((out / "hf").absolute())
    assert config["lora_dropout"] == 0.0 and config["bias"] == "none" and not config["use_rslora"]
    with safe_open(out / "hf" / "model.safetensors", "pt") as f:
        assert not any(".lora_" in k for k in f.keys())  # noqa: SIM118 (safe_open is no dict)


def test_a_checkpoint_without_adapters_exits_1_and_writes_nothing(progressive, tmp_path):
    # The log cut just after the growth onto the LoRA trunk (a crash before the reference checkpoint that
    # follows it): the log's layout has adapters, its last checkpoint (the boundary before) holds none.
    from rewind.states.events import StackAppended
    from rewind.stores.eventlog import EventLog

    crashed = tmp_path / "crashed"
    shutil.copytree(progressive, crashed)
    records = read_seq_events(crashed)
    grown = next(
        i
        for i, (_, e) in enumerate(records)
        if isinstance(e, StackAppended) and any(s.adapter_rank for s in fold(x for _, x in records[: i + 1]).layout.stacks)
    )
    shutil.rmtree(crashed / "events")
    shutil.rmtree(crashed / "snapshots", ignore_errors=True)
    with EventLog.open(crashed, "w") as log:
        for _, event in records[: grown + 1]:
            log.append(event)
        log.commit()
    state = fold(e for _, e in read_seq_events(crashed))
    assert any(s.adapter_rank for s in state.layout.stacks) and state.last_checkpoint is not None
    before = tree_state(tmp_path)
    code, stdout, err = run_cli("export", crashed, "--hf", tmp_path / "hf", "--adapters", tmp_path / "adapters")
    assert code == 1
    assert stdout == "" and err.count("\n") == 1 and "has no adapters" in err, err
    assert tree_state(tmp_path) == before


def test_adapters_without_their_base_or_onto_an_existing_file_exit_2_and_write_nothing(progressive, tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_bytes(b"not yours")
    before = tree_state(tmp_path)
    attempts = [
        ("--adapters", tmp_path / "adapters"),  # no --hf: nothing to name the adapters for
        ("--hf", tmp_path / "hf", "--adapters", tmp_path / "hf"),  # transformers would load them with the model
        *(("--hf", tmp_path / "hf", "--adapters", t) for t in (blocker, blocker / "inside", progressive / "checkpoints" / "adapters")),
    ]
    for options in attempts:
        run_before = tree_state(progressive)
        code, stdout, err = run_cli("export", progressive, *options)
        assert code == 2, (options, err)
        assert stdout == "" and err.count("\n") == 1 and err.startswith("rewind: --adapters"), err
        assert tree_state(tmp_path) == before and tree_state(progressive) == run_before
    assert blocker.read_bytes() == b"not yours"


def test_the_guides_peft_route_continues_as_rewind_sample(progressive, tmp_path, monkeypatch):
    """docs/own_text.md's three commands, as written, on the shortened run: the export, examples/load_hf.py
    (run as a script: transformers and peft only) and `rewind sample` print the same text."""
    page = (REPO / "docs" / "own_text.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", page, re.S) if "examples/load_hf.py runs/progressive-hf" in b)
    export, load, sample = (shlex.split(line.split("  #")[0]) for line in block.strip().splitlines())
    assert export[0] == sample[0] == ".venv/bin/rewind" and load[:2] == [".venv/bin/python", "examples/load_hf.py"]
    shutil.copytree(progressive, tmp_path / "runs" / "progressive")
    (tmp_path / "examples").symlink_to(EXAMPLES)
    monkeypatch.chdir(tmp_path)  # the page's relative paths
    code, _, err = run_cli(*export[1:])
    assert code == 0, err
    code, sampled, err = run_cli(*sample[1:])
    assert code == 0, err
    monkeypatch.setattr(sys, "argv", load[1:])
    loaded = io.StringIO()
    with contextlib.redirect_stdout(loaded):
        runpy.run_path(load[1], run_name="__main__")
    assert loaded.getvalue() == sampled
