"""Reading an ABCD trainer YAML config for `rewind import-config`: typed look-ups by the original's
slash paths ("training/fade/overlap"), each remembered, so that every key nobody read can be named
afterwards as having no counterpart.

A value of the wrong type is the user's error: `UsageError` with one line naming the file and the
YAML path. The YAML itself is parsed with `yaml.safe_load` only (plain data, no Python objects).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml  # a declared dependency; this module is imported only by `rewind import-config`

from rewind.tools.configfile import read_config_text
from rewind.tools.errors import UsageError

MISSING: Any = object()

# The sections whose keys the importer reads one by one; a key under any other top-level name is
# named as a whole (`request`, `tokenizer`, an unknown section), not leaf by leaf.
READ_SECTIONS = ("architecture", "optimization", "training", "eval", "logging")


def read_yaml(path: str) -> dict[str, Any]:
    """The YAML mapping in `path`; UsageError for a missing file, bad YAML, or a non-mapping."""
    text = read_config_text(Path(path), path, kind="YAML")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise UsageError(f"{path}: not valid YAML{at}: {problem}") from None
    if not isinstance(data, dict):
        raise UsageError(
            f"{path}: expected a YAML mapping (job, training, optimization, ...), got {_kind(data)}"
        )
    return data


class YamlConfig:
    """Typed access to a parsed YAML config by slash path; every path read is marked as used."""

    def __init__(self, data: dict[str, Any], source: str):
        self.data = data
        self.source = source
        self.used: set[str] = set()

    def raw(self, path: str) -> Any:
        """The value at `path`, or MISSING; a YAML null counts as absent."""
        node: Any = self.data
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                return MISSING
            node = node[part]
        return MISSING if node is None else node

    def has(self, path: str) -> bool:
        return self.raw(path) is not MISSING

    def mark(self, path: str) -> None:
        self.used.add(path)

    def fail(self, path: str, expected: str, value: Any) -> UsageError:
        return UsageError(f"{self.source}: {path}: expected {expected}, got {_show(value)}")

    def get(self, path: str, kind: str, default: Any = MISSING) -> Any:
        """The value at `path` converted to `kind` (int, float, bool, str, ints, floats, strs), or
        `default` when absent. Floats written like `3e-4` (a string to YAML 1.1) are read as floats."""
        value = self.raw(path)
        self.mark(path)
        if value is MISSING:
            return default
        if kind in ("ints", "floats", "strs"):
            if not isinstance(value, list):
                raise self.fail(path, _LISTS[kind], value)
            return [self._convert(f"{path}[{i}]", kind[:-1], item) for i, item in enumerate(value)]
        return self._convert(path, kind, value)

    def _convert(self, path: str, kind: str, value: Any) -> Any:
        if kind == "bool" and isinstance(value, bool):
            return value
        if kind == "str" and isinstance(value, str):
            return value
        if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind == "float" and not isinstance(value, bool):
            if isinstance(value, int | float):
                return float(value)
            if isinstance(value, str):
                try:
                    return float(value)
                except ValueError:
                    pass
        raise self.fail(path, _NAMES[kind], value)

    def unread(self) -> list[str]:
        """Slash paths of the keys nobody read, each as high up as it can be named: a whole section
        or subtree when nothing under it was read, else its unread leaves. In file order."""
        return list(self._unread(self.data, ""))

    def _unread(self, node: dict[str, Any], prefix: str):
        for key, value in node.items():
            path = f"{prefix}{key}"
            if path in self.used:
                continue
            partly_read = any(u.startswith(path + "/") for u in self.used)
            if isinstance(value, dict) and value and (partly_read or path in READ_SECTIONS):
                yield from self._unread(value, path + "/")
            else:
                yield path


_NAMES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}
_LISTS = {"ints": "a list of integers", "floats": "a list of numbers", "strs": "a list of strings"}


def _kind(value: Any) -> str:
    if value is None:
        return "an empty document"
    return {list: "a list", str: "a string"}.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class Notes:
    """What the import tells the user on stderr, one line each: choices, stubs to fill, and keys with
    no counterpart (`none`), the latter in the fixed form '<yaml path>: no counterpart (<why>)'."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.defaults: list[str] = []
        self.named: set[str] = set()

    def say(self, text: str) -> None:
        self.lines.append(text)

    def none(self, path: str, why: str) -> None:
        if path not in self.named:
            self.named.add(path)
            self.lines.append(f"{path}: no counterpart ({why})")

    def default(self, path: str, value: Any) -> None:
        self.defaults.append(f"{path} = {value!r}")

    def headline(self, text: str) -> None:
        """The line said first (the LR schedule chosen), whenever it was found."""
        self.lines.insert(0, text)

    def render(self) -> list[str]:
        lines = list(self.lines)
        if self.defaults:
            lines.append("absent keys written with the original's defaults: " + ", ".join(self.defaults))
        return lines
