"""The two ways a config gives its stages, and the one it is read as.

A stage is one `[[stages]]` record (`rewind.states.config.Stage`). Configs written before the record
existed give the same facts as six flat lists indexed by stage (`training.tokens`,
`training.datasets`, `optimization.kl.betas`, `optimization.kl.reference_update_stages`,
`optimization.reset_optimizer_stages`, `training.fade.per_boundary_overlap`): users' files,
`import-config` outputs of earlier releases and the configs inside old runs' logs. `to_stage_form`
translates such a raw table once, where a config is read, so nothing past it knows the flat form;
and `flat_path` names a problem found in the translated config by the flat entry the user wrote. A
config's identity (`config_hash`) is computed from its stages given back as those lists
(`rewind.states.config_identity.flat_lists`), so no config's hash changed when stages became records.

Pure (no I/O), like the rest of `rewind.states`.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from rewind.states.check_types import collect_type_problems
from rewind.states.config_error import ConfigError
from rewind.states.overrides import PathPart, deep_copy, parse_override, shown
from rewind.states.stages import PretrainStage

# Each flat list, and the stage field its i-th entry (or, for the lists of stage indices, the
# presence of i) becomes.
TOKENS = ("training", "tokens")
DATASETS = ("training", "datasets")
BETAS = ("optimization", "kl", "betas")
REFRESHES = ("optimization", "kl", "reference_update_stages")
RESETS = ("optimization", "reset_optimizer_stages")
OVERLAPS = ("training", "fade", "per_boundary_overlap")
FLAT_FIELD = {
    TOKENS: "tokens",
    DATASETS: "datasets",
    BETAS: "beta",
    REFRESHES: "refresh_reference",
    RESETS: "reset_optimizer",
    OVERLAPS: "overlap",
}
_MISSING = object()


def to_stage_form(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str], bool]:
    """(`raw` with its stages as `[[stages]]` records, the problems only the written form can have,
    whether it was written flat). Problems name what the user wrote (`training.datasets: expected 2
    entries ...`); the translation goes on past them, so the stage rules still report the rest."""
    found = {path: value for path in FLAT_FIELD if (value := _get(raw, path)) is not _MISSING}
    out = deep_copy(raw)
    for path in found:
        _pop(out, path)
    problems: list[str] = []
    if found and "stages" in raw:
        listed = ", ".join(".".join(path) for path in found)
        problems.append(
            f"stages: the stages are given twice, as [[stages]] records and as the flat lists ({listed}); "
            "write one form (the records, or only the flat lists)"
        )
    elif found:
        out["stages"] = _stages_of(found, problems)
    _fill(out)
    problems += _name_growth_stages(out)
    return out, problems, bool(found) and "stages" not in raw


def _stages_of(found: dict[tuple[str, ...], Any], problems: list[str]) -> list[dict[str, Any]]:
    tokens = found.get(TOKENS, [])
    if not isinstance(tokens, list):
        problems += collect_type_problems(tokens, list[int], "training.tokens")
        return []
    n = len(tokens)
    stages: list[dict[str, Any]] = [{"tokens": budget} for budget in tokens]
    for path, what, expected in (
        (DATASETS, "one mixture per stage", n),
        (BETAS, "one per stage", n),
        (OVERLAPS, "one per boundary", max(n - 1, 0)),
    ):
        entries = found.get(path, [])
        name = ".".join(path)
        if not isinstance(entries, list):
            problems.append(f"{name}: expected a list, got {type(entries).__name__}")
            continue
        if len(entries) != expected and (entries or path == DATASETS):
            problems.append(f"{name}: expected {expected} entries ({what}), got {len(entries)}")
        for stage, entry in zip(stages, entries, strict=False):
            stage[FLAT_FIELD[path]] = entry
    for path, first in ((REFRESHES, 0), (RESETS, 1)):
        for stage in _stage_indices(found.get(path, []), ".".join(path), first, n, problems):
            stages[stage][FLAT_FIELD[path]] = True
    return stages


def _stage_indices(value: Any, name: str, first: int, n: int, problems: list[str]) -> list[int]:
    """The stages a flat list of stage indices names, each problem with it said (as it always was)."""
    typed = collect_type_problems(value, list[int], name)
    if typed:
        problems += typed
        return []
    good = []
    for j, stage in enumerate(value):
        if stage == 0 and first == 1:
            problems.append(
                f"{name}[{j}]: stage 0 has no moments to clear (the optimizer starts empty); name a later stage"
            )
        elif not first <= stage < max(n, 1):
            problems.append(f"{name}[{j}]: stage {stage} is out of range {first}..{n - 1}")
        else:
            good.append(stage)
    if len(set(value)) != len(value):
        problems.append(f"{name}: stages must not repeat")
    return good


def _fill(raw: dict[str, Any]) -> None:
    """Once any stage gives a beta, every stage has one (0.0 where left out); once any stage gives its
    fade's overlap, every stage but the last has one (training.fade.overlap where left out). So a
    config has one form whichever way it was written, and it is the flat lists' form."""
    stages = raw.get("stages")
    for stage in stages if isinstance(stages, list) else []:
        if isinstance(stage, dict):
            stage.setdefault("strategy", "pretrain")  # the record's kind: none given is pretraining
    if not isinstance(stages, list) or not all(isinstance(s, dict) for s in stages):
        return
    if any(s.get("beta") is not None for s in stages):
        for stage in stages:
            if stage.get("beta") is None:
                stage["beta"] = 0.0
    overlap = _fade_overlap(raw)
    if (
        any(s.get("overlap") is not None for s in stages[:-1])
        and isinstance(overlap, int | float)
        and not isinstance(overlap, bool)
    ):
        for stage in stages[:-1]:
            if stage.get("overlap") is None:
                stage["overlap"] = overlap


def _name_growth_stages(raw: dict[str, Any]) -> list[str]:
    """`[[growth]] at_stage = "name"` becomes that stage's index (the config holds indices)."""
    growth, stages = raw.get("growth"), raw.get("stages")
    if not isinstance(growth, list) or not isinstance(stages, list):
        return []
    index = {
        s.get("name"): i
        for i, s in reversed(list(enumerate(stages)))
        if isinstance(s, dict) and s.get("name")
    }
    problems = []
    for k, step in enumerate(growth):
        if isinstance(step, dict) and isinstance(step.get("at_stage"), str):
            if step["at_stage"] in index:
                step["at_stage"] = index[step["at_stage"]]
            else:
                named = ", ".join(repr(name) for name in index) or "none has a name"
                problems.append(
                    f"growth[{k}].at_stage: no stage is named {step['at_stage']!r} (stages named: {named})"
                )
    return problems


# 'stages[2].datasets[0].name: ...' -> 'training.datasets[2][0].name: ...'
_STAGE_PATH = re.compile(r"stages(?:\[(\d+)\](?:\.(\w+))?)?")
_FLAT_PATH = {field: ".".join(path) for path, field in FLAT_FIELD.items()}


def flat_path(problem: str) -> str:
    """A problem found in a config written flat, named by the flat entry the user wrote."""
    match = _STAGE_PATH.match(problem)
    if match is None:
        return problem
    index, field = match.groups()
    rest = problem[match.end() :]
    if index is None:
        return f"training.tokens{rest}"  # the list of stages as a whole: its budgets
    return f"{_FLAT_PATH.get(field or '', 'training.tokens')}[{index}]{rest}"


def _said(stage: dict[str, Any]) -> dict[str, Any]:
    """A stage record's keys that say something: those left out, None, or at the record's default do not."""
    defaults = msgspec.to_builtins(PretrainStage())
    return {k: v for k, v in stage.items() if v is not None and (k not in defaults or v != defaults[k])}


def flat_for_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`raw` written flat when an override sets a flat list (`--set training.tokens=[...]`) on a config
    whose stages are records, so that the override means what it always meant; else `raw` itself."""
    stages = raw.get("stages")
    flat = [text for text in overrides if _is_flat(_path_of(text))]
    if stages is None or not flat:
        return raw
    plain = {"tokens", "datasets", "beta", "refresh_reference", "reset_optimizer", "overlap"}
    if not (
        isinstance(stages, list)
        and all(isinstance(s, dict) and set(_said(s)) - {"name", "strategy"} <= plain for s in stages)
        and all(not s.get("name") and s.get("strategy", "pretrain") == "pretrain" for s in stages)
        and all(s.get("overlap") is None for s in stages[-1:])
    ):
        raise ConfigError(
            [
                f"--set {shown(flat[0])}: this config's [[stages]] hold what the flat lists cannot (a name, a strategy, its settings); set stages[i] fields instead"
            ],
            "override",
        )
    out = deep_copy(raw)
    del out["stages"]
    columns = {
        TOKENS: [s.get("tokens", 0) for s in stages],
        DATASETS: [s.get("datasets", []) for s in stages],
        BETAS: [_given(s, "beta", 0.0) for s in stages]
        if any(s.get("beta") is not None for s in stages)
        else [],
        REFRESHES: [i for i, s in enumerate(stages) if s.get("refresh_reference") is True],
        RESETS: [i for i, s in enumerate(stages) if s.get("reset_optimizer") is True],
        OVERLAPS: [_given(s, "overlap", _fade_overlap(raw)) for s in stages[:-1]]
        if any(s.get("overlap") is not None for s in stages[:-1])
        else [],
    }
    for path, value in columns.items():
        if value:
            node = out
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = value
    return out


def _given(stage: dict[str, Any], key: str, default: Any) -> Any:
    """A record's value, `default` where it is left out (absent, or None as a Config's builtins hold it)."""
    value = stage.get(key)
    return default if value is None else value


def _fade_overlap(raw: dict[str, Any]) -> Any:
    overlap = _get(raw, ("training", "fade", "overlap"))
    return 0.0 if overlap is _MISSING else overlap


def _path_of(text: str) -> list[PathPart]:
    try:
        return parse_override(text)[0]
    except ConfigError:  # a malformed override is reported by apply_overrides, with the others
        return []


def _is_flat(path: list[PathPart]) -> bool:
    return any(tuple(path[: len(flat)]) == flat for flat in FLAT_FIELD)


def _get(raw: Any, path: tuple[str, ...]) -> Any:
    node = raw
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def _pop(raw: dict[str, Any], path: tuple[str, ...]) -> None:
    """Remove the key at `path`, and every table it leaves empty."""
    parents = [raw]
    for part in path[:-1]:
        parents.append(parents[-1][part])
    del parents[-1][path[-1]]
    for parent, part in zip(reversed(parents[:-1]), reversed(path[:-1]), strict=True):
        if parent[part]:
            break
        del parent[part]
