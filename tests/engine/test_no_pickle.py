"""No pickle is loaded from a run directory: a run directory is data, and unpickling data runs code.

Statically: no module of the package calls a loader that unpickles (torch.load, pickle, numpy with
allow_pickle, torch.distributed.checkpoint's readers, torch.jit.load), nor imports dill, joblib or
cloudpickle: read from the syntax tree, so comments, docstrings and look-alike names
(`safetensors.torch.load`, `tl.load`) do not count, and aliases (`import torch as t`) do.

Dynamically: with every unpickling entry point trapped (recorded, then raising), runs are stopped,
resumed, replayed, forked, exported, evaluated, sampled and verified in-process through the CLI: the
tiny run, and a grown run (frozen trunk read from its activation cache, LoRA, an NF4 stack).
"""

from __future__ import annotations

import _pickle
import ast
import pickle
import traceback

import numpy as np
import pytest
import torch
import torch.serialization
from safetensors.torch import load_file

from rewind.engine.model import placement
from rewind.states.events import RunResumed
from rewind.states.fold import fold
from rewind.stores.checkpoints import CheckpointStore
from tests.conftest import EXAMPLES, REPO
from tests.engine.test_loop import assert_bitwise_equal, events_of, run_cli, train_args

PACKAGE_DIRS = ("engine", "states", "stores", "kernels", "tools")
# Calls that unpickle (or, for the last few, deserialise objects the same way), by qualified name.
UNPICKLING_CALLS = frozenset(
    {
        "pickle.load",
        "pickle.loads",
        "pickle.Unpickler",
        "_pickle.load",
        "_pickle.loads",
        "_pickle.Unpickler",
        "torch.load",
        "torch.serialization.load",
        "torch.jit.load",
        "torch.hub.load",
        "torch.hub.load_state_dict_from_url",
        "torch.distributed.checkpoint.load",
        "torch.distributed.checkpoint.load_state_dict",
        "torch.distributed.checkpoint.FileSystemReader",
        "torch.distributed.checkpoint.state_dict_loader.load",
        "torch.distributed.checkpoint.state_dict_loader.load_state_dict",
        "torch.distributed.checkpoint.filesystem.FileSystemReader",
        "torch.distributed.checkpoint.format_utils.dcp_to_torch_save",
        "pandas.read_pickle",
        "shelve.open",
        "marshal.load",
        "marshal.loads",
        "yaml.load",
        "yaml.load_all",
        "yaml.full_load",
        "yaml.unsafe_load",
    }
)
# numpy unpickles object arrays only when asked to.
ALLOW_PICKLE_CALLS = frozenset({"numpy.load", "numpy.lib.format.read_array"})
UNPICKLING_MODULES = frozenset({"dill", "joblib", "cloudpickle"})


@pytest.fixture(autouse=True)
def _adopted_device_restored(monkeypatch):
    """A resume sets the process's adopted device (placement.adopt_device); each test leaves it as found."""
    monkeypatch.setattr(placement, "_adopted_device", placement._adopted_device)


# --- (a) static -------------------------------------------------------------------------------------


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` of a Name/Attribute chain, else None (a call's result, a subscript, ...)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def unpickling_uses(source: str, filename: str = "<source>") -> list[str]:
    """'LINE: what' for every unpickling call or module import in `source`. Names are resolved through
    the module's imports (`import numpy as np`, `from torch import load as read`), wherever they are."""
    tree = ast.parse(source, filename)
    aliases: dict[str, str] = {}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in UNPICKLING_MODULES:
                    found.append((node.lineno, f"import {alias.name}"))
                if alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] in UNPICKLING_MODULES:
                found.append((node.lineno, f"from {node.module} import ..."))
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or (name := _dotted(node.func)) is None:
            continue
        head, _, rest = name.partition(".")
        qualified = ".".join(filter(None, [aliases.get(head, head), rest]))
        if qualified in UNPICKLING_CALLS:
            found.append((node.lineno, qualified))
        elif qualified in ALLOW_PICKLE_CALLS:
            for keyword in node.keywords:
                allowed = keyword.arg == "allow_pickle" or keyword.arg is None  # **kwargs could carry it
                if allowed and not (isinstance(keyword.value, ast.Constant) and keyword.value.value is False):
                    found.append((node.lineno, f"{qualified}(allow_pickle=...)"))
    return [f"{line}: {what}" for line, what in sorted(found)]


def test_the_checker_finds_unpickling_however_it_is_spelled_and_only_that():
    source = '''
import pickle as p, numpy as np, torch
import torch.distributed.checkpoint as dcp
from torch import load as read_tensors
from numpy import load
from joblib import Parallel
import dill
import safetensors.torch
import triton.language as tl
# torch.load(path) in a comment, and "pickle.loads" in a string, are not calls
def f(path, data, flag, options):
    safetensors.torch.load(data)
    tl.load(path)
    np.load(path)
    np.load(path, allow_pickle=False)
    torch.save({}, path)
    p.loads(data)
    read_tensors(path)
    torch.load(path, weights_only=True)
    load(path, allow_pickle=flag)
    np.load(path, **options)
    dcp.load({}, checkpoint_id=path)
    pickle.Unpickler(data).load()
'''
    assert unpickling_uses(source) == [
        "6: from joblib import ...",
        "7: import dill",
        "17: pickle.loads",
        "18: torch.load",
        "19: torch.load",
        "20: numpy.load(allow_pickle=...)",
        "21: numpy.load(allow_pickle=...)",
        "22: torch.distributed.checkpoint.load",
        "23: pickle.Unpickler",
    ]


def test_no_module_of_the_package_unpickles():
    files = sorted(path for folder in PACKAGE_DIRS for path in (REPO / folder).rglob("*.py"))
    assert len(files) > 100 and {p.parent.name for p in files} >= set(PACKAGE_DIRS)
    found = [
        f"{path.relative_to(REPO)}:{use}"
        for path in files
        for use in unpickling_uses(path.read_text(encoding="utf-8"), str(path))
    ]
    assert found == []


# --- (b) dynamic ------------------------------------------------------------------------------------


class PickleTouched(Exception):
    """An unpickling entry point was called while pickles were trapped."""


def install_traps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every unpickling entry point records its caller's stack and raises. The record is what the tests
    assert empty: a caller that swallowed the exception (and fell back to something) shows there too."""
    calls: list[str] = []

    def trap(name: str):
        def refuse(*args, **kwargs):
            calls.append(f"{name}\n{''.join(traceback.format_stack(limit=15))}")
            raise PickleTouched(name)

        return refuse

    class TrappedUnpickler(pickle.Unpickler):  # a class: modules imported later may subclass it
        def __init__(self, *args, **kwargs):
            trap("Unpickler")()

    for module in (pickle, _pickle):
        for name in ("load", "loads"):
            monkeypatch.setattr(module, name, trap(f"{module.__name__}.{name}"))
        monkeypatch.setattr(module, "Unpickler", TrappedUnpickler)
    monkeypatch.setattr(torch, "load", trap("torch.load"))
    monkeypatch.setattr(torch.serialization, "load", trap("torch.serialization.load"))
    monkeypatch.setattr(torch.jit, "load", trap("torch.jit.load"))
    real_np_load = np.load

    def np_load(*args, allow_pickle=False, **kwargs):
        if allow_pickle:
            trap("numpy.load(allow_pickle=True)")()
        return real_np_load(*args, allow_pickle=allow_pickle, **kwargs)

    monkeypatch.setattr(np, "load", np_load)
    return calls


@pytest.fixture
def trapped(monkeypatch) -> list[str]:
    return install_traps(monkeypatch)


def test_the_traps_spring():
    with pytest.MonkeyPatch.context() as patch:
        calls = install_traps(patch)
        payload = b"\x80\x04K\x01."  # pickle.dumps(1)
        for attempt in (
            lambda: pickle.loads(payload),
            lambda: _pickle.loads(payload),
            lambda: pickle.Unpickler(None),
            lambda: torch.load("x"),
            lambda: np.load("x", allow_pickle=True),
        ):
            with pytest.raises(PickleTouched):
                attempt()
        assert len(calls) == 5
    assert pickle.loads(payload) == 1  # restored


def cli_ok(*args: object, expect: int = 0) -> str:
    code, out, err = run_cli(*args)
    assert code == expect, f"{args[0]}: exit {code}: {err}"
    assert "Traceback" not in err
    return out


# 2 + 2 + 2 steps with the KL term on from stage 1; stopped after step 3 (a stop checkpoint).
SHORT = ("training.tokens=[512,512,512]", "logging.checkpoint_interval=2", "optimization.kl.betas=[0.0,0.2,0.2]")


def test_a_run_is_resumed_replayed_forked_exported_and_read_without_unpickling(trapped, tmp_path):
    run, fork = tmp_path / "run", tmp_path / "fork"
    cli_ok(*train_args(run, "--max-steps", "3", overrides=SHORT))
    cli_ok(*train_args(run, overrides=SHORT))  # resumed from the stop checkpoint
    events = events_of(run)
    assert [e.step for e in events if isinstance(e, RunResumed)] == [3]
    assert "replay: reproducible" in cli_ok("replay", run, "--no-progress")
    assert "replay: reproducible" in cli_ok("replay", run, "--from-checkpoint", "4", "--no-progress")
    cli_ok("export", run, "--to", tmp_path / "model.safetensors")
    final = fold(events).last_checkpoint
    assert final is not None and final.step == 6
    stored = CheckpointStore(str(run)).load(final.checkpoint, final.files)["model"]
    assert_bitwise_equal(stored, load_file(tmp_path / "model.safetensors"))
    cli_ok("export", "tensorboard", run)
    assert "validation rows" in cli_ok("eval", run, "--dataset", "reverse", "--samples", "8")
    cli_ok("sample", run, "--prompt", "abc", "--max-tokens", "4", "--at-step", "4")
    cli_ok("fork", run, fork, "--at-step", "4", "--set", "optimization.lr=1e-3", "--no-progress")
    assert fold(events_of(fork)).finished
    assert "verify: clean" in cli_ok("verify", "--data", run)
    for command in ("state", "log", "timeline"):
        cli_ok(command, run)
    cli_ok("diff", run, fork, expect=1)  # they diverge after the fork: exit 1, said plainly
    assert trapped == []


@pytest.mark.slow
def test_a_grown_run_with_a_cached_trunk_lora_and_nf4_resumes_without_unpickling(trapped, tmp_path):
    """examples/progressive.toml, 2 steps a stage: stage 1 trains on a frozen trunk read from the
    activation cache (stopped there, so the resume reads the cache), then LoRA, then an NF4 stack."""
    run = tmp_path / "run"
    args = train_args(run, overrides=("training.tokens=[512,512,512,512]", "logging.checkpoint_interval=2"))
    args[args.index(str(EXAMPLES / "tiny.toml"))] = str(EXAMPLES / "progressive.toml")
    cli_ok(*args, "--max-steps", "3")
    assert any((run / "cache").glob("trunk-*.zarr"))
    cli_ok(*args)
    events = events_of(run)
    assert [e.step for e in events if isinstance(e, RunResumed)] == [3]
    assert fold(events).finished and fold(events).num_growths == 3
    assert "replay: reproducible" in cli_ok("replay", run, "--from-checkpoint", "2", "--no-progress")
    cli_ok("export", run, "--to", tmp_path / "model.safetensors", "--hf", tmp_path / "hf", "--adapters", tmp_path / "adapters")
    assert "validation rows" in cli_ok("eval", run, "--dataset", "add", "--samples", "8")
    assert "verify: clean" in cli_ok("verify", run)
    assert trapped == []
