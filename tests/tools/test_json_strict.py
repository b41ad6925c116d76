"""Every command's `--json` output is strict JSON (issue 33, point 13): `rewind log --json` printed NaN,
which no JSON parser but Python's reads, even for a legitimate run with training.on_nonfinite = "skip".
The rule, one for every command (rewind.tools.jsonout): a figure that is NaN or infinite is null.

Each command with a --json option runs here on a run whose records hold NaN figures (a skipped run,
trained at an LR that overflows its weights) or infinite ones (that run with a few records forged),
and its output is parsed with NaN, Infinity and -Infinity refused. A command that gains --json
without a case here fails `test_every_command_with_json_is_covered`."""

from __future__ import annotations

import argparse
import ast
import json
import math
import shutil
from pathlib import Path

import msgspec
import pytest

from rewind.states.events import Evaluated, StepCommitted
from rewind.tools.cli import build_parser
from rewind.tools.jsonout import NON_FINITE_HELP, dumps, json_safe
from tests.conftest import EXAMPLES
from tests.engine.test_loop import run_cli
from tests.tools.rundir_forgery import rewrite_log
from tests.tools.test_rollouts_cmd import _grpo_run

TINY = EXAMPLES / "tiny.toml"
TOOLS = Path(__file__).resolve().parents[2] / "tools"
SMALL = ("--set", "training.tokens=[2560,1280,1280]", "--set", "logging.checkpoint_interval=4")


def strict(text: str):
    """`text` parsed as RFC 8259 JSON: NaN, Infinity and -Infinity are not JSON."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """skipped: a finished run whose steps after the first are NaN (skipped); forged: it with an infinite
    loss, KL and score; grpo: a short grpo run; prepared: a prepared data directory."""
    base = tmp_path_factory.mktemp("json")
    skipped = base / "skipped"
    sets = ("--set", "training.on_nonfinite=skip", "--set", "optimization.lr=1e30")
    code, _, err = run_cli("train", TINY, "--run-dir", skipped, "--no-progress", *SMALL, *sets)
    assert code == 1 and "19 of 20 updates (95%) were skipped" in err, err  # finished, its weights NaN
    forged = base / "forged"
    shutil.copytree(skipped, forged)

    def infinite(_seq, event):
        if isinstance(event, StepCommitted) and event.step == 1:
            return msgspec.structs.replace(event, loss=math.inf, kl=-math.inf, metrics={"margin": math.inf})
        if isinstance(event, Evaluated):
            return msgspec.structs.replace(event, scores={name: math.inf for name in event.scores})
        return event

    rewrite_log(forged, infinite)
    (base / "doc.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    code, _, err = run_cli("data", "prepare", base / "doc.txt", "--out", base / "prepared", "--no-progress")
    assert code == 0, err
    return {
        "skipped": skipped,
        "forged": forged,
        "grpo": Path(_grpo_run(base, "grpo")),
        "prepared": base / "prepared",
    }


# (command path, argv with {run} names, exit codes it may end with); several cases for a command are fine.
CASES = [
    (("log",), ["log", "{skipped}", "--json"], (0,)),
    (("log",), ["log", "{forged}", "--json"], (0,)),
    (("state",), ["state", "{forged}", "--json"], (0,)),
    (("timeline",), ["timeline", "{skipped}", "--json"], (0,)),
    (("timeline",), ["timeline", "{forged}", "--json"], (0,)),
    (("diff",), ["diff", "{skipped}", "{forged}", "--json"], (1,)),
    (("replay",), ["replay", "{forged}", "--to-step", "2", "--json", "--no-progress"], (1,)),
    (("eval",), ["eval", "{skipped}", "--dataset", "sort", "--json"], (0,)),
    (("sample",), ["sample", "{grpo}", "--prompt", "abc", "--json"], (0,)),
    (("rollouts",), ["rollouts", "{grpo}", "--json"], (0,)),
    (("schedule",), ["schedule", str(TINY), "--json"], (0,)),
    (("schedule",), ["schedule", str(TINY), "--json", "--at", "0,300"], (0,)),
    (("schedule",), ["schedule", str(TINY), "--json", "--check"], (0,)),
    (("data", "info"), ["data", "info", "{prepared}", "--json"], (0,)),
    (("bench",), ["bench", "schedule", "--quick", "--json"], (0,)),
]


@pytest.mark.parametrize(
    ("command", "argv", "codes"), CASES, ids=[f"{' '.join(c)}-{i}" for i, (c, _, _) in enumerate(CASES)]
)
def test_every_json_output_is_strict_json(runs, command, argv, codes):
    code, out, err = run_cli(*(a.format(**runs) for a in argv))
    assert code in codes, err
    strict(out)


def test_the_non_finite_figures_are_null_where_they_were(runs):
    code, out, _ = run_cli("log", runs["forged"], "--json", "--type", "StepCommitted,Evaluated")
    assert code == 0
    records = strict(out)
    first = next(r for r in records if r["type"] == "StepCommitted" and r["step"] == 1)
    assert (first["loss"], first["kl"], first["metrics"]) == (None, None, {"margin": None})
    skipped = [r for r in records if r["type"] == "StepCommitted" and r["skipped"]]
    assert skipped and all(r["loss"] is None for r in skipped)  # NaN, legitimately
    assert all(v is None for r in records if r["type"] == "Evaluated" for v in r["scores"].values())
    code, out, _ = run_cli("eval", runs["skipped"], "--dataset", "sort", "--json")
    assert strict(out)["loss"] is None


def test_the_helper_makes_every_depth_safe_and_says_so_in_help():
    value = {"a": [1.0, math.nan, (math.inf, {"b": -math.inf})], "c": 2, "d": "nan"}
    assert json_safe(value) == {"a": [1.0, None, [None, {"b": None}]], "c": 2, "d": "nan"}
    assert strict(dumps(value, indent=None)) == json_safe(value)
    # what `default` makes of an object is made safe too
    assert strict(dumps({"x": object()}, default=lambda _: [math.nan])) == {"x": [None]}


def _json_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    found = {path} if any("--json" in action.option_strings for action in parser._actions) else set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= _json_commands(sub, (*path, name))
    return found


def test_every_command_with_json_is_covered():
    assert _json_commands(build_parser()) == {command for command, _, _ in CASES}


def _json_helps(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], str]:
    helps = {}
    for action in parser._actions:
        if "--json" in action.option_strings:
            helps[path] = action.help or ""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                helps |= _json_helps(sub, (*path, name))
    return helps


def test_the_commands_whose_json_carries_run_figures_say_the_rule_in_their_help():
    helps = _json_helps(build_parser())
    figures = [("log",), ("state",), ("timeline",), ("diff",), ("replay",), ("eval",), ("bench",)]
    assert [c for c in figures if NON_FINITE_HELP not in helps[c]] == []


def test_every_command_prints_its_json_through_the_one_helper():
    """No command's own print_json or json_safe (state's had one): each imports rewind.tools.jsonout's."""
    own, elsewhere = [], []
    for path in sorted(TOOLS.rglob("*.py")):
        if path.name == "jsonout.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and node.name in ("print_json", "json_safe"):
                own.append(f"{path.name}: def {node.name}")
            if isinstance(node, ast.ImportFrom) and node.module != "rewind.tools.jsonout":
                named = {alias.name for alias in node.names} & {"print_json", "json_safe"}
                elsewhere += [f"{path.name}: {name} from {node.module}" for name in sorted(named)]
    assert own == [] and elsewhere == []
