"""The rules for the stages: each `[[stages]]` record on its own (its budget, mixture, beta, fade and
what entering it does), then the stages together (how many, their budgets' sum, their names).

Problems name the record's field (`stages[2].beta: ...`); a config written with the flat lists has
them renamed to the entry the user wrote (`rewind.states.stageform.flat_path`). Called by
`rewind.states.config_rules.check_config`.
"""

from __future__ import annotations

from rewind.states.check_types import show_int
from rewind.states.config import Config, Stage

# Token positions: the schedule places tokens as floats (fade ramps, steps of a position), exact only
# below 2**53 (9.0e15 tokens, far past any run), so no budget, nor their sum, nor a step may pass it.
MAX_TOKENS = 1 << 53
# Stages: far more than any curriculum has, few enough that what grows with them stays small (each step
# records a row count per stage; a dry-run or fold of the whole schedule takes well under a second).
MAX_STAGES = 1000


def stage_problems(config: Config) -> list[str]:
    """Each `[[stages]]` record's problems (`stages[2].beta: ...`), then those of the stages together."""
    stages, known = config.stages, config.dataset_names()
    problems: list[str] = []
    if not stages:
        problems.append(
            "stages: expected at least one stage ([[stages]] with its tokens and datasets), got none"
        )
    elif len(stages) > MAX_STAGES:
        problems.append(f"stages: at most {MAX_STAGES:,} stages (one budget each), got {len(stages):,}")
    for i, stage in enumerate(stages):
        problems += record_problems(stage, i, len(stages), known)
        if stage.name and stage.name in (s.name for s in stages[:i]):
            problems.append(
                f"stages[{i}].name: {stage.name!r} names an earlier stage too (growth steps name stages by it)"
            )
    budgets = [s.tokens for s in stages]
    if all(0 < budget <= MAX_TOKENS for budget in budgets) and (total := sum(budgets)) > MAX_TOKENS:
        problems.append(
            f"stages: the stage budgets sum to {total:,} tokens, more than 2**53 (the schedule's exact range)"
        )
    return problems


def record_problems(stage: Stage, i: int, num_stages: int, known: set[str]) -> list[str]:
    """The problems of stage `i` (of `num_stages`) on its own, `known` the dataset names it may use."""
    at, problems = f"stages[{i}]", []
    add = problems.append
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
    if stage.overlap is not None and i == num_stages - 1:
        add(f"{at}.overlap: the last stage has no next stage to fade into")
    if not stage.lr_scale > 0:
        add(f"{at}.lr_scale: must be positive, got {stage.lr_scale}")
    if stage.reset_optimizer and i == 0:
        add(f"{at}.reset_optimizer: stage 0 has no moments to clear (the optimizer starts empty)")
    return problems
