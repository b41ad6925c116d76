"""The config reference, docs/config.md, generated from the typed structs of `rewind.states.config`.

`python -m rewind.tools.config_reference > docs/config.md` writes it (tests/docs/test_config_reference.py
checks that the file is what this prints, and that every field has a meaning). A field's meaning is its
comment in states/config.py, the comment lines just above it and the one on its line, read from the
source with `tokenize` and `ast`: the schema and its reference are written in one place, and a field
added without a comment has no meaning here (`missing_meanings`), which the test names. A section's
introduction is its struct's docstring, else the comment of the field that holds it. Types and defaults come
from the structs themselves (`msgspec.structs.fields`), so they cannot drift either.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import math
import tokenize
import types
import typing
from dataclasses import dataclass

import msgspec

from rewind.states import config as config_module
from rewind.states import stages as stages_module
from rewind.states.config import Config
from rewind.states.stages import STAGE_KINDS, Stage

# What a stage's `strategy` says (the record's kind, not a field of it).
STRATEGY_MEANING = (
    "how it trains: pretrain, sft, dpo, grpo or distill (docs/posttraining.md); the kind of its record, which "
    "holds that strategy's settings table alone"
)

COMMAND = ".venv/bin/python -m rewind.tools.config_reference > docs/config.md"

PREFACE = f"""# Config reference

Every section and field of a rewind config: its type, its default and what it means. Generated from the
typed structs in `states/config.py` by `{COMMAND}`;
`tests/docs/test_config_reference.py` checks that this file is what that prints and that every field has a
meaning, which is the field's comment in `states/config.py`: edit it there, never here.

A config is a TOML file decoded into these structs: a key they do not have is an error, a key left out
takes its default. `rewind schedule CONFIG` checks one without torch and prints every problem at once,
each named by its path (`stages[1].tokens`), the path `--set PATH=VALUE` takes. An inline table
(`sft = {{ packing = true }}`) must fit on one line (TOML's rule); a longer one is a table of its own,
`[stages.grpo]` after its `[[stages]]` record. Configs written with the older flat per-stage lists
(`training.tokens`, `training.datasets`, `optimization.kl.betas`, ...) are still read: see docs/configuring.md.
"""


@dataclass(frozen=True)
class Section:
    header: str  # as TOML writes it: "[training.fade]", "[[stages]]", "[data.NAME]"
    path: str  # the dotted path its fields take in problems and --set, a list's entry or a name as [i] / NAME
    struct: type
    meaning: str  # the comment of the field that holds it ("" for the whole config)


def field_meanings(source: str | None = None) -> dict[tuple[str, str], str]:
    """(class name, field name) -> the field's comment in `source` (states/config.py's and
    states/stages.py's by default): the comment-only lines just above it, then the comment on its own
    line(s), joined into one paragraph."""
    if source is None:
        return field_meanings(inspect.getsource(config_module)) | field_meanings(inspect.getsource(stages_module))
    comments: dict[int, tuple[str, bool]] = {}  # line -> (text, whether code precedes it on the line)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            code_before = bool(token.line[: token.start[1]].strip())
            comments[token.start[0]] = (token.string.lstrip("#").strip(), code_before)
    meanings: dict[tuple[str, str], str] = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for statement in node.body:
            if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
                continue
            if "ClassVar" in ast.unparse(statement.annotation):  # a constant of the class, not a field
                continue
            above: list[str] = []
            line = statement.lineno - 1
            while line in comments and not comments[line][1]:
                above.insert(0, comments[line][0])
                line -= 1
            end = statement.end_lineno or statement.lineno
            trailing = [comments[n][0] for n in range(statement.lineno, end + 1) if n in comments]
            meanings[(node.name, statement.target.id)] = " ".join(above + trailing).strip()
    return meanings


def _struct_in(annotation: typing.Any) -> tuple[type | None, str]:
    """The struct a field's type holds, and how: "" (itself, or optional), "list" or "dict"."""
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return annotation, ""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) > 1 and all(isinstance(a, type) and issubclass(a, Stage) for a in inner):
            return Stage, ""  # a stage of any kind: its common record, each kind's table beside it
        return _struct_in(inner[0]) if len(inner) == 1 else (None, "")
    if origin is list and args:
        found, _ = _struct_in(args[0])
        return found, "list"
    if origin is dict and len(args) == 2:
        found, _ = _struct_in(args[1])
        return found, "dict"
    return None, ""


def sections(meanings: dict[tuple[str, str], str] | None = None) -> list[Section]:
    """Every section reachable from Config, depth first in field order: the whole config first."""
    meanings = field_meanings() if meanings is None else meanings
    found = [Section("", "", Config, "")]

    def walk(struct: type, header_path: str, path: str) -> None:
        for field in msgspec.structs.fields(struct):
            inner, how = _struct_in(field.type)
            if inner is None:
                continue
            dotted = f"{header_path}.{field.name}" if header_path else field.name
            at = f"{path}.{field.name}" if path else field.name
            header = {"": f"[{dotted}]", "list": f"[[{dotted}]]", "dict": f"[{dotted}.NAME]"}[how]
            at = {"": at, "list": f"{at}[i]", "dict": f"{at}.NAME"}[how]
            found.append(Section(header, at, inner, meanings.get((struct.__name__, field.name), "")))
            walk(inner, dotted + (".NAME" if how == "dict" else ""), at)
            if inner is Stage:  # each kind's settings table, a field of that kind's record alone
                for kind in STAGE_KINDS.values():
                    if kind.settings_table:
                        walk_one(kind, kind.settings_table, dotted, at)

    def walk_one(struct: type, name: str, header_path: str, path: str) -> None:
        field = next(f for f in msgspec.structs.fields(struct) if f.name == name)
        inner, _ = _struct_in(field.type)
        found.append(Section(f"[{header_path}.{name}]", f"{path}.{name}", inner, meanings.get((struct.__name__, name), "")))
        walk(inner, f"{header_path}.{name}", f"{path}.{name}")

    walk(Config, "", "")
    return found


def type_text(annotation: typing.Any) -> str:
    """A field's type as a reader of the TOML needs it: Literal choices spelled out."""
    if annotation in (int, float, bool, str):
        return {int: "integer", float: "float", bool: "boolean", str: "string"}[annotation]
    inner, how = _struct_in(annotation)
    if inner is not None:
        return {"": "table", "list": "list of tables", "dict": "tables by name"}[how]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " or ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return " or ".join(type_text(a) for a in rest) + (", or not set" if len(rest) < len(args) else "")
    if origin is list:
        return f"list of {type_text(args[0])}"
    raise TypeError(f"no reference text for the type {annotation!r}")  # a new kind of field: say it here


def toml_value(value: typing.Any) -> str:
    """A default as TOML writes it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value).replace("infinity", "inf")
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, msgspec.Struct):
        return toml_value(msgspec.to_builtins(value))
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + " }" if value else "{}"
    raise TypeError(f"no TOML for the default {value!r}")


def default_text(field: msgspec.structs.FieldInfo) -> str:
    if field.required:
        return "required"
    value = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
    if value is None:
        return "not set"
    if isinstance(value, msgspec.Struct):
        return "its fields' defaults"
    return f"`{toml_value(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def missing_meanings(meanings: dict[tuple[str, str], str] | None = None) -> list[str]:
    """Every field, by its path, whose comment in states/config.py is missing (each needs one)."""
    meanings = field_meanings() if meanings is None else meanings
    return [
        f"{section.path + '.' if section.path else ''}{field.name}"
        for section in sections(meanings)
        for field in msgspec.structs.fields(section.struct)
        if not meanings.get((section.struct.__name__, field.name))
    ]


def render() -> str:
    meanings = field_meanings()
    found = sections(meanings)
    headers = {s.struct: s.header for s in found}
    out = [PREFACE]
    for section in found:
        if section.struct is Config:
            out += ["## The sections", "", "The top level of a config: each of these is a section below."]
        else:
            out.append(f"## `{section.header}`")
            # Its docstring, else the meaning its field has in the table above (the struct's own is fuller).
            text = " ".join((section.struct.__doc__ or "").split()) or section.meaning
            out += ["", text]
        out += ["", "| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        if section.struct is Stage:  # its kind: the record's tag, not one of its fields
            kinds = " or ".join(f"`{json.dumps(tag)}`" for tag in STAGE_KINDS)
            out.append(f"| `strategy` | {kinds} | `\"pretrain\"` | {_cell(STRATEGY_MEANING)} |")
        for field in msgspec.structs.fields(section.struct):
            inner, _ = _struct_in(field.type)
            kind = type_text(field.type) + (f" `{headers[inner]}`" if inner is not None else "")
            meaning = meanings.get((section.struct.__name__, field.name), "")
            out.append(
                f"| `{field.name}` | {_cell(kind)} | {_cell(default_text(field))} | {_cell(meaning)} |"
            )
        out.append("")
    return "\n".join(out)


def main() -> int:
    print(render(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
