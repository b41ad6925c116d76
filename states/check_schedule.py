"""`schedule_warnings(config)`: a legal schedule that is probably not what its author meant.

Backs `rewind schedule CONFIG --check`. Each warning names the stage (or the LR decay) and the figures,
read off the `Schedule` the run will follow: a stage shorter than one step, a KL weight before any
reference refresh, fades covering most of a stage, a budget mostly lost to rounding to whole steps, an
LR decay that ends far from every stage entry, a first step (or a restart) at LR 0, an LR restart that
leaves the run ending far above the curve's end, a warmup the constant schedule ignores (only a
warmup_pct the config wrote: `written_fields`). None of them stops a run. LRs are those of a run
started by this release (`rewind.states.plan.step_lr`).

Whether the schedule code itself keeps the spec's invariants is not a question for a user's config:
the tests answer it, with an independent re-derivation (`tests/states/schedule_oracle.py`) checked over
generated configs.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from rewind.states.config import Config, OptimizationSection
from rewind.states.lr import decay_window, lr_at
from rewind.states.overrides import apply_overrides, read_toml
from rewind.states.schedule import Schedule
from rewind.states.stageform import flat_for_overrides

FADED_SHARE = 0.75  # more of a stage's budget than this inside its fades is worth a warning
DECAY_GAP_SHARE = 0.1  # an LR decay ending further than this share of the run from every stage entry
RESTART_END_FACTOR = 1.5  # a restarted LR ending above this multiple of the unbroken curve's end


def written_fields(text: str, overrides: list[str] | None = None) -> frozenset[str]:
    """The dotted paths of the tables' keys a config's TOML `text` and its `--set` overrides write
    ("optimization.warmup_pct"; lists are not entered): what its author chose, as against a default the
    struct fills in. The text is one `loads_config` accepted."""
    raw = read_toml(text)
    if overrides:
        raw = apply_overrides(flat_for_overrides(raw, overrides), overrides)

    def paths(table: dict[str, Any], prefix: str) -> list[str]:
        found = []
        for key, value in table.items():
            found.append(prefix + key)
            if isinstance(value, dict):
                found += paths(value, f"{prefix}{key}.")
        return found

    return frozenset(paths(raw, ""))


def schedule_warnings(
    config: Config, schedule: Schedule | None = None, written: Collection[str] | None = None
) -> list[str]:
    """Legal but suspicious choices, each naming the stage or boundary and the figures. `written`: the
    fields the config's author wrote (`written_fields`), for the warnings about a setting that has no
    effect; None when unknown (a config built in code): a value other than the default counts as written."""
    schedule, warnings = schedule or Schedule(config), []
    tps, n = schedule.tokens_per_step, schedule.num_steps
    if n == 0:
        warnings.append(f"the run has no steps: its {schedule.total_tokens} tokens are less than one step")
    refreshed = sorted(schedule.reference_update_stages)
    trained = schedule.stage_tokens()
    faded = _faded_tokens(schedule)
    for i, budget in enumerate(schedule.budgets):
        if budget < tps:
            warnings.append(
                f"stage {i}: its budget of {budget} tokens is shorter than one step ({tps} tokens): entered at "
                f"step {schedule.entry_steps[i]}, it is the primary stage of {trained[i] // tps} step(s)"
            )
        beta = schedule.betas[i]
        if beta > 0 and not any(r <= i for r in refreshed):
            warnings.append(
                f"stage {i}: KL weight {beta} > 0 but no reference refresh happens at or before it "
                f"(stages refreshing the reference: {refreshed})"
            )
        inside, boundaries = faded[i]
        if inside > FADED_SHARE * budget:
            warnings.append(
                f"stage {i}: {inside:g} of its {budget} tokens ({inside / budget:.0%}) lie inside the fades of "
                f"boundaries {boundaries}, more than {FADED_SHARE:.0%}"
            )
        lost = budget - trained[i]
        if lost > tps:
            warnings.append(
                f"stage {i}: budget {budget} tokens, but only {trained[i] // tps} step(s) ({trained[i]} tokens) have "
                f"it as the primary stage: {lost} tokens ({lost / tps:.2f} steps) lost to rounding to whole steps"
            )
    window = decay_window(config.optimization, n)
    if window is not None and n > 0:
        nearest = min([*schedule.entry_steps[1:], n], key=lambda s: abs(s - window[1]))
        if (gap := abs(nearest - window[1])) > DECAY_GAP_SHARE * n:
            warnings.append(
                f"the LR decay (steps {window[0]}..{window[1]}) ends {gap} steps ({gap / n:.0%} of the run) "
                f"from the nearest stage entry or the end (step {nearest})"
            )
    return warnings + _lr_warnings(config, schedule, written)


def _lr_warnings(config: Config, schedule: Schedule, written: Collection[str] | None) -> list[str]:
    opt, n = config.optimization, schedule.num_steps
    if n == 0:
        return []

    def lr(count: int) -> float:
        return lr_at(opt, count, n, schedule.entry_steps, warmup_from_zero=False)

    warnings = []
    if written is None:
        wrote_warmup = opt.warmup_pct != OptimizationSection().warmup_pct
    else:
        wrote_warmup = "optimization.warmup_pct" in written
    if opt.schedule == "constant" and opt.warmup_pct > 0 and wrote_warmup:
        warnings.append(
            f"optimization.warmup_pct: {opt.warmup_pct:g} is ignored by the constant schedule (every step trains at "
            'lr); for a warmup to a constant LR, use schedule = "wsd" with decay_pct = 0'
        )
    restarts = opt.reset_restarts_lr and schedule.optimizer_reset_stages
    if lr(0) == 0.0:
        why = "min_lr_ratio" if opt.schedule == "cosine_rewarm" else "warmup_lr_mult"
        warnings.append(
            f"the first step trains at LR 0 ({opt.schedule} starts at {why} = 0 x its peak)"
            + (", and so does the first step after every optimizer reset" if restarts else "")
            + f": that step's data is spent on no update; a small {why} (e.g. 0.01) avoids it"
        )
    if restarts:
        last = max(schedule.entry_steps[s] for s in schedule.optimizer_reset_stages)
        if last < n:
            restarted, unbroken = lr(n - 1 - last), lr(n - 1)
            if restarted > RESTART_END_FACTOR * unbroken:
                warnings.append(
                    f"optimization.reset_restarts_lr: the LR restarts from the schedule's step 0 at step {last}, so "
                    f"the run ends at LR {restarted:.3g} where the unbroken curve ends at {unbroken:.3g}"
                )
    return warnings


def _faded_tokens(schedule: Schedule) -> list[tuple[float, list[int]]]:
    """Per stage: how many of its tokens lie inside the fade ramps at its two ends (the half of each
    ramp on its side of the boundary), and which boundaries those fades belong to."""
    faded: list[tuple[float, list[int]]] = [(0.0, []) for _ in schedule.budgets]
    for ramp in schedule.fades:
        j, at = ramp.boundary, schedule.boundaries[ramp.boundary]
        for stage, part in ((j, at - ramp.start), (j + 1, ramp.end - at)):
            inside, boundaries = faded[stage]
            faded[stage] = (inside + part, [*boundaries, j])
    return faded
