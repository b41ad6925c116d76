"""Learning-rate schedules as pure functions of (optimization config, step index k, total steps N).

`wsds` (warmup-stable-decay-stable): W = floor(N warmup_pct), D = floor(N decay_pct),
S2 = floor(N constant_pct), S1 = N - W - D - S2. Warmup from a*L to L, stable L, linear decay to b*L,
then stable at b*L (a = warmup_lr_mult, b = decay_lr_mult). `wsd` is the same with S2 = 0.
`cosine`: linear warmup from a*L, then cosine from L to m*L (m = min_lr_ratio).
`sgdr`: after the same warmup, cosine annealing with warm restarts; the first period is `sgdr_period`
steps and each period is twice the previous. `constant`: L.
`cosine_rewarm` (Gupta et al. 2023): every stage its own curve. Stage i starts at step s_i (the step
that enters it) and ends where stage i + 1 starts (N for the last); its peak P is L in stage 0 and
`rewarm_lr` after. Over its first W_i = max(1, floor(len_i warmup_pct)) steps the LR goes linearly
from m*L to P (from the run's floor, as the ABCD trainer does: its warmup starts at min_lr_mult x lr in
every stage), then falls along a cosine to m*P at the stage's end.

Runs started by releases before the warmup floor warmed cosine and sgdr up from 0 (`L * k / W`, so
their first step trained at LR 0). `warmup_from_zero=True` keeps that formula for them, so they resume
and replay bit for bit; the run's RunStarted says which a run is (see `rewind.states.plan.step_lr`,
which is what the engine trains with, and `rewind.states.schedule.Schedule`, which takes the features of
the run it describes; a schedule for a run not started yet has the floor).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from rewind.states.config import OptimizationSection

ONE_STAGE = (0,)


def lr_at(
    opt: OptimizationSection,
    step: int,
    num_steps: int,
    stage_starts: Sequence[int] = ONE_STAGE,
    *,
    warmup_from_zero: bool = True,
) -> float:
    """The LR of the step with index `step`. `stage_starts` (Schedule.entry_steps: ascending, first 0)
    matters to cosine_rewarm only; `warmup_from_zero` to cosine and sgdr only (see the module doc)."""
    base = opt.lr
    n = num_steps
    warmup = math.floor(n * opt.warmup_pct)
    match opt.schedule:
        case "wsds" | "wsd":
            decay = math.floor(n * opt.decay_pct)
            stable_after = math.floor(n * opt.constant_pct) if opt.schedule == "wsds" else 0
            stable = n - warmup - decay - stable_after
            a, b = opt.warmup_lr_mult, opt.decay_lr_mult
            if step < warmup:
                return base * (a + (1.0 - a) * step / warmup)
            if step < warmup + stable:
                return base
            if step < warmup + stable + decay:
                return base * (1.0 - (1.0 - b) * (step - warmup - stable) / decay)
            return base * b
        case "cosine":
            if step < warmup:
                return _warmup(opt, step, warmup, warmup_from_zero)
            span = max(n - warmup, 1)
            progress = min(max((step - warmup) / span, 0.0), 1.0)
            m = opt.min_lr_ratio
            return base * (m + (1.0 - m) * (1.0 + math.cos(math.pi * progress)) / 2.0)
        case "sgdr":
            if step < warmup:
                return _warmup(opt, step, warmup, warmup_from_zero)
            into = step - warmup
            period = opt.sgdr_period
            while into >= period:  # periods double, so this loop runs O(log N) times
                into -= period
                period *= 2
            m = opt.min_lr_ratio
            return base * (m + (1.0 - m) * (1.0 + math.cos(math.pi * into / period)) / 2.0)
        case "cosine_rewarm":
            return rewarm_lr_at(opt, step, num_steps, stage_starts)
        case "constant":
            return base
    raise ValueError(f"unknown learning-rate schedule {opt.schedule!r}")


def _warmup(opt: OptimizationSection, step: int, warmup: int, from_zero: bool) -> float:
    if from_zero:  # runs started before the warmup floor: their bits depend on this exact form
        return opt.lr * step / warmup
    a = opt.warmup_lr_mult
    return opt.lr * (a + (1.0 - a) * step / warmup)


def stage_span(step: int, num_steps: int, stage_starts: Sequence[int]) -> tuple[int, int, int]:
    """(stage, first step, end step) of the stage the step with index `step` trains in: the last stage
    whose start is <= step (a stage shorter than one step starts where the next does and owns no step).
    O(log num_stages)."""
    stage = max(bisect.bisect_right(stage_starts, step) - 1, 0)
    start = stage_starts[stage]
    end = stage_starts[stage + 1] if stage + 1 < len(stage_starts) else num_steps
    return stage, start, max(end, start + 1)


def rewarm_lr_at(opt: OptimizationSection, step: int, num_steps: int, stage_starts: Sequence[int]) -> float:
    stage, start, end = stage_span(step, num_steps, stage_starts)
    peak = opt.lr if stage == 0 else opt.rewarm_lr
    length = end - start
    warmup = max(1, math.floor(length * opt.warmup_pct))
    m = opt.min_lr_ratio
    into = step - start
    if into < warmup:
        low = m * opt.lr
        return low + (peak - low) * into / warmup
    # By the stage's end (the next stage's first step) the cosine is down at m * peak.
    progress = min((into - warmup) / max(length - warmup, 1), 1.0)
    return peak * (m + (1.0 - m) * (1.0 + math.cos(math.pi * progress)) / 2.0)


def decay_window(opt: OptimizationSection, num_steps: int) -> tuple[int, int] | None:
    """[first, end) steps of the wsd/wsds decay, or None for schedules without one."""
    if opt.schedule not in ("wsd", "wsds"):
        return None
    warmup = math.floor(num_steps * opt.warmup_pct)
    decay = math.floor(num_steps * opt.decay_pct)
    stable_after = math.floor(num_steps * opt.constant_pct) if opt.schedule == "wsds" else 0
    first = num_steps - decay - stable_after
    return (first, first + decay) if decay > 0 and warmup <= first else None
