"""docs/config.md is the config reference generated from states/config.py (rewind.tools.config_reference),
lists every field of every section a config can hold, each with a meaning, and its defaults are the
structs' own."""

from __future__ import annotations

import re
import tomllib
import typing

import msgspec
import pytest

from rewind.states.config import Config
from rewind.states.config_reading import loads_config
from rewind.states.schedule import Schedule
from rewind.tools.config_reference import (
    COMMAND,
    default_text,
    field_meanings,
    missing_meanings,
    render,
    sections,
    toml_value,
)
from tests.docs.readme_figures import REPO

REFERENCE = REPO / "docs" / "config.md"


def reachable() -> dict[str, type]:
    """Every struct a config holds, by the TOML header its fields are written under (walked here, apart
    from the generator, so a section it forgot shows)."""
    found: dict[str, type] = {}

    def walk(struct: type, prefix: str) -> None:
        for field in msgspec.structs.fields(struct):
            tp, how = field.type, "[{}]"
            if typing.get_origin(tp) is list:
                tp, how = typing.get_args(tp)[0], "[[{}]]"
            elif typing.get_origin(tp) is dict:
                tp, how = typing.get_args(tp)[1], "[{}.NAME]"
            rest = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_args(tp) else [tp]
            tp = rest[0] if len(rest) == 1 else tp
            if len(rest) > 1 and all(isinstance(a, type) and issubclass(a, msgspec.Struct) for a in rest):
                # a record of several kinds (a stage): their common fields under its header, each kind's
                # own tables beside it
                common = set.intersection(*({f.name for f in msgspec.structs.fields(a)} for a in rest))
                base = next(b for b in rest[0].__mro__ if {f.name for f in msgspec.structs.fields(b)} == common)
                dotted = f"{prefix}{field.name}"
                found[how.format(dotted)] = base
                walk(base, f"{dotted}.")
                for kind in rest:
                    for own in msgspec.structs.fields(kind):
                        if own.name not in common and isinstance(own.type, type) and issubclass(own.type, msgspec.Struct):
                            found[f"[{dotted}.{own.name}]"] = own.type
                            walk(own.type, f"{dotted}.{own.name}.")
                continue
            if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
                dotted = f"{prefix}{field.name}"
                found[how.format(dotted)] = tp
                walk(tp, f"{dotted}.NAME." if how == "[{}.NAME]" else f"{dotted}.")

    found["The sections"] = Config
    walk(Config, "")
    return found


def documented(text: str) -> dict[str, list[str]]:
    """Section heading -> the fields its table lists, as docs/config.md has them."""
    listed: dict[str, list[str]] = {}
    heading = None
    for line in text.splitlines():
        if line.startswith("## "):
            heading = line[3:].strip("`")
            listed[heading] = []
        elif heading and (row := re.match(r"^\| `(\w+)` \|", line)):
            listed[heading].append(row.group(1))
    return listed


def test_the_reference_is_what_the_generator_prints():
    assert REFERENCE.read_text() == render(), f"docs/config.md is stale: regenerate it with `{COMMAND}`"


def test_every_field_of_every_section_is_listed_in_its_section():
    listed = documented(REFERENCE.read_text())
    expected = {header: [f.name for f in msgspec.structs.fields(s)] for header, s in reachable().items()}
    assert set(listed) == set(expected), "a section is missing, or one is listed that a config cannot hold"
    expected["[[stages]]"] = ["strategy", *expected["[[stages]]"]]  # its kind, the record's tag
    for header, names in expected.items():
        assert listed[header] == names, f"{header}: fields listed {listed[header]}, the struct has {names}"
    assert {"[stages.grpo]", "[[stages.grpo.rewards]]", "[data.NAME]", "[training.fade]"} <= set(listed)


def test_every_field_has_a_meaning():
    assert missing_meanings() == [], "fields without a comment in states/config.py (their meaning)"


def words_outside_parentheses(meaning: str) -> list[str]:
    outside = meaning
    while (inner := re.sub(r"\([^()]*\)", " ", outside)) != outside:
        outside = inner
    return re.findall(r"[A-Za-z]{2,}", outside)


def test_every_meaning_says_something_besides_a_link():
    """A meaning that is only a pointer in parentheses, "(docs/data.md)", tells the reader nothing there."""
    bare = {key: m for key, m in field_meanings().items() if len(words_outside_parentheses(m)) < 2}
    assert bare == {}, "fields whose comment in states/config.py is only a parenthesis or a link"
    assert words_outside_parentheses("(docs/data.md, docs/export.md)") == []
    assert words_outside_parentheses("attention heads (they divide d_model)") == ["attention", "heads"]


def test_a_stage_s_beta_says_dpo_and_grpo_stages_leave_it_at_0():
    meaning = field_meanings()[("Stage", "beta")]
    assert "dpo" in meaning and "grpo" in meaning and "dpo.beta" in meaning and "grpo.kl_beta" in meaning


def test_a_field_without_a_comment_is_named():
    meanings = field_meanings()
    del meanings[("TrainingSection", "eval_samples")], meanings[("GrpoSettings", "kl_beta")]
    assert missing_meanings(meanings) == ["training.eval_samples", "stages[i].grpo.kl_beta"]
    source = "class A:\n    # above\n    x: int = 1  # beside\n    y: int = 2\n\n    # after a blank line\n    z: int = 3\n"
    assert field_meanings(source) == {
        ("A", "x"): "above beside",
        ("A", "y"): "",
        ("A", "z"): "after a blank line",
    }


def test_sections_name_their_paths_as_problems_do():
    paths = {s.header: s.path for s in sections()}
    assert paths["[[stages.grpo.rewards]]"] == "stages[i].grpo.rewards[i]"
    assert paths["[data.NAME]"] == "data.NAME" and paths["[training.fade]"] == "training.fade"


@pytest.mark.parametrize("section", sections()[1:], ids=lambda s: s.header)
def test_every_default_is_the_structs_own_as_toml(section):
    for field in msgspec.structs.fields(section.struct):
        text = default_text(field)
        if not text.startswith("`"):
            assert text in ("required", "not set", "its fields' defaults"), (field.name, text)
            continue
        value = field.default_factory() if field.default is msgspec.NODEFAULT else field.default
        parsed = tomllib.loads(f"v = {text.strip('`')}")["v"]
        assert parsed == msgspec.to_builtins(value), (section.header, field.name, text)
    assert toml_value(1e-8) == "1e-08" and tomllib.loads("v = 1e-08")["v"] == 1e-8


def test_what_the_reference_says_a_stage_budget_counts():
    """`tokens` of an sft (dpo, grpo) stage counts rows x block_size: 12,800 tokens at batch_size 8 and
    block_size 64 are 25 steps of 8 examples each, whatever the examples' own lengths."""
    config = loads_config(
        '[training]\nbatch_size = 8\n[architecture]\nblock_size = 64\n[[stages]]\nstrategy = "sft"\n'
        'tokens = 12_800\ndatasets = [{ name = "sort" }]\n'
    )
    assert Schedule(config).num_steps == 25 == 12_800 // (8 * 64)
    meaning = field_meanings()[("Stage", "tokens")]
    assert "x block_size" in meaning and "rows" in meaning
    assert "(start)" in field_meanings()[("TrainingSection", "evaluations")]
