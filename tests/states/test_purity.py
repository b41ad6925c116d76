"""`states/` decides and nothing else: no torch, no I/O, no clocks, no randomness.

Enforced on the source (every import statement, nested ones included) and on a fresh interpreter.
`strategies.py` is the exception: a test helper that imports hypothesis, imported by nothing here.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

STATES = Path(__file__).resolve().parents[2] / "states"
EXEMPT = {"strategies.py"}
ALLOWED_STDLIB = {
    "__future__",
    "math",
    "bisect",
    "dataclasses",
    "typing",
    "collections",
    "collections.abc",
    "hashlib",
    "tomllib",
    "re",
    "json",
    "enum",
    "functools",
    "itertools",
    "struct",  # bit-exact float comparison (states/compare.py)
}
FORBIDDEN = {"time", "random", "os", "io", "pathlib", "datetime", "torch", "numpy"}
MODULES = sorted(p for p in STATES.glob("*.py") if p.name not in EXEMPT)


def imported_modules(path: Path) -> list[str]:
    """Absolute names of every module an import statement in `path` names (relative ones resolved)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # `from . import x` is rewind.states; `from .. import x` leaves it (not allowed)
                base = "rewind.states" if node.level == 1 else "." * node.level
                names.append(f"{base}.{node.module}" if node.module else base)
            else:
                names.append(node.module or "")
    return names


def allowed(name: str) -> bool:
    return (
        name in ALLOWED_STDLIB
        or name == "msgspec"
        or name.startswith("msgspec.")
        or name == "rewind.states"
        or name.startswith("rewind.states.")
    )


def test_the_scan_sees_the_modules_and_their_imports():
    assert {"config.py", "schedule.py", "plan.py", "fold.py", "check_schedule.py"} <= {p.name for p in MODULES}
    assert "rewind.states.schedule" in imported_modules(STATES / "plan.py")
    # And the scan would catch what the rule forbids (it is not vacuously passing).
    assert not allowed("time") and not allowed("rewind.engine.run.loop") and not allowed("msgspecx")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_states_modules_import_only_the_allow_list(path):
    names = imported_modules(path)
    assert [n for n in names if not allowed(n)] == []
    assert [n for n in names if n.split(".")[0] in FORBIDDEN] == []


def test_strategies_is_not_imported_by_the_package():
    assert "strategies" not in (STATES / "__init__.py").read_text(encoding="utf-8")
    for path in MODULES:
        assert not any(n.endswith("strategies") for n in imported_modules(path)), path.name


def test_importing_states_in_a_fresh_interpreter_loads_no_torch_numpy_or_hypothesis():
    modules = [f"rewind.states.{p.stem}" for p in MODULES if p.stem != "__init__"]
    code = (
        "import importlib, json, sys\n"
        "import rewind.states.plan, rewind.states.check_schedule\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(json.dumps(sorted(m for m in ('torch', 'numpy', 'hypothesis') if m in sys.modules)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(result.stdout) == []
