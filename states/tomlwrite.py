"""A small TOML writer for configs (tomllib only reads). Tables for dicts, arrays of tables for the
top level's lists of dicts (`[[stages]]`, `[[growth]]`), inline tables in other lists. TOML has no
null: a None is a field left out."""

from __future__ import annotations

import math
import re
from typing import Any


def dumps(data: dict[str, Any]) -> str:
    lines: list[str] = []
    _table(data, [], lines)
    return "\n".join(lines).strip() + "\n"


def _table(data: dict[str, Any], path: list[str], lines: list[str]) -> None:
    data = {k: v for k, v in data.items() if v is not None}
    arrays = {k: v for k, v in data.items() if not path and _is_array_of_tables(v)}
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict) and k not in arrays}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    if path and (scalars or not tables):
        lines.append(f"\n[{'.'.join(_key(p) for p in path)}]")
    for key, value in scalars.items():
        lines.append(f"{_key(key)} = {_value(value)}")
    for key, value in tables.items():
        _table(value, [*path, key], lines)
    for key, items in arrays.items():
        for item in items:
            lines.append(f"\n[[{_key(key)}]]")
            lines += [f"{_key(k)} = {_value(v)}" for k, v in item.items() if v is not None]


def _is_array_of_tables(value: Any) -> bool:
    """A list of flat tables (no table inside): what `[[key]]` blocks write plainly."""
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(item, dict) for item in value)
        and not any(isinstance(v, dict) for item in value for v in item.values())
    )


def _key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else _string(key)


def _string(text: str) -> str:
    """A TOML basic string: escape quotes, backslashes and control characters, keep the rest as is
    (json.dumps would write astral characters as surrogate pairs, which TOML rejects)."""
    out = []
    for ch in text:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + " }"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")
