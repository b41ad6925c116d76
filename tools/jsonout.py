"""What every command's `--json` prints: strict JSON (RFC 8259), which has no NaN and no infinities.

One rule for every command: a float that is not a finite number (a skipped step's NaN loss, an
infinite figure, a NaN a comparison computed) is written as `null`, the way JavaScript's
JSON.stringify and pandas write it, so a figure's field is always a number or null and a strict parser
(`json.loads(text, parse_constant=...)` refusing NaN, jq, a browser) reads every output. The text
outputs say which it was (`nan`, `inf`); the records themselves keep it (`rewind log` without --json).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

# For a command's --json help: the rule, in the words of its help.
NON_FINITE_HELP = "a figure that is NaN or infinite is null"


def json_safe(value: Any) -> Any:
    """`value` with every non-finite float, at any depth of its dicts, lists and tuples, made None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def dumps(value: Any, *, indent: int | None = 1, default: Callable[[Any], Any] | None = None) -> str:
    """Strict JSON of `value` (non-finite floats as null). `default` turns what JSON has no type for
    into something it has (as json.dumps's); what it returns is made safe too."""
    safe_default = None if default is None else (lambda obj: json_safe(default(obj)))
    return json.dumps(json_safe(value), indent=indent, allow_nan=False, default=safe_default)


def print_json(value: Any, *, indent: int | None = 1, default: Callable[[Any], Any] | None = None) -> None:
    """Print `value` as strict JSON (`dumps`): what every `--json` prints."""
    print(dumps(value, indent=indent, default=default))
