"""The shape of engine/ (read from the source by tests/docs/structure_figures.py): no import circle
inside it (deferred imports count), and no private name imported from another module (a name shared
between modules has a home of its own, and is public there)."""

from __future__ import annotations

import ast
import re

from tests.conftest import REPO
from tests.docs.structure_figures import circles_inside, module_of, private_imports, sources


def test_no_import_circle_inside_engine():
    assert circles_inside("engine") == []


def test_no_module_of_engine_imports_a_private_name():
    assert private_imports(sources(None), "engine") == []


# engine/'s rooms, lowest first: a room imports only rooms before it (run and posttrain, the two on top,
# not each other: the loop reaches a strategy's modules only through rewind.engine.step.kinds, by name).
ROOMS = ("model", "data", "step", "posttrain", "run")
ON_TOP = {"posttrain", "run"}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 else ""


def _runtime_imports(tree: ast.Module) -> set[str]:
    """The rewind modules a module imports when it runs (an import under `if TYPE_CHECKING:` names a type
    for the annotations alone, never loaded)."""
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING"
        for branch in node.body
        for inner in ast.walk(branch)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def room_arrows() -> set[tuple[str, str]]:
    texts = sources(None)
    known = {module_of(path) for path in texts if path.startswith("engine/")}
    arrows = set()
    for path, text in texts.items():
        if not path.startswith("engine/"):
            continue
        here = _room(module_of(path))
        for target in _runtime_imports(ast.parse(text)) & known:
            there = _room(target)
            if here and there and here != there:
                arrows.add((here, there))
    return arrows


def test_engine_is_rooms_that_import_only_rooms_below_them():
    assert {p.name for p in (REPO / "engine").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(ROOMS)
    upward = sorted(
        (a, b) for a, b in room_arrows() if ROOMS.index(b) > ROOMS.index(a) or {a, b} == ON_TOP
    )
    assert upward == []
    assert ("run", "step") in room_arrows()  # (the walk sees arrows at all)


# What compares a stage's strategy by its name; only the stage record's own form may (its tag, and
# "pretrain" as the default a record left out): rewind.states.stages, stageform, config_identity.
_NAME_TEST = re.compile(
    r"""\.strategy\s*(==|!=|\bin\b|\bnot\s+in\b)|strategy["']\s*[\],)]?\s*(==|!=)|"""
    r"""(==|!=)\s*["'](pretrain|sft|dpo|grpo|distill)["']\s*(#.*)?$.*strategy"""
)
_RECORD_FORM = {"states/stages.py", "states/stageform.py", "states/config_identity.py"}


def test_nothing_outside_the_stage_record_compares_strategy_names():
    found = [
        f"{path}:{number}: {line.strip()}"
        for path, text in sources(None).items()
        if path not in _RECORD_FORM
        for number, line in enumerate(text.splitlines(), start=1)
        if _NAME_TEST.search(line) and not line.lstrip().startswith("#")
    ]
    assert found == []
    assert _NAME_TEST.search('if stage.strategy == "grpo":')  # (the pattern finds what it looks for)
    assert _NAME_TEST.search('if raw.get("strategy") == "dpo":')
