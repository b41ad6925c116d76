"""A config's identity (`config_hash`) and its differences from another config.

The identity is the sha256 of a canonical JSON form in which every field left at its default is left
out, and the stages count as the flat per-stage lists they were written as before `[[stages]]`
(`identity`). Pure.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import msgspec

from rewind.states.config import Config
from rewind.states.stageform import BETAS, DATASETS, OVERLAPS, REFRESHES, RESETS, TOKENS


def config_hash(config: Config) -> str:
    """Identity of a config: sha256 of its canonical JSON, in which every field left at its default is
    omitted. So a release that adds a field with a default gives every existing config the same hash,
    while a release that changes a default changes the hash of exactly the configs that relied on it.
    The stages count as the flat lists they were written as before `[[stages]]` (`identity`), so that
    change left every hash as it was. Compare hashes computed by the same code (a resume hashes the
    logged config as decoded now)."""
    return hashlib.sha256(msgspec.json.encode(identity(config))).hexdigest()


def identity(config: Config) -> Any:
    """The canonical form a config's hash is computed from: `canonical`, with the stages given as the
    flat per-stage lists (`flat_lists`)."""
    tree = canonical(msgspec.structs.replace(config, stages=[]))
    for path, value in flat_lists(config).items():
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return _sorted(tree)


def _sorted(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {key: _sorted(tree[key]) for key in sorted(tree)}
    if isinstance(tree, list):
        return [_sorted(item) for item in tree]
    return tree


def flat_lists(config: Config) -> dict[tuple[str, ...], Any]:
    """The config's stages as the flat lists (each left out where it would be empty, as the flat
    form's defaults were), plus `stages` with each stage's name and strategy where any is set: the
    canonical form a config's identity is computed from."""
    stages = config.stages
    lists: dict[tuple[str, ...], Any] = {
        TOKENS: [s.tokens for s in stages],
        DATASETS: [canonical(s.datasets) for s in stages],
        BETAS: [canonical(s.beta or 0.0) for s in stages] if any(s.beta is not None for s in stages) else [],
        REFRESHES: [i for i, s in enumerate(stages) if s.refresh_reference],
        RESETS: [i for i, s in enumerate(stages) if s.reset_optimizer],
        OVERLAPS: [canonical(config.fade_overlap(i)) for i in range(len(stages) - 1)]
        if any(s.overlap is not None for s in stages[:-1])
        else [],
    }
    labels = [_label(s) for s in stages]
    lists[("stages",)] = labels if any(labels) else []
    return {path: value for path, value in lists.items() if value}


def _label(stage: Any) -> Any:
    """What a stage record holds beyond the flat lists, as the record before kinds wrote it: its
    strategy unless "pretrain" (the old default), its settings table and its other fields unless at
    their defaults."""
    said = canonical(
        msgspec.structs.replace(
            stage, tokens=0, datasets=[], beta=None, refresh_reference=False, reset_optimizer=False, overlap=None
        )
    )
    if said.get("strategy") == "pretrain":
        del said["strategy"]
    return said


def canonical(value: Any) -> Any:
    """Builtins for `value` with every struct field that equals its default left out, recursively; keys
    sorted (a release that only reorders fields changes nothing); floats by value, so -0.0 is 0.0 and
    each non-finite value is itself (JSON would make NaN and infinities one `null`)."""
    if isinstance(value, msgspec.Struct):
        kept = {}
        config = value.__struct_config__
        if config.tag_field is not None:  # a tagged record's kind is part of its value (a stage's strategy)
            kept[config.tag_field] = config.tag
        for info in msgspec.structs.fields(value):
            item = getattr(value, info.name)
            if info.default is not msgspec.NODEFAULT and _same(item, info.default):
                continue
            if info.default_factory is not msgspec.NODEFAULT and _same(item, info.default_factory()):
                continue
            kept[info.encode_name] = canonical(item)
        return dict(sorted(kept.items()))
    if isinstance(value, list | tuple):
        return [canonical(item) for item in value]
    if isinstance(value, dict):
        return {key: canonical(item) for key, item in sorted(value.items())}
    if isinstance(value, float) and not isinstance(value, bool):
        return value + 0.0 if math.isfinite(value) else repr(value)  # -0.0 + 0.0 is 0.0
    return value


def _same(item: Any, default: Any) -> bool:
    """Equal as canonical values: NaN equals NaN, -0.0 equals 0.0."""
    return canonical(item) == canonical(default)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{'training.fade.overlap': 0.5, 'stages[1].beta': 0.1, ...}: paths to leaves, as problems name
    them. A list of tables (the stages, a stage's mixture, the growth steps) is entered, entry by
    entry; any other list is a leaf."""
    flat: dict[str, Any] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        for i, item in enumerate(value):
            flat.update(flatten(item, f"{prefix}[{i}]"))
        return flat
    return {prefix: value}


def config_differences(old: Config, new: Config) -> list[str]:
    """'dotted.path: old -> new' for every leaf that differs, in field order."""
    a, b = flatten(msgspec.to_builtins(old)), flatten(msgspec.to_builtins(new))
    missing = object()
    return [
        f"{key}: {a.get(key, missing)!r} -> {b.get(key, missing)!r}".replace(repr(missing), "(absent)")
        for key in [*a, *(k for k in b if k not in a)]
        if a.get(key, missing) != b.get(key, missing)
    ]
