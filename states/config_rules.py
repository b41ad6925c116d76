"""The rules a config must satisfy beyond its types: ranges, cross-field agreement, known names.

`check_config` returns every problem at once, each as 'dotted.path: what is wrong', in field order:
the numbers nothing could hold (`rewind.states.check_types`), the model's shape and the run's seed,
the stages (`rewind.states.check_stages`), training, the optimizer, logging, the data
(`rewind.states.check_data`), and growth, adapters and the objective (`rewind.states.check_growth`).
`rewind.states.config_reading` runs it after the type walk, and the fold's admission runs it on every
config a record carries. Pure (no I/O): configs are checked before torch is ever imported.
"""

from __future__ import annotations

from rewind.states.check_data import data_problems
from rewind.states.check_growth import growth_problems
from rewind.states.check_stages import MAX_TOKENS, stage_problems
from rewind.states.check_types import non_finite_floats, show_int, unrecordable_ints
from rewind.states.config import Config, RopeScalingSection
from rewind.states.stagekinds import strategy_problems
from rewind.states.stagekinds.rules import FLOAT32_MAX


def check_config(config: Config) -> list[str]:
    """Cross-field rules the types cannot express. Returns every problem, in field order."""
    # Said first, once, and before any rule computes with the value (a schedule of such numbers cannot be built).
    non_finite = non_finite_floats(config) + unrecordable_ints(config)
    problems = architecture_problems(config) + stage_problems(config) + strategy_problems(config)
    problems += training_problems(config)
    problems += optimization_problems(config) + logging_problems(config) + data_problems(config)
    problems += growth_problems(config, schedule_ok=not problems and not non_finite)
    # A non-finite or unrecordable value is said once, as such, not again by the range rule it also fails.
    said = {p.split(":")[0] for p in non_finite}
    return non_finite + [p for p in problems if p.split(":")[0] not in said]


def architecture_problems(config: Config) -> list[str]:
    """The model's shape (`architecture`), then `run.seed`."""
    arch, problems = config.architecture, []
    add = problems.append
    for name in ("block_size", "vocab_size", "num_layers", "num_heads", "d_model"):
        if getattr(arch, name) <= 0:
            add(f"architecture.{name}: must be positive, got {getattr(arch, name)}")
    if arch.head_dim < 0:
        add(f"architecture.head_dim: must be >= 0 (0 = d_model / num_heads), got {arch.head_dim}")
    elif arch.head_dim > 0 and arch.head_dim % 2:
        add(f"architecture.head_dim: must be even for RoPE, got {arch.head_dim}")
    elif arch.head_dim == 0 and arch.num_heads > 0 and arch.d_model % arch.num_heads:
        add(f"architecture.d_model: {arch.d_model} is not divisible by num_heads={arch.num_heads}")
    elif arch.head_dim == 0 and arch.num_heads > 0 and (arch.d_model // arch.num_heads) % 2:
        add("architecture.d_model: head size must be even for RoPE")
    if arch.d_ff < 0:
        add(f"architecture.d_ff: must be >= 0 (0 = 4 * d_model), got {arch.d_ff}")
    if not 0.0 <= arch.dropout < 1.0:
        add(f"architecture.dropout: must be in [0, 1), got {arch.dropout}")
    if not arch.rope_base > 0:
        add(f"architecture.rope_base: must be positive, got {arch.rope_base}")
    if arch.num_kv_heads < 0:
        add(f"architecture.num_kv_heads: must be >= 0 (0 = num_heads), got {arch.num_kv_heads}")
    elif arch.num_kv_heads > 0 and arch.num_heads > 0 and arch.num_heads % arch.num_kv_heads:
        add(f"architecture.num_kv_heads: {arch.num_kv_heads} does not divide num_heads={arch.num_heads}")
    if not arch.norm_eps > 0:
        add(f"architecture.norm_eps: must be positive, got {arch.norm_eps}")
    problems += rope_scaling_problems(arch.rope_scaling)
    if not 0 <= config.run.seed < 1 << 64:
        add(f"run.seed: must be in [0, 2**64), got {show_int(config.run.seed)}")
    return problems


def rope_scaling_problems(scaling: RopeScalingSection) -> list[str]:
    """`architecture.rope_scaling`: numbers transformers' formulas can compute with (llama3 divides by
    high_freq_factor - low_freq_factor and by low_freq_factor)."""
    where, problems = "architecture.rope_scaling", []
    for name in ("factor", "low_freq_factor", "original_max_position_embeddings"):
        if not getattr(scaling, name) > 0:
            problems.append(f"{where}.{name}: must be positive, got {getattr(scaling, name)}")
    if not scaling.high_freq_factor > scaling.low_freq_factor:
        problems.append(
            f"{where}.high_freq_factor: must be above low_freq_factor={scaling.low_freq_factor}, "
            f"got {scaling.high_freq_factor}"
        )
    return problems


def training_problems(config: Config) -> list[str]:
    """`training`: the batch and its split, evaluation, and the fade's shape."""
    t, fade, block_size, problems = config.training, config.training.fade, config.architecture.block_size, []
    add = problems.append
    if t.batch_size <= 0:
        add(f"training.batch_size: must be positive, got {t.batch_size}")
    elif block_size > 0 and t.batch_size * block_size > MAX_TOKENS:
        add(
            f"training.batch_size: {t.batch_size} rows of block_size {block_size} are more than 2**53 tokens "
            "per step (the schedule's exact range)"
        )
    if t.per_device_batch_size == 0 or t.per_device_batch_size < -1:
        add(
            f"training.per_device_batch_size: must be -1 (no accumulation) or positive, got {t.per_device_batch_size}"
        )
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
    return problems


def optimization_problems(config: Config) -> list[str]:
    """`optimization`: the LR and its schedule's shares, Adam's constants, decay and clipping."""
    opt, problems = config.optimization, []
    add = problems.append
    if opt.lr <= 0:
        add(f"optimization.lr: must be positive, got {opt.lr}")
    # The optimizer updates float32 weights with the step's LR (lr x its stage's lr_scale): past float32's
    # largest number torch refuses it, a traceback at the first step after RunStarted.
    for name in ("lr", "rewarm_lr"):
        if getattr(opt, name) > FLOAT32_MAX:
            add(
                f"optimization.{name}: must be at most 3.4e38 (the optimizer updates float32 weights with it), "
                f"got {getattr(opt, name)}"
            )
    peak = max(opt.lr, opt.rewarm_lr if opt.schedule == "cosine_rewarm" else 0.0)
    for i, stage in enumerate(config.stages):
        if peak <= FLOAT32_MAX < peak * stage.lr_scale:
            add(
                f"stages[{i}].lr_scale: the learning rate {peak:g} x lr_scale {stage.lr_scale:g} must be at most "
                "3.4e38 (the optimizer updates float32 weights with it)"
            )
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
    return problems


def logging_problems(config: Config) -> list[str]:
    """`logging`: the intervals and how many checkpoints are kept."""
    lg, problems = config.logging, []
    if lg.report_interval <= 0:
        problems.append(f"logging.report_interval: must be positive, got {lg.report_interval}")
    for name in ("validation_interval", "checkpoint_interval"):
        if getattr(lg, name) < 0:
            problems.append(f"logging.{name}: must be >= 0 (0 = off), got {getattr(lg, name)}")
    if lg.keep_last_checkpoints < 1:
        problems.append(f"logging.keep_last_checkpoints: must be >= 1, got {lg.keep_last_checkpoints}")
    return problems
