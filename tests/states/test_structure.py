"""The shape of states/ (read from the source, as tests/docs/structure_figures.py reads it): no import
circle inside it, no module over 400 lines, and no private name imported from another module (a name
shared between modules has a home of its own, and is public there)."""

from __future__ import annotations

import ast

from tests.docs.structure_figures import figures, sources


def test_no_import_circle_inside_states():
    circles = [c for c in figures(None)["circles"] if c[0].split(".")[1] == "states"]
    assert circles == []


def test_no_module_of_states_is_over_400_lines():
    too_long = [m for m in figures(None)["modules_over_400_lines"] if m.startswith("states/")]
    assert too_long == []


def private_imports(texts: dict[str, str]) -> list[str]:
    """'path: module.name' for each private name a module of states/ imports from rewind."""
    found = []
    for path, text in texts.items():
        if not path.startswith("states/"):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rewind."):
                found += [
                    f"{path}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    return found


def test_private_imports_are_found():
    texts = {
        "states/a.py": "from rewind.states.b import _hidden, shown\n",
        "engine/c.py": "from rewind.x import _y\n",
    }
    assert private_imports(texts) == ["states/a.py: rewind.states.b._hidden"]


def test_no_module_of_states_imports_a_private_name():
    assert private_imports(sources(None)) == []
