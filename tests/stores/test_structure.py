"""The shape of stores/ and kernels/ (read from the source by tests/docs/structure_figures.py): no import
circle inside either package, no module over 400 lines, and no private name imported from another module
(a name shared between modules has a home of its own, and is public there)."""

from __future__ import annotations

from tests.docs.structure_figures import circles_inside, modules_over_400_lines, private_imports, sources


def test_no_import_circle_inside_stores():
    assert circles_inside("stores") == []


def test_no_module_of_stores_is_over_400_lines():
    assert modules_over_400_lines("stores") == []


def test_no_module_of_stores_imports_a_private_name():
    assert private_imports(sources(None), "stores") == []


def test_no_import_circle_inside_kernels():
    assert circles_inside("kernels") == []


def test_no_module_of_kernels_is_over_400_lines():
    assert modules_over_400_lines("kernels") == []


def test_no_module_of_kernels_imports_a_private_name():
    assert private_imports(sources(None), "kernels") == []
