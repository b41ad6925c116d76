"""Reading a config: TOML text (or a raw table) to a checked `Config`, every problem at once.

The steps, in order: the TOML is parsed (`rewind.states.overrides.read_toml`) and `--set` overrides
applied; the flat per-stage lists are translated to `[[stages]]` records (`rewind.states.stageform`);
the raw table is walked against the struct types (`rewind.states.check_types`); the rules beyond the
types run (`rewind.states.config_rules`); and `ConfigError` carries every problem, each naming its
dotted field path as the user wrote it (a flat list's entry in a flat config).

Pure: the caller reads the file (see `rewind.tools.configfile`); this module only parses text.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

import msgspec

from rewind.states.check_types import collect_type_problems, field_of, unrecordable_ints, without
from rewind.states.config import Config
from rewind.states.config_error import ConfigError
from rewind.states.config_rules import check_config
from rewind.states.overrides import TomlLimitError, apply_overrides, read_toml
from rewind.states.stageform import flat_for_overrides, flat_path, to_stage_form


def loads_config(text: str, source: str = "config", overrides: list[str] | None = None) -> Config:
    """Parse TOML text into a Config, reporting every problem at once as a ConfigError."""
    try:
        raw = read_toml(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"not valid TOML: {exc}{multiline_table_hint(text, str(exc))}"], source) from None
    except TomlLimitError as exc:
        raise ConfigError([f"cannot read the TOML: {exc}"], source) from None
    if overrides:
        raw = apply_overrides(flat_for_overrides(raw, overrides), overrides)
    return config_from_dict(raw, source)


_AT_LINE = re.compile(r"\(at line (\d+), column \d+\)")
_HEADER = re.compile(r"""\s*\[\[?\s*([A-Za-z0-9_.\-"' ]+?)\s*\]\]?\s*(#.*)?""")


def multiline_table_hint(text: str, error: str) -> str:
    """What to do when a TOML error comes from an inline table spread over lines (TOML wants `key = {...}`
    on one line; tomllib names only the character it then met): the table to write instead, or "" when
    no line up to the error's leaves an inline table open."""
    at = _AT_LINE.search(error)
    lines = text.splitlines()[: int(at.group(1)) if at else None]
    header = ""
    for number, line in enumerate(lines, start=1):
        if '"""' in line or "'''" in line:
            return ""  # a multi-line string: what follows is not scanned line by line
        if found := _HEADER.fullmatch(line):
            header = found.group(1).replace(" ", "")
        opened = _open_brackets(line)
        if not any(bracket == "{" for bracket, _ in opened):
            continue
        hint = f"; line {number} leaves an inline table open, and an inline table must be on one line"
        key = line[: opened[0][1]].rpartition("=")[0].strip().replace(" ", "")
        if not key:
            return hint
        path = f"{header}.{key}" if header else key
        table = f"a [[{path}]] entry for each" if opened[0][0] == "[" else f"a [{path}] table"
        return f"{hint}: write {table} instead"
    return ""


def _open_brackets(line: str) -> list[tuple[str, int]]:
    """The brackets (`[` or `{`, with their column) that `line` opens and leaves open, outermost first;
    quoted text and a comment are skipped."""
    stack: list[tuple[str, int]] = []
    quote = ""
    escaped = False
    for column, char in enumerate(line):
        if quote:
            if escaped:
                escaped = False
            elif char == "\\" and quote == '"':
                escaped = True
            elif char == quote:
                quote = ""
        elif char in "\"'":
            quote = char
        elif char == "#":
            break
        elif char in "[{":
            stack.append((char, column))
        elif char in "]}" and stack:
            stack.pop()
    return stack


def config_from_dict(raw: dict[str, Any], source: str = "config") -> Config:
    """A Config from a raw table of either form (`[[stages]]` records or the flat per-stage lists,
    translated here: `rewind.states.stageform`), or every problem with it as one ConfigError."""
    raw, said, flat = to_stage_form(raw)
    problems = collect_type_problems(raw, Config)
    # An integer the log cannot hold is dropped like a mistyped key: no rule computes with it (nor prints it).
    mistyped = {field_of(p) for p in problems}
    problems += [p for p in unrecordable_ints(raw) if field_of(p) not in mistyped]
    if problems or said:
        raise ConfigError(as_written(said, problems + rules_past(raw, problems), flat), source)
    config = msgspec.convert(raw, Config)
    problems = check_config(config)
    if problems:
        raise ConfigError(as_written([], problems, flat), source)
    return config


def rules_past(raw: dict[str, Any], problems: list[str]) -> list[str]:
    """The rules' problems with a config whose types are not all sound: the mistyped keys are dropped
    (their problem is already said), what remains is checked, and only findings about fields that were
    not dropped are kept."""
    dropped = sorted({field_of(p) for p in problems})
    try:
        rest = check_config(msgspec.convert(without(raw, dropped), Config))
    except msgspec.ValidationError:
        rest = []
    # Stage-range rules are meaningless once the stages were dropped.
    stages_unknown = "stages" in dropped
    return [
        p
        for p in rest
        if not any(field_of(p).startswith(d) for d in dropped)
        and not (stages_unknown and "out of range" in p)
    ]


def as_written(said: list[str], problems: list[str], flat: bool) -> list[str]:
    """The problems named as the user wrote the config (a flat config's by its flat lists' entries),
    leaving out what the translation already said about the same field."""
    fields = {field_of(p) for p in said}
    named = [flat_path(p) for p in problems] if flat else problems
    return said + [p for p in named if not any(field_of(p).startswith(f) for f in fields)]
