"""The shape of states/ (read from the source by tests/docs/structure_figures.py): no import circle
inside it, no module over 400 lines, and no private name imported from another module (a name shared
between modules has a home of its own, and is public there)."""

from __future__ import annotations

from tests.docs.structure_figures import circles_inside, modules_over_400_lines, private_imports, sources


def test_private_imports_are_found():
    texts = {
        "states/a.py": "from rewind.states.b import _hidden, shown\n",
        "engine/c.py": "from rewind.x import _y\n",
    }
    assert private_imports(texts, "states") == ["states/a.py: rewind.states.b._hidden"]


def test_no_import_circle_inside_states():
    assert circles_inside("states") == []


def test_no_module_of_states_is_over_400_lines():
    assert modules_over_400_lines("states") == []


def test_no_module_of_states_imports_a_private_name():
    assert private_imports(sources(None), "states") == []
