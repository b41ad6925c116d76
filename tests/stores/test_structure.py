"""The shape of stores/ and kernels/ (read from the source, as tests/docs/structure_figures.py reads it):
no import circle inside either package, no module over 400 lines, and no private name imported from
another module (a name shared between modules has a home of its own, and is public there)."""

from __future__ import annotations

import ast

from tests.docs.structure_figures import figures, sources

PACKAGES = ("stores", "kernels")


def test_no_import_circle_inside_stores_or_kernels():
    circles = [c for c in figures(None)["circles"] if c[0].split(".")[1] in PACKAGES]
    assert circles == []


def test_no_module_of_stores_or_kernels_is_over_400_lines():
    too_long = [m for m in figures(None)["modules_over_400_lines"] if m.split("/")[0] in PACKAGES]
    assert too_long == []


def private_imports(texts: dict[str, str]) -> list[str]:
    """'path: module.name' for each private name a module of stores/ or kernels/ imports from rewind."""
    found = []
    for path, text in texts.items():
        if path.split("/")[0] not in PACKAGES:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rewind."):
                found += [
                    f"{path}: {node.module}.{alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    return found


def test_no_module_of_stores_or_kernels_imports_a_private_name():
    assert private_imports(sources(None)) == []
