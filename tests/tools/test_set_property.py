"""Property: no `--set` value crashes `rewind schedule` or `rewind train`.

Every field of the config (found by walking the msgspec `Config` type: each dotted path, list entries
by index, a user dataset's fields) gets values of every kind: wrong types, NaN and infinities, huge
and negative integers, empty lists, strings, tables, words that are not TOML. Either the value is
refused, as exit 2 with one or more lines each starting "rewind: " (never a traceback), or, being
valid, `schedule` runs to exit 0 (or exit 2 "no steps" for a budget below one step). `train` is only
given the values the config check refuses, and must leave its run directory uncreated.
"""

from __future__ import annotations

import json
import math
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import inspect as mi

from rewind.states.config import Config, ConfigError
from rewind.tools.configfile import load_config
from rewind.tools.errors import UsageError
from rewind.tools.jsonout import json_safe
from tests.conftest import EXAMPLES

TINY = EXAMPLES / "tiny.toml"


def field_paths(info: Any = None, path: str = "") -> list[str]:
    """Every path `--set` can name in a Config, for a config shaped like tiny.toml (three stages, one
    dataset in each mixture, a user dataset called "mine"): tables' fields, whole lists and their
    first entry, and the fields of structs inside lists and dicts."""
    info = mi.type_info(Config) if info is None else info
    if isinstance(info, mi.StructType):
        paths = [path] if path else []
        for field in info.fields:
            paths += field_paths(field.type, f"{path}.{field.encode_name}" if path else field.encode_name)
        return paths
    if isinstance(info, mi.ListType):
        return [path, *field_paths(info.item_type, f"{path}[0]")]
    if isinstance(info, mi.DictType):
        return [path, *field_paths(info.value_type, f"{path}.mine")]
    if isinstance(info, mi.UnionType) and all(isinstance(t, mi.StructType) and t.tag_field for t in info.types):
        # a stage: its strategy, and every kind's fields (each kind's own table named on a stage of it)
        paths = [path, f"{path}.{info.types[0].tag_field}"]
        for kind in info.types:
            paths += [p for p in field_paths(kind, path)[1:] if p not in paths]
        return paths
    return [path]


# The flat per-stage lists a config may still be written with, and --set may still name on tiny.toml's
# [[stages]] records (rewind.states.stageform.flat_for_overrides).
FLAT_PATHS = [
    "training.tokens",
    "training.tokens[0]",
    "training.datasets",
    "training.datasets[0]",
    "training.datasets[0][0].name",
    "optimization.kl.betas",
    "optimization.kl.betas[0]",
    "optimization.kl.reference_update_stages",
    "optimization.reset_optimizer_stages",
    "training.fade.per_boundary_overlap",
]
PATHS = field_paths() + FLAT_PATHS


def toml_scalars() -> st.SearchStrategy[str]:
    return st.one_of(
        st.integers(min_value=-(2**70), max_value=2**70).map(str),
        st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1]).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(_toml_float),
        st.sampled_from(["nan", "-nan", "inf", "-inf", "0.0", "-0.0", "1e308", "5e-324"]),
        st.booleans().map(lambda b: "true" if b else "false"),
        st.text(max_size=12).map(json.dumps),  # TOML strings (JSON's escapes are TOML's)
        st.sampled_from(["linear", "cosine", "wsd", "grammar", "tokens", "uint16", "stop"]),
    )


def _toml_float(value: float) -> str:
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return repr(value)


def toml_values() -> st.SearchStrategy[str]:
    lists = st.lists(toml_scalars(), max_size=4).map(lambda items: "[" + ", ".join(items) + "]")
    tables = st.dictionaries(st.sampled_from(["name", "rate", "kind", "path", "x"]), toml_scalars(), max_size=3).map(
        lambda table: "{" + ", ".join(f"{k} = {v}" for k, v in table.items()) + "}"
    )
    nested = st.lists(lists, max_size=3).map(lambda items: "[" + ", ".join(items) + "]")
    garbage = st.text(max_size=10)  # often not TOML: taken as a bare string
    return st.one_of(toml_scalars(), lists, st.just("[]"), tables, nested, garbage)


def overrides() -> st.SearchStrategy[list[str]]:
    one = st.builds(lambda path, value: f"{path}={value}", st.sampled_from(PATHS), toml_values())
    return st.lists(one, min_size=1, max_size=3)


def assert_refused_cleanly(code: int, out: str, err: str) -> None:
    assert code == 2, (code, err)
    lines = err.splitlines()
    assert lines and all(line.startswith("rewind: ") for line in lines), err
    assert "Traceback" not in err and out == ""


def test_the_walk_finds_every_section_and_indexed_paths():
    for path in ("run.seed", "training.fade.overlap", "stages[0].datasets[0].name", "stages[0].tokens",
                 "stages[0].beta", "stages[0].reset_optimizer", "data.mine.path", "logging.keep_last_checkpoints"):
        assert path in PATHS, path
    # Every leaf path of a full config is found (the walk misses no field).
    flat = msgspec.to_builtins(load_config(TINY))
    assert {f"architecture.{key}" for key in flat["architecture"]} <= set(PATHS)
    assert {f"optimization.{key}" for key in flat["optimization"]} <= set(PATHS)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sets=overrides())
def test_random_set_values_never_crash_schedule_or_train(sets, capsys, tmp_path):
    from rewind.tools.cli import main

    arguments = [part for text in sets for part in ("--set", text)]
    try:
        load_config(TINY, sets)
        valid = True
    except (ConfigError, UsageError):
        valid = False

    code = main(["schedule", str(TINY), "--json", *arguments])
    out, err = capsys.readouterr()
    if valid and code == 0:
        assert json_safe(json.loads(out))["num_steps"] > 0
    elif valid:
        assert_refused_cleanly(code, out, err)
        assert "no steps" in err
    else:
        assert_refused_cleanly(code, out, err)

    if not valid:
        run = tmp_path / f"run-{abs(hash(tuple(sets)))}"
        code = main(["train", str(TINY), "--run-dir", str(run), "--no-progress", *arguments])
        out, err = capsys.readouterr()
        assert_refused_cleanly(code, out, err)
        assert not run.exists()
