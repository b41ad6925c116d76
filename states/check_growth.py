"""The rules a growth plan, its adapters and the training objective must satisfy, as config problems.

Called by `rewind.states.config_rules.check_config`, so a plan that cannot fit (a join past the end, two
growths at one step, a copy of more blocks than exist, a rank table that disagrees with the number of
stacks, full training of a quantised stack) is reported before anything runs, each problem naming its
field path. The plan is checked by performing it: every growth's event is built and folded into the
layout, exactly as the run will do it, so a rule the fold enforces cannot be missed here.
"""

from __future__ import annotations

from rewind.states.config import Config
from rewind.states.growth import GrowthError, caches_trunk, grown_layout, growth_event, initial_layout
from rewind.states.schedule import Schedule

LORA_TARGETS = ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")


def growth_problems(config: Config, schedule_ok: bool) -> list[str]:
    """Every problem with config.growth, config.lora and config.objective. `schedule_ok`: the rest of the
    config is sound enough to build its schedule (join steps are checked only then)."""
    lora = _lora_problems(config)
    problems = lora + _objective_problems(config)
    # A plan is performed only when its entries and the ranks it needs are sound: other problems (an
    # unknown LoRA target, say) do not hide its own.
    blocking = [p for p in lora if not p.startswith("lora.targets")]
    n = config.num_stages
    entries: list[str] = []
    for i, spec in enumerate(config.growth):
        at = f"growth[{i}]"
        given = (spec.at_stage >= 0) + (spec.at_tokens >= 0)
        if given != 1:
            entries.append(f"{at}: give exactly one of at_stage and at_tokens")
        if spec.at_stage >= 0 and not 0 < spec.at_stage < max(n, 1):
            entries.append(
                f"{at}.at_stage: stage {spec.at_stage} is out of range 1..{n - 1} (stage 0 is the initial model)"
            )
        if spec.num_blocks <= 0:
            entries.append(f"{at}.num_blocks: must be positive, got {spec.num_blocks}")
        if spec.anchor and spec.position != "prepend":
            entries.append(
                f"{at}.anchor: only a prepended stack can keep the head fixed (the loss flows through it)"
            )
        if spec.init == "identity" and spec.precision == "nf4":
            entries.append(
                f"{at}.init: identity needs exact zeros in the new output projections, which nf4 cannot hold"
            )
    problems += entries
    if entries or blocking or not schedule_ok:
        return problems
    return problems + _plan_problems(config)


def _plan_problems(config: Config) -> list[str]:
    """Perform the plan on layouts: join steps in order and inside the run, each growth foldable."""
    schedule = Schedule(config)
    problems: list[str] = []
    layout = initial_layout(config.architecture.num_layers)
    previous = 0
    for i, spec in enumerate(config.growth):
        at = f"growth[{i}]"
        step = schedule.growth_steps[i]
        field = "at_stage" if spec.at_stage >= 0 else "at_tokens"
        if not 0 < step < schedule.num_steps:
            problems.append(
                f"{at}.{field}: joins at step {step}, outside the run's steps 1..{schedule.num_steps - 1}"
            )
        elif step <= previous and i > 0:
            problems.append(
                f"{at}.{field}: joins at step {step}, not after growth[{i - 1}] (step {previous})"
            )
        previous = step
        try:
            layout = grown_layout(
                layout, growth_event(config, i, layout, step, step * schedule.tokens_per_step)
            )
        except GrowthError as exc:
            problems.append(f"{at}: {exc}")
            break
        except IndexError:  # a rank table too short for this stack id: said once, below
            break
        if spec.cache == "on" and not caches_trunk(config, layout):
            problems.append(
                f"{at}.cache: on, but the trunk's outputs cannot be cached here (only an appended stack on a "
                'wholly frozen trunk, with objective.kind = "clm")'
            )
    return problems


def _lora_problems(config: Config) -> list[str]:
    lora, problems = config.lora, []
    for name in ("rank", "trunk_rank"):
        if getattr(lora, name) <= 0:
            problems.append(f"lora.{name}: must be positive, got {getattr(lora, name)}")
    if not lora.alpha_per_rank > 0:
        problems.append(f"lora.alpha_per_rank: must be positive, got {lora.alpha_per_rank}")
    if not lora.targets:
        problems.append(f"lora.targets: name at least one of {', '.join(LORA_TARGETS)}")
    for j, target in enumerate(lora.targets):
        if target not in LORA_TARGETS:
            problems.append(f"lora.targets[{j}]: unknown layer {target!r} (known: {', '.join(LORA_TARGETS)})")
    if len(set(lora.targets)) != len(lora.targets):
        problems.append("lora.targets: layers must not repeat")
    num_stacks = 1 + len(config.growth)
    if lora.pattern == "table" and len(lora.ranks) != num_stacks:
        problems.append(
            f"lora.ranks: the table needs one rank per stack ({num_stacks}: the initial one and "
            f"{len(config.growth)} grown), got {len(lora.ranks)}"
        )
    if lora.pattern != "table" and lora.ranks:
        problems.append(f'lora.ranks: only read with pattern = "table" (pattern is {lora.pattern!r})')
    for j, rank in enumerate(lora.ranks):
        if rank <= 0:
            problems.append(f"lora.ranks[{j}]: must be positive, got {rank}")
    return problems


def _objective_problems(config: Config) -> list[str]:
    objective, problems = config.objective, []
    if not 0.0 < objective.mask_rate <= 1.0:
        problems.append(f"objective.mask_rate: must be in (0, 1], got {objective.mask_rate}")
    if objective.num_levels < 2:
        problems.append(f"objective.num_levels: needs at least 2 levels, got {objective.num_levels}")
    for name in ("min_mask_rate", "max_mask_rate"):
        if not 0.0 < getattr(objective, name) <= 1.0:
            problems.append(f"objective.{name}: must be in (0, 1], got {getattr(objective, name)}")
    if objective.kind != "clm" and config.training.evaluations:
        problems.append(
            f"training.evaluations: answer accuracy is next-token prediction, which a {objective.kind} "
            'model (bidirectional) does not do: leave evaluations empty or use objective.kind = "clm"'
        )
    if objective.kind != "clm" and config.logging.validation_interval:
        problems.append(
            f"logging.validation_interval: validation measures next-token loss, not the {objective.kind} "
            "objective: set it to 0"
        )
    if objective.min_mask_rate > objective.max_mask_rate:
        problems.append(
            f"objective.min_mask_rate: {objective.min_mask_rate} is above max_mask_rate={objective.max_mask_rate}"
        )
    return problems
