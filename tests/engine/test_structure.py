"""The shape of engine/ (read from the source by tests/docs/structure_figures.py): no import circle
inside it (deferred imports count), and no private name imported from another module (a name shared
between modules has a home of its own, and is public there)."""

from __future__ import annotations

from tests.docs.structure_figures import circles_inside, private_imports, sources


def test_no_import_circle_inside_engine():
    assert circles_inside("engine") == []


def test_no_module_of_engine_imports_a_private_name():
    assert private_imports(sources(None), "engine") == []
