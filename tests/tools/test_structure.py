"""The shape of tools/ (read from the source by tests/docs/structure_figures.py): no import circle
inside it (deferred imports count), and no private name imported from another module."""

from __future__ import annotations

from tests.docs.structure_figures import circles_inside, private_imports, sources


def test_no_import_circle_inside_tools():
    assert circles_inside("tools") == []


def test_no_module_of_tools_imports_a_private_name():
    assert private_imports(sources(None), "tools") == []
