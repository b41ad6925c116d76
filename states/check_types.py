"""A config's types and shapes: raw decoded TOML walked against a msgspec type, every type problem
collected with its path; and the numbers anywhere in a config that nothing after the check could hold
(NaN and infinities, integers past 64 bits).

msgspec's own `convert` stops at the first error; researchers fixing a config want the whole list.
`without` drops the mistyped fields so the cross-field rules can still run on what is left
(`rewind.states.config_reading`). Leaves are checked with `msgspec.convert` itself, so the accepted
values are exactly msgspec's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import msgspec
from msgspec import inspect as mi

from rewind.states.overrides import deep_copy, parse_path

# The log is msgpack, whose integers are 64-bit: a config value beyond them cannot be recorded, and torch's
# integers are int64. run.seed has a rule of its own (unsigned, below 2**64).
INT64_RANGE = (-(1 << 63), 1 << 63)
OWN_INT_RULES = frozenset({"run.seed"})


def collect_type_problems(raw: Any, type_: Any, path: str = "") -> list[str]:
    return _walk(raw, mi.type_info(type_), path)


def field_of(problem: str) -> str:
    """The key a sanitiser can drop: 'training.evaluations[1]: ...' -> 'training.evaluations', and a
    stage's own field, 'stages[1].datasets[0].rate: ...' -> 'stages[1].datasets'."""
    return re.match(r"stages\[\d+\]\.\w+|[^\[:]*", problem).group(0)  # type: ignore[union-attr]


def without(raw: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    pruned = deep_copy(raw)
    for path in paths:
        try:
            *parents, last = parse_path(path)
        except ValueError:  # a key no override could name (a data set's name with a space): dotted parts
            *parents, last = path.split(".")
        node: Any = pruned
        for part in parents:
            if isinstance(node, dict):
                node = node.get(part)
            elif isinstance(node, list) and isinstance(part, int) and part < len(node):
                node = node[part]
            else:
                node = None
        if isinstance(node, dict):
            node.pop(last, None)
    return pruned


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) for every scalar anywhere in a config, struct or raw TOML, in field order."""
    if isinstance(value, msgspec.Struct):
        for f in msgspec.structs.fields(value):
            yield from leaves(getattr(value, f.name), _join(path, f.encode_name))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from leaves(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, _join(path, str(key)))
    else:
        yield path, value


def non_finite_floats(value: Any) -> list[str]:
    """'path: must be a finite number, got nan' for every NaN or infinity anywhere in the config: a
    comparison with NaN is always false, so no range rule would ever catch one."""
    return [
        f"{path}: must be a finite number, got {leaf}"
        for path, leaf in leaves(value)
        if isinstance(leaf, float) and not math.isfinite(leaf)
    ]


def unrecordable_ints(value: Any) -> list[str]:
    """'path: must fit a signed 64-bit integer, ...' for every integer anywhere in the config that the
    log (msgpack) or torch could not hold: nothing after the check could record or compute with it."""
    return [
        f"{path}: must fit a signed 64-bit integer (the log's integers), got {show_int(leaf)}"
        for path, leaf in leaves(value)
        if isinstance(leaf, int)
        and not isinstance(leaf, bool)
        and path not in OWN_INT_RULES
        and not INT64_RANGE[0] <= leaf < INT64_RANGE[1]
    ]


def show_int(value: int) -> str:
    """An integer as a message shows it: whole when short, else its size (never thousands of digits)."""
    if abs(value) < 10**30:
        return str(value)
    return f"a {'negative ' if value < 0 else ''}number of about {int(math.log10(abs(value))) + 1} digits"


def _walk(value: Any, info: mi.Type, path: str) -> list[str]:
    if isinstance(info, mi.StructType):
        return _walk_struct(value, info, path)
    if isinstance(info, mi.ListType):
        if not isinstance(value, list):
            return [f"{_label(path)}: expected a list, got {_kind(value)}"]
        problems: list[str] = []
        for i, item in enumerate(value):
            problems += _walk(item, info.item_type, f"{path}[{i}]")
        return problems
    if isinstance(info, mi.UnionType) and all(isinstance(t, mi.StructType) and t.tag_field for t in info.types):
        return _walk_tagged(value, info.types, path)
    if isinstance(info, mi.UnionType) and (tables := [t for t in info.types if isinstance(t, mi.StructType)]):
        # A table that may be left out (a stage's `sft`, ...): walked as its struct, so its problems are
        # said with their paths (a leaf check would take any value for it).
        if value is None and any(isinstance(t, mi.NoneType) for t in info.types):
            return []
        return _walk(value, tables[0], path)
    if isinstance(info, mi.DictType) and isinstance(info.value_type, mi.StructType):
        if not isinstance(value, dict):
            return [f"{_label(path)}: expected a table, got {_kind(value)}"]
        problems = []
        for key, item in value.items():
            problems += _walk(item, info.value_type, _join(path, str(key)))
        return problems
    return _check_leaf(value, info, path)


def _walk_tagged(value: Any, kinds: tuple[mi.StructType, ...], path: str) -> list[str]:
    """A record of one of several kinds, named by its tag (a stage's `strategy`): walked as its kind. A
    key that only another kind has is said to belong to that kind; an unknown tag is said, and the keys
    every kind has are still walked."""
    if not isinstance(value, dict):
        return [f"{_label(path)}: expected a table, got {_kind(value)}"]
    tag_field, by_tag = kinds[0].tag_field, {kind.tag: kind for kind in kinds}
    tag = value.get(tag_field)
    if tag not in by_tag:
        choices = ", ".join(sorted(by_tag))
        common = set.intersection(*({f.encode_name for f in kind.fields} for kind in kinds))
        shared = {key: item for key, item in value.items() if key in common}
        said = f"{_join(path, tag_field)}: expected one of {choices}, got {tag!r}"
        return [said, *_walk_struct(shared, kinds[0], path)]
    own = {f.encode_name for f in by_tag[tag].fields}
    problems, misplaced = [], set()
    for key in value:
        other = next((k.tag for k in kinds if key not in own and key in {f.encode_name for f in k.fields}), None)
        if other is not None:
            misplaced.add(key)
            article = "an" if other[0] in "aeios" else "a"  # (as said: "an sft", "a dpo")
            problems.append(f"{_join(path, key)}: settings of {article} {other} stage, but this stage's {tag_field} is {tag!r}")
    rest = {key: item for key, item in value.items() if key != tag_field and key not in misplaced}
    return problems + _walk_struct(rest, by_tag[tag], path)


def _walk_struct(value: Any, info: mi.StructType, path: str) -> list[str]:
    if not isinstance(value, dict):
        return [f"{_label(path)}: expected a table, got {_kind(value)}"]
    problems: list[str] = []
    fields = {f.encode_name: f for f in info.fields}
    for key in value:
        if key not in fields:
            known = ", ".join(sorted(fields))
            problems.append(f"{_join(path, key)}: unknown key (expected one of: {known})")
    for name, field in fields.items():
        if name in value:
            problems += _walk(value[name], field.type, _join(path, name))
        elif field.required:
            problems.append(f"{_join(path, name)}: missing required key")
    return problems


def _check_leaf(value: Any, info: mi.Type, path: str) -> list[str]:
    if isinstance(info, mi.LiteralType) and value not in info.values:
        choices = ", ".join(str(v) for v in info.values)
        return [f"{_label(path)}: expected one of {choices}, got {value!r}"]
    try:
        msgspec.convert(value, _python_type(info))
    except msgspec.ValidationError as exc:
        message = str(exc)
        # msgspec says "Expected `int`, got `str` - at `$[0]`"; keep the part before the location.
        message = message.split(" - at ")[0]
        return [f"{_label(path)}: {message[0].lower() + message[1:]}"]
    return []


def _python_type(info: mi.Type) -> Any:
    # Rebuild a plain annotation for msgspec.convert from the inspected leaf type.
    match info:
        case mi.IntType():
            return int
        case mi.FloatType():
            return float
        case mi.StrType():
            return str
        case mi.BoolType():
            return bool
        case mi.LiteralType(values=values):
            from typing import Literal

            return Literal[values]  # type: ignore[valid-type]
        case mi.ListType(item_type=item):
            return list[_python_type(item)]  # type: ignore[misc]
        case mi.DictType(key_type=k, value_type=v):
            return dict[_python_type(k), _python_type(v)]  # type: ignore[misc]
        case mi.UnionType(types=types):
            from typing import Union

            return Union[tuple(_python_type(t) for t in types)]  # noqa: UP007
        case mi.NoneType():
            return type(None)
        case _:
            return Any


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _label(path: str) -> str:
    return path or "(top level)"


def _kind(value: Any) -> str:
    return {
        dict: "a table",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a float",
    }.get(type(value), type(value).__name__)
