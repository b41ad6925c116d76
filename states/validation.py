"""The rules a config must satisfy beyond its types: ranges, cross-field agreement, known names.

`check_config` returns every problem at once, each as 'dotted.path: what is wrong', in field order;
`rewind.states.config` runs it after the type walk. Pure (no I/O): configs are checked before torch is
ever imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rewind.states.config import Config

# Embedded synthetic datasets the engine generates in code (no download). Their names live here so
# that a config can be validated without importing torch; the engine's registry asserts it matches.
BUILTIN_DATASETS: tuple[str, ...] = ("grammar", "reverse", "sort", "add")


def non_finite_floats(value, path: str = "") -> list[str]:
    """'path: must be a finite number, got nan' for every NaN or infinity anywhere in the config: a
    comparison with NaN is always false, so no range rule below would ever catch one."""
    import math

    import msgspec

    if isinstance(value, float):
        return [] if math.isfinite(value) else [f"{path}: must be a finite number, got {value}"]
    if isinstance(value, msgspec.Struct):
        return [p for f in msgspec.structs.fields(value) for p in non_finite_floats(getattr(value, f.name), _join(path, f.encode_name))]
    if isinstance(value, list | tuple):
        return [p for i, item in enumerate(value) for p in non_finite_floats(item, f"{path}[{i}]")]
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in non_finite_floats(item, _join(path, str(key)))]
    return []


# The log is msgpack, whose integers are 64-bit: a config value beyond them cannot be recorded, and torch's
# integers are int64. run.seed has a rule of its own (unsigned, below 2**64).
INT64_RANGE = (-(1 << 63), 1 << 63)
OWN_INT_RULES = frozenset({"run.seed"})
# Token positions: the schedule places tokens as floats (fade ramps, steps of a position), exact only
# below 2**53 (9.0e15 tokens, far past any run), so no budget, nor their sum, nor a step may pass it.
MAX_TOKENS = 1 << 53
# Stages: far more than any curriculum has, few enough that what grows with them stays small (each step
# records a row count per stage; a dry-run or fold of the whole schedule takes well under a second).
MAX_STAGES = 1000


def unrecordable_ints(value, path: str = "") -> list[str]:
    """'path: must fit a signed 64-bit integer, ...' for every integer anywhere in the config that the
    log (msgpack) or torch could not hold: nothing after the check could record or compute with it."""
    import msgspec

    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        if path in OWN_INT_RULES or INT64_RANGE[0] <= value < INT64_RANGE[1]:
            return []
        return [f"{path}: must fit a signed 64-bit integer (the log's integers), got {show_int(value)}"]
    if isinstance(value, msgspec.Struct):
        return [p for f in msgspec.structs.fields(value) for p in unrecordable_ints(getattr(value, f.name), _join(path, f.encode_name))]
    if isinstance(value, list | tuple):
        return [p for i, item in enumerate(value) for p in unrecordable_ints(item, f"{path}[{i}]")]
    if isinstance(value, dict):
        return [p for key, item in value.items() for p in unrecordable_ints(item, _join(path, str(key)))]
    return []


def show_int(value: int) -> str:
    """An integer as a message shows it: whole when short, else its size (never thousands of digits)."""
    import math

    if abs(value) < 10**30:
        return str(value)
    return f"a {'negative ' if value < 0 else ''}number of about {int(math.log10(abs(value))) + 1} digits"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def stage_problems(config: Config) -> list[str]:
    """Each `[[stages]]` record's problems (`stages[2].beta: ...`), then those of the stages together."""
    stages, known = config.stages, config.dataset_names()
    problems: list[str] = []
    add = problems.append
    if not stages:
        add("stages: expected at least one stage ([[stages]] with its tokens and datasets), got none")
    elif len(stages) > MAX_STAGES:
        add(f"stages: at most {MAX_STAGES:,} stages (one budget each), got {len(stages):,}")
    for i, stage in enumerate(stages):
        at = f"stages[{i}]"
        if stage.tokens <= 0:
            add(f"{at}.tokens: stage budget must be positive, got {stage.tokens}")
        elif stage.tokens > MAX_TOKENS:
            add(f"{at}.tokens: at most 2**53 tokens (the schedule's exact range), got {show_int(stage.tokens)}")
        if not stage.datasets:
            add(f"{at}.datasets: a stage needs at least one dataset")
        for j, sampling in enumerate(stage.datasets):
            if sampling.name not in known:
                known_names = ", ".join(sorted(known))
                add(f"{at}.datasets[{j}].name: unknown dataset {sampling.name!r} (known: {known_names})")
            if sampling.rate <= 0:
                add(f"{at}.datasets[{j}].rate: must be positive, got {sampling.rate}")
        if stage.datasets and abs((total := sum(s.rate for s in stage.datasets)) - 1.0) > 1e-6:
            add(f"{at}.datasets: rates must sum to 1, got {total:g}")
        if stage.beta is not None and stage.beta < 0:
            add(f"{at}.beta: must be >= 0, got {stage.beta}")
        if stage.overlap is not None and not 0.0 <= stage.overlap <= 1.0:
            add(f"{at}.overlap: must be in [0, 1], got {stage.overlap}")
        if stage.overlap is not None and i == len(stages) - 1:
            add(f"{at}.overlap: the last stage has no next stage to fade into")
        if stage.reset_optimizer and i == 0:
            add(f"{at}.reset_optimizer: stage 0 has no moments to clear (the optimizer starts empty)")
        if stage.name and stage.name in (s.name for s in stages[:i]):
            add(f"{at}.name: {stage.name!r} names an earlier stage too (growth steps name stages by it)")
    budgets = [s.tokens for s in stages]
    if all(0 < budget <= MAX_TOKENS for budget in budgets) and (total := sum(budgets)) > MAX_TOKENS:
        add(f"stages: the stage budgets sum to {total:,} tokens, more than 2**53 (the schedule's exact range)")
    return problems


def check_config(config: Config) -> list[str]:
    """Cross-field rules the types cannot express. Returns every problem, in field order."""
    # Said first, once, and before any rule computes with the value (a schedule of such numbers cannot be built).
    non_finite = non_finite_floats(config) + unrecordable_ints(config)
    problems: list[str] = []
    t, fade, opt, arch = config.training, config.training.fade, config.optimization, config.architecture
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
    if not arch.rope_base > 0:
        add(f"architecture.rope_base: must be positive, got {arch.rope_base}")
    if not 0 <= config.run.seed < 1 << 64:
        add(f"run.seed: must be in [0, 2**64), got {show_int(config.run.seed)}")

    problems += stage_problems(config)
    if t.batch_size <= 0:
        add(f"training.batch_size: must be positive, got {t.batch_size}")
    elif arch.block_size > 0 and t.batch_size * arch.block_size > MAX_TOKENS:
        add(
            f"training.batch_size: {t.batch_size} rows of block_size {arch.block_size} are more than 2**53 tokens "
            "per step (the schedule's exact range)"
        )
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

    known = config.dataset_names()
    for j, name in enumerate(t.evaluations):
        if name not in known:
            add(f"training.evaluations[{j}]: unknown dataset {name!r}")

    if not 0.0 <= fade.overlap <= 1.0:
        add(f"training.fade.overlap: must be in [0, 1], got {fade.overlap}")
    if fade.steepness <= 0:
        add(f"training.fade.steepness: must be positive, got {fade.steepness}")
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
    if not opt.rewarm_lr > 0:
        add(f"optimization.rewarm_lr: must be positive, got {opt.rewarm_lr}")
    for name in ("beta1", "beta2"):
        if not 0.0 <= getattr(opt, name) < 1.0:
            add(f"optimization.{name}: must be in [0, 1), got {getattr(opt, name)}")
    if not opt.eps > 0:
        add(f"optimization.eps: must be positive, got {opt.eps}")
    if opt.weight_decay < 0:
        add(f"optimization.weight_decay: must be >= 0, got {opt.weight_decay}")
    if opt.grad_clip < 0:
        add(f"optimization.grad_clip: must be >= 0 (0 = off), got {opt.grad_clip}")

    lg = config.logging
    for name in ("report_interval",):
        if getattr(lg, name) <= 0:
            add(f"logging.{name}: must be positive, got {getattr(lg, name)}")
    for name in ("validation_interval", "checkpoint_interval"):
        if getattr(lg, name) < 0:
            add(f"logging.{name}: must be >= 0 (0 = off), got {getattr(lg, name)}")
    if lg.keep_last_checkpoints < 1:
        add(f"logging.keep_last_checkpoints: must be >= 1, got {lg.keep_last_checkpoints}")

    from rewind.states.data_checks import data_problems

    problems += data_problems(config, BUILTIN_DATASETS)
    from rewind.states.growth_checks import growth_problems  # (it builds schedules, which need this module)

    problems += growth_problems(config, schedule_ok=not problems and not non_finite)
    # A non-finite or unrecordable value is said once, as such, not again by the range rule it also fails.
    said = {p.split(":")[0] for p in non_finite}
    return non_finite + [p for p in problems if p.split(":")[0] not in said]
