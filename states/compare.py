"""Comparing events field by field: the primitive behind `rewind diff` and `rewind replay`.

"Equal" means bit for bit by default: two floats are equal when their IEEE-754 doubles have the same
bits, so -0.0 differs from 0.0 and a NaN equals only the same NaN. That is the promise on CPU; with
`rtol > 0` (GPU runs, different kernels) floats are equal within a relative tolerance instead.
Integers, strings, lists and dicts are always compared exactly.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import msgspec

from rewind.states.events import Event


class FieldDifference(msgspec.Struct, frozen=True, kw_only=True):
    """The first place two events differ. `field` is a path: "loss", "rows[1]", "cursors.grammar",
    or "type" when the events are of different types (then a and b are the type names)."""

    field: str
    a: Any
    b: Any


def floats_equal(x: float, y: float, rtol: float = 0.0) -> bool:
    if rtol <= 0.0 or not (math.isfinite(x) and math.isfinite(y)):
        return struct.pack("<d", x) == struct.pack("<d", y)
    if x == y:  # also spares 0 * inf when rtol is infinite
        return True
    return abs(x - y) <= rtol * max(abs(x), abs(y))


def values_difference(path: str, a: Any, b: Any, rtol: float = 0.0) -> FieldDifference | None:
    """The first difference inside two plain values (as msgspec.to_builtins makes them)."""
    if isinstance(a, float) or isinstance(b, float):
        # An int where a float is expected is the same number (a hand-made event: loss=1); a bool is
        # not, on either side (True == 1.0 in Python).
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b)):
            return None if floats_equal(float(a), float(b), rtol) else FieldDifference(field=path, a=a, b=b)
        return FieldDifference(field=path, a=a, b=b)
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b, strict=False)):
            if (found := values_difference(f"{path}[{i}]", x, y, rtol)) is not None:
                return found
        return None if len(a) == len(b) else FieldDifference(field=f"len({path})", a=len(a), b=len(b))
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys(), key=str):
            if key not in a or key not in b:
                return FieldDifference(field=f"{path}.{key}", a=a.get(key), b=b.get(key))
            if (found := values_difference(f"{path}.{key}", a[key], b[key], rtol)) is not None:
                return found
        return None
    return None if type(a) is type(b) and a == b else FieldDifference(field=path, a=a, b=b)


def first_difference(
    a: Event, b: Event, *, rtol: float = 0.0, ignore: frozenset[str] = frozenset()
) -> FieldDifference | None:
    """None when the events are equal (up to rtol for floats); else the first differing field, in the
    struct's field order (step and tokens first). Fields named in `ignore` are skipped."""
    if type(a) is not type(b):
        return FieldDifference(field="type", a=type(a).__name__, b=type(b).__name__)
    for name in a.__struct_fields__:
        if name in ignore:
            continue
        found = values_difference(
            name, msgspec.to_builtins(getattr(a, name)), msgspec.to_builtins(getattr(b, name)), rtol
        )
        if found is not None:
            return found
    return None
