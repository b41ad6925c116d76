"""`--set PATH=VALUE` overrides applied to a raw config table before it is checked.

PATH is the syntax the config's own problems print: dotted keys with `[i]` list indices, as in
`training.fade.overlap`, `stages[1].tokens`, `stages[2].datasets[0].name` or (in a config written with
the flat per-stage lists) `optimization.kl.betas[0]`, so a path copied from an error message can be set. VALUE is parsed as a
TOML value (`16`, `1e-3`, `[10, 20]`, `"text"`, `{name = "sort"}`); a bare word that is not TOML is
taken as a string. A key that is missing creates its table; an index must name an existing entry
(there is nothing sensible to fill a gap with), and an index into something that is not a list is an
error naming the path. The result is then checked like the file itself (`rewind.states.config_reading`).
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

from rewind.states.config_error import ConfigError

SYNTAX = "dotted.key=VALUE (keys joined by '.', list entries as [i], VALUE a TOML value)"
SOURCE = "override"
# One path step: a bare key (letters, digits, '_' and '-', as TOML bare keys) or a list index.
_KEY = r"[A-Za-z0-9_-]+"
_STEP = re.compile(rf"\.({_KEY})|\[(\d+)\]")
_FIRST = re.compile(_KEY)

PathPart = str | int


def parse_path(key: str) -> list[PathPart]:
    """'training.datasets[2][0].name' -> ['training', 'datasets', 2, 0, 'name']; ValueError if malformed."""
    first = _FIRST.match(key)
    if first is None:
        raise ValueError(key)
    parts: list[PathPart] = [first.group(0)]
    position = first.end()
    while position < len(key):
        step = _STEP.match(key, position)
        if step is None:
            raise ValueError(key)
        name, index = step.groups()
        parts.append(name if name is not None else int(index))
        position = step.end()
    return parts


def format_path(parts: list[PathPart]) -> str:
    """The inverse of `parse_path`: the path as the config's problems print it."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


class TomlLimitError(ValueError):
    """TOML past what Python reads: tomllib raises ValueError for an integer of more digits than Python
    converts (4300), RecursionError for arrays nested deeper than its recursion limit."""


def read_toml(text: str) -> dict[str, Any]:
    """tomllib.loads, failing with TOMLDecodeError or TomlLimitError (one line each), never a traceback."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raise
    except ValueError:
        raise TomlLimitError("an integer of more than 4300 digits") from None
    except RecursionError:
        raise TomlLimitError("arrays or tables nested too deeply") from None


def shown(text: str) -> str:
    """An override as messages quote it: whole when short, else its start and length."""
    return repr(text) if len(text) <= 80 else f"{text[:60]!r}... ({len(text):,} characters)"


def parse_override(text: str) -> tuple[list[PathPart], Any]:
    """`PATH=VALUE` -> (path parts, value). Only the first '=' separates, so values may hold one."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    try:
        if not sep:
            raise ValueError(key)
        path = parse_path(key)
    except ValueError:
        raise ConfigError([f"--set {shown(text)}: expected {SYNTAX}"], SOURCE) from None
    try:
        value = read_toml(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    except TomlLimitError as exc:
        raise ConfigError([f"--set {shown(text)}: VALUE holds {exc}"], SOURCE) from None
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of `raw` with every override applied in order (a later one wins); `raw` is left alone.
    Every override that cannot be applied is reported, all at once, as one ConfigError."""
    merged = deep_copy(raw)
    problems: list[str] = []
    for text in overrides:
        try:
            path, value = parse_override(text)
        except ConfigError as exc:
            problems += exc.problems
            continue
        if problem := _set(merged, path, value):
            problems.append(f"--set {shown(text)}: {problem}")
    if problems:
        raise ConfigError(problems, SOURCE)
    return merged


def _set(root: dict[str, Any], path: list[PathPart], value: Any) -> str:
    """Put `value` at `path` inside `root`; "" on success, else what is wrong, naming the path."""
    node: Any = root
    for depth, part in enumerate(path):
        last = depth == len(path) - 1
        if isinstance(part, int):
            where = format_path(path[:depth])
            if not isinstance(node, list):
                return f"{where} is not a list, so it has no entry [{part}]"
            if part >= len(node):
                return f"{format_path(path[: depth + 1])}: index out of range ({where} has {len(node)} entries)"
        elif not isinstance(node, dict):
            return f"{format_path(path[:depth])} is not a table, so it has no key {part!r}"
        if last:
            node[part] = value
            return ""
        child = node[part] if isinstance(part, int) else node.get(part)
        if isinstance(path[depth + 1], str) and not isinstance(child, dict | list):
            # A missing table, or a scalar in the way of a dotted key: the override makes the table.
            child = {}
            node[part] = child
        elif child is None:
            return f"{format_path(path[: depth + 1])} is not set, so it has no entry [{path[depth + 1]}]"
        node = child
    return ""


def deep_copy(value: Any) -> Any:
    """A copy of a TOML-shaped value (dicts and lists copied, scalars shared)."""
    if isinstance(value, dict):
        return {k: deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [deep_copy(v) for v in value]
    return value
