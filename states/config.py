"""Typed run configuration: frozen msgspec structs decoded from TOML.

Keys follow the ABCD trainer's names (`training.tokens`, `training.fade.overlap`, ...) so its users
feel at home. Decoding never stops at the first problem: `check_config` walks the raw TOML against
the struct types and then checks the cross-field rules, and `ConfigError` carries every problem,
each naming its dotted field path.

Pure: the caller reads the file (see `rewind.tools.configfile`); this module only parses text.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from typing import Any, Literal

import msgspec

from rewind.states.checking import collect_type_problems

CurveName = Literal["linear", "cosine", "sigmoid"]
LrScheduleName = Literal["wsds", "wsd", "cosine", "sgdr", "constant"]
KlKind = Literal["token_kl", "nll_difference"]
NormName = Literal["rmsnorm", "layernorm"]
NonFiniteAction = Literal["stop", "skip"]
DataKind = Literal["tokens", "jsonl"]

# Embedded synthetic datasets the engine generates in code (no download). Their names live here so
# that a config can be validated without importing torch; the engine's registry asserts it matches.
BUILTIN_DATASETS: tuple[str, ...] = ("grammar", "reverse", "sort", "add")


class Struct(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config section: immutable, and unknown keys are an error, never ignored."""


class RunSection(Struct):
    seed: int = 0
    name: str = "run"


class ArchitectureSection(Struct):
    block_size: int = 64
    vocab_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    d_model: int = 64
    d_ff: int = 0  # 0 = 4 * d_model
    norm: NormName = "rmsnorm"
    dropout: float = 0.0
    rope_base: float = 10000.0
    activation_checkpointing: bool = False


class Sampling(Struct):
    name: str
    rate: float = 1.0


class FadeSection(Struct):
    overlap: float = 0.0
    curve: CurveName = "linear"
    steepness: float = 10.0
    per_boundary_overlap: list[float] = []


class TrainingSection(Struct):
    batch_size: int = 8
    per_device_batch_size: int = -1
    tokens: list[int] = []
    datasets: list[list[Sampling]] = []
    validation_steps: int = 2
    evaluations: list[str] = []
    eval_samples: int = 64
    on_nonfinite: NonFiniteAction = "stop"
    fade: FadeSection = FadeSection()


class KlSection(Struct):
    betas: list[float] = []  # one per stage; empty = no KL anywhere
    reference_update_stages: list[int] = []
    kind: KlKind = "token_kl"


class OptimizationSection(Struct):
    lr: float = 3e-4
    schedule: LrScheduleName = "wsd"
    warmup_pct: float = 0.01
    constant_pct: float = 0.0
    decay_pct: float = 0.1
    warmup_lr_mult: float = 0.01
    decay_lr_mult: float = 0.1
    min_lr_ratio: float = 0.1
    sgdr_period: int = 100
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    kl: KlSection = KlSection()


class LoggingSection(Struct):
    report_interval: int = 10
    validation_interval: int = 0  # 0 = never (boundary evaluations still run)
    checkpoint_interval: int = 0  # 0 = only at stage boundaries and the end
    keep_last_checkpoints: int = 3


class DataSource(Struct):
    """A user dataset: flat token file (uint16/uint32, memory-mapped) or JSONL text (byte tokenizer)."""

    kind: DataKind
    path: str
    dtype: Literal["uint16", "uint32"] = "uint16"
    text_field: str = "text"
    validation_fraction: float = 0.05


class Config(Struct):
    run: RunSection = RunSection()
    architecture: ArchitectureSection = ArchitectureSection()
    training: TrainingSection = TrainingSection()
    optimization: OptimizationSection = OptimizationSection()
    logging: LoggingSection = LoggingSection()
    data: dict[str, DataSource] = {}

    @property
    def num_stages(self) -> int:
        return len(self.training.tokens)

    @property
    def tokens_per_step(self) -> int:
        return self.training.batch_size * self.architecture.block_size

    def dataset_names(self) -> set[str]:
        return set(BUILTIN_DATASETS) | set(self.data)


class ConfigError(Exception):
    """Every problem found in a config, each as 'dotted.path: what is wrong'."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = list(problems)
        self.source = source
        super().__init__(f"{source}: " + "; ".join(self.problems))

    def lines(self) -> list[str]:
        return [f"{self.source}: {p}" for p in self.problems]


def config_hash(config: Config) -> str:
    """Stable identity of a config: sha256 of its canonical JSON (field order is the struct's)."""
    return hashlib.sha256(msgspec.json.encode(config)).hexdigest()


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{'training.fade.overlap': 0.5, ...}: dotted paths to leaves (lists are leaves)."""
    if isinstance(value, dict):
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
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


def parse_override(text: str) -> tuple[list[str], Any]:
    """`dotted.key=VALUE` with VALUE parsed as a TOML value (bare words fall back to strings)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError([f"--set {text!r}: expected dotted.key=VALUE"], "override")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    merged = _deep_copy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = merged
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[path[-1]] = value
    return merged


def loads_config(text: str, source: str = "config", overrides: list[str] | None = None) -> Config:
    """Parse TOML text into a Config, reporting every problem at once as a ConfigError."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"not valid TOML: {exc}"], source) from None
    return config_from_dict(apply_overrides(raw, overrides or []), source)


def config_from_dict(raw: dict[str, Any], source: str = "config") -> Config:
    problems = collect_type_problems(raw, Config)
    if problems:
        # Still report the cross-field problems: drop the mistyped keys (their problem is already
        # said), check what remains, and keep only findings about fields that were not dropped.
        dropped = sorted({_field_of(p) for p in problems})
        sanitized = _without(raw, dropped)
        try:
            rest = check_config(msgspec.convert(sanitized, Config))
        except msgspec.ValidationError:
            rest = []
        # Per-stage length and stage-range rules are meaningless once the stage budgets were dropped.
        stages_unknown = "training.tokens" in dropped
        problems += [
            p
            for p in rest
            if not any(_field_of(p).startswith(d) for d in dropped)
            and not (stages_unknown and ("entries (one" in p or "out of range" in p))
        ]
        raise ConfigError(problems, source)
    config = msgspec.convert(raw, Config)
    problems = check_config(config)
    if problems:
        raise ConfigError(problems, source)
    return config


def _field_of(problem: str) -> str:
    """'training.tokens[1]: ...' -> 'training.tokens' (the key a sanitiser can drop)."""
    return re.split(r"[\[:]", problem, maxsplit=1)[0]


def _without(raw: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    pruned = _deep_copy(raw)
    for path in paths:
        *parents, last = path.split(".")
        node: Any = pruned
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return pruned


def dumps_config(config: Config) -> str:
    """TOML text for a config (round-trips through `loads_config`)."""
    from rewind.states.tomlwrite import dumps

    return dumps(msgspec.to_builtins(config))


def check_config(config: Config) -> list[str]:
    """Cross-field rules the types cannot express. Returns every problem, in field order."""
    problems: list[str] = []
    t, fade, opt, kl, arch = (
        config.training,
        config.training.fade,
        config.optimization,
        config.optimization.kl,
        config.architecture,
    )
    n = len(t.tokens)
    add = problems.append

    for name in ("block_size", "vocab_size", "num_layers", "num_heads", "d_model"):
        if getattr(arch, name) <= 0:
            add(f"architecture.{name}: must be positive, got {getattr(arch, name)}")
    if arch.num_heads > 0 and arch.d_model % arch.num_heads:
        add(f"architecture.d_model: {arch.d_model} is not divisible by num_heads={arch.num_heads}")
    elif arch.num_heads > 0 and (arch.d_model // arch.num_heads) % 2:
        add("architecture.d_model: head size must be even for RoPE")
    if arch.d_ff < 0:
        add(f"architecture.d_ff: must be >= 0 (0 = 4 * d_model), got {arch.d_ff}")
    if not 0.0 <= arch.dropout < 1.0:
        add(f"architecture.dropout: must be in [0, 1), got {arch.dropout}")

    if n == 0:
        add("training.tokens: expected at least one stage budget, got an empty list")
    for i, budget in enumerate(t.tokens):
        if budget <= 0:
            add(f"training.tokens[{i}]: stage budget must be positive, got {budget}")
    if t.batch_size <= 0:
        add(f"training.batch_size: must be positive, got {t.batch_size}")
    if t.per_device_batch_size == 0 or t.per_device_batch_size < -1:
        add(f"training.per_device_batch_size: must be -1 (no accumulation) or positive, got {t.per_device_batch_size}")
    elif t.per_device_batch_size > 0 and t.batch_size > 0 and t.batch_size % t.per_device_batch_size:
        add(
            f"training.per_device_batch_size: {t.per_device_batch_size} does not divide "
            f"batch_size={t.batch_size}"
        )
    if t.validation_steps < 0:
        add(f"training.validation_steps: must be >= 0, got {t.validation_steps}")
    if t.eval_samples <= 0:
        add(f"training.eval_samples: must be positive, got {t.eval_samples}")

    if len(t.datasets) != n:
        add(f"training.datasets: expected {n} entries (one mixture per stage), got {len(t.datasets)}")
    known = config.dataset_names()
    for i, mixture in enumerate(t.datasets):
        if not mixture:
            add(f"training.datasets[{i}]: a stage needs at least one dataset")
            continue
        for j, sampling in enumerate(mixture):
            if sampling.name not in known:
                add(
                    f"training.datasets[{i}][{j}].name: unknown dataset {sampling.name!r} "
                    f"(known: {', '.join(sorted(known))})"
                )
            if sampling.rate <= 0:
                add(f"training.datasets[{i}][{j}].rate: must be positive, got {sampling.rate}")
        total = sum(s.rate for s in mixture)
        if abs(total - 1.0) > 1e-6:
            add(f"training.datasets[{i}]: rates must sum to 1, got {total:g}")
    for j, name in enumerate(t.evaluations):
        if name not in known:
            add(f"training.evaluations[{j}]: unknown dataset {name!r}")

    if not 0.0 <= fade.overlap <= 1.0:
        add(f"training.fade.overlap: must be in [0, 1], got {fade.overlap}")
    if fade.steepness <= 0:
        add(f"training.fade.steepness: must be positive, got {fade.steepness}")
    if fade.per_boundary_overlap and len(fade.per_boundary_overlap) != max(n - 1, 0):
        add(
            f"training.fade.per_boundary_overlap: expected {max(n - 1, 0)} entries (one per boundary), "
            f"got {len(fade.per_boundary_overlap)}"
        )
    for j, o in enumerate(fade.per_boundary_overlap):
        if not 0.0 <= o <= 1.0:
            add(f"training.fade.per_boundary_overlap[{j}]: must be in [0, 1], got {o}")

    if opt.lr <= 0:
        add(f"optimization.lr: must be positive, got {opt.lr}")
    for name in ("warmup_pct", "constant_pct", "decay_pct"):
        if not 0.0 <= getattr(opt, name) <= 1.0:
            add(f"optimization.{name}: must be in [0, 1], got {getattr(opt, name)}")
    used = opt.warmup_pct + opt.decay_pct + (opt.constant_pct if opt.schedule == "wsds" else 0.0)
    if used > 1.0 + 1e-9:
        add(f"optimization: warmup_pct + decay_pct (+ constant_pct for wsds) must be <= 1, got {used:g}")
    for name in ("warmup_lr_mult", "decay_lr_mult", "min_lr_ratio"):
        if not 0.0 <= getattr(opt, name) <= 1.0:
            add(f"optimization.{name}: must be in [0, 1], got {getattr(opt, name)}")
    if opt.sgdr_period <= 0:
        add(f"optimization.sgdr_period: must be positive, got {opt.sgdr_period}")
    if opt.weight_decay < 0:
        add(f"optimization.weight_decay: must be >= 0, got {opt.weight_decay}")
    if opt.grad_clip < 0:
        add(f"optimization.grad_clip: must be >= 0 (0 = off), got {opt.grad_clip}")

    if kl.betas and len(kl.betas) != n:
        add(f"optimization.kl.betas: expected {n} entries (one per stage), got {len(kl.betas)}")
    for i, beta in enumerate(kl.betas):
        if beta < 0:
            add(f"optimization.kl.betas[{i}]: must be >= 0, got {beta}")
    for j, stage in enumerate(kl.reference_update_stages):
        if not 0 <= stage < max(n, 1):
            add(f"optimization.kl.reference_update_stages[{j}]: stage {stage} is out of range 0..{n - 1}")
    if len(set(kl.reference_update_stages)) != len(kl.reference_update_stages):
        add("optimization.kl.reference_update_stages: stages must not repeat")

    lg = config.logging
    for name in ("report_interval",):
        if getattr(lg, name) <= 0:
            add(f"logging.{name}: must be positive, got {getattr(lg, name)}")
    for name in ("validation_interval", "checkpoint_interval"):
        if getattr(lg, name) < 0:
            add(f"logging.{name}: must be >= 0 (0 = off), got {getattr(lg, name)}")
    if lg.keep_last_checkpoints < 1:
        add(f"logging.keep_last_checkpoints: must be >= 1, got {lg.keep_last_checkpoints}")

    for name, source in config.data.items():
        if name in BUILTIN_DATASETS:
            add(f"data.{name}: the name is taken by a built-in dataset")
        if not source.path:
            add(f"data.{name}.path: must not be empty")
        if not 0.0 < source.validation_fraction < 1.0:
            add(f"data.{name}.validation_fraction: must be in (0, 1), got {source.validation_fraction}")
    return problems


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value
