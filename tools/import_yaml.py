"""Reading an ABCD trainer YAML config for `rewind import-config`: typed look-ups by the original's
slash paths ("training/fade/overlap"), each remembered, so that every key nobody read can be named
afterwards as having no counterpart.

A value of the wrong type is the user's error: `UsageError` with one line naming the file and the
YAML path, the value shown cut short. The YAML itself is parsed with a `yaml.SafeLoader` (plain data, no
Python objects) that also refuses, in one line with its place in the file, what only a hostile file
needs: nesting deeper than MAX_DEPTH levels (PyYAML composes recursively), an integer too long for
Python to read, and aliases that expand the document past MAX_NODES nodes. Anchors and aliases
themselves are accepted (ABCD configs reuse a value or a mapping with `&name` / `*name` / `<<: *name`):
an alias to a mapping that holds aliases that... ("billion laughs") stays a few hundred bytes on disk
and in memory but expands exponentially wherever it is walked or printed, so it is the expanded size,
counted once per anchor, that is bounded; a recursive alias (a node inside itself) is refused.
"""

from __future__ import annotations

import reprlib
from pathlib import Path
from typing import Any

import yaml  # a declared dependency; this module is imported only by `rewind import-config`

from rewind.tools.configfile import read_config_text
from rewind.tools.errors import UsageError

MISSING: Any = object()

# The sections whose keys the importer reads one by one; a key under any other top-level name is
# named as a whole (`request`, `tokenizer`, an unknown section), not leaf by leaf.
READ_SECTIONS = ("architecture", "optimization", "training", "eval", "logging")
# A real config is a few hundred nodes, 5 levels deep.
MAX_DEPTH = 64
MAX_NODES = 100_000


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader with the bounds of the module doc, each a ComposerError/ConstructorError at its mark."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            _check_expansion(node)
        return node

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # past the interpreter's 4,300 digits
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value):,} characters, too long to read", node.start_mark
            ) from None


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def _check_expansion(root: yaml.Node) -> None:
    """ComposerError when the document, every alias expanded, has more than MAX_NODES nodes, or when an
    alias is inside the node it names. Each node's expanded size is computed once (iteratively: depth
    is bounded, but a wide document need not be)."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        children = _children(node)
        if children_done:
            on_path.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
            if sizes[id(node)] > MAX_NODES:
                raise yaml.composer.ComposerError(
                    None, None, f"aliases expand the document past {MAX_NODES:,} values", node.start_mark
                )
            continue
        if id(node) in on_path:
            raise yaml.composer.ComposerError(None, None, "an alias inside the node it names", node.start_mark)
        on_path.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _load_plain(text: str) -> Any:
    # What yaml.load does, with the bounded SafeLoader named outright (plain data only): no call to a
    # loader that could be handed an unsafe one.
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def read_yaml(path: str) -> dict[str, Any]:
    """The YAML mapping in `path`; UsageError for a missing file, bad YAML, or a non-mapping."""
    text = read_config_text(Path(path), path, kind="YAML")
    try:
        data = _load_plain(text)
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
        return UsageError(f"{self.source}: {path}: expected {expected}, got {short_repr(value)}")

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
        if kind == "float" and not isinstance(value, bool) and isinstance(value, int | float | str):
            try:
                return float(value)
            except (ValueError, OverflowError):  # not a number, or an integer past a float's range
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


_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlong, _REPR.maxlevel = 60, 60, 40, 3


def short_repr(value: Any) -> str:
    """A value in a message: never printed whole (reprlib stops at a few items, levels and characters)."""
    text = _REPR.repr(value)
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
