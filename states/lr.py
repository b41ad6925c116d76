"""Learning-rate schedules as pure functions of (optimization config, step index k, total steps N).

`wsds` (warmup-stable-decay-stable): W = floor(N warmup_pct), D = floor(N decay_pct),
S2 = floor(N constant_pct), S1 = N - W - D - S2. Warmup from a*L to L, stable L, linear decay to b*L,
then stable at b*L (a = warmup_lr_mult, b = decay_lr_mult). `wsd` is the same with S2 = 0.
`cosine`: linear warmup from 0, then cosine from L to m*L (m = min_lr_ratio).
`sgdr`: after warmup, cosine annealing with warm restarts; the first period is `sgdr_period` steps and
each period is twice the previous. `constant`: L.
"""

from __future__ import annotations

import math

from rewind.states.config import OptimizationSection


def lr_at(opt: OptimizationSection, step: int, num_steps: int) -> float:
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
                return base * step / warmup
            span = max(n - warmup, 1)
            progress = min(max((step - warmup) / span, 0.0), 1.0)
            m = opt.min_lr_ratio
            return base * (m + (1.0 - m) * (1.0 + math.cos(math.pi * progress)) / 2.0)
        case "sgdr":
            if step < warmup:
                return base * step / warmup
            into = step - warmup
            period = opt.sgdr_period
            while into >= period:  # periods double, so this loop runs O(log N) times
                into -= period
                period *= 2
            m = opt.min_lr_ratio
            return base * (m + (1.0 - m) * (1.0 + math.cos(math.pi * into / period)) / 2.0)
        case "constant":
            return base
    raise ValueError(f"unknown learning-rate schedule {opt.schedule!r}")


def decay_window(opt: OptimizationSection, num_steps: int) -> tuple[int, int] | None:
    """[first, end) steps of the wsd/wsds decay, or None for schedules without one."""
    if opt.schedule not in ("wsd", "wsds"):
        return None
    warmup = math.floor(num_steps * opt.warmup_pct)
    decay = math.floor(num_steps * opt.decay_pct)
    stable_after = math.floor(num_steps * opt.constant_pct) if opt.schedule == "wsds" else 0
    first = num_steps - decay - stable_after
    return (first, first + decay) if decay > 0 and warmup <= first else None
