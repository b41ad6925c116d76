"""The shape of engine/ (read from the source, as tests/docs/structure_figures.py reads it): no import
circle inside the package (deferred imports count), and no private name imported from another module
(a name shared between modules has a home of its own, and is public there)."""

from __future__ import annotations

import ast

from tests.docs.structure_figures import figures, sources


def circles_inside(package: str) -> list[list[str]]:
    return [c for c in figures(None)["circles"] if c[0].split(".")[1] == package]


def private_imports(package: str) -> list[str]:
    """'path: module.name' for each private name a module of `package` imports from rewind."""
    found = []
    for path, text in sources(None).items():
        if path.split("/")[0] != package:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rewind."):
                found += [
                    f"{path}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    return found


def test_no_import_circle_inside_engine():
    assert circles_inside("engine") == []


def test_no_module_of_engine_imports_a_private_name():
    assert private_imports("engine") == []
