"""The training schedule as a pure function of (config, tokens consumed).

Stages i = 0..n-1 have budgets T_i; one optimizer step consumes tps = batch_size * block_size tokens and
the run has exactly N = floor(sum T / tps) steps, step k starting at token position x = k * tps.

Fades: boundary j sits at B_j = T_0 + ... + T_j with half-width h_j = o_j * min(T_j, T_j+1) / 2 and ramp
[B_j - h_j, B_j + h_j). Because h_j <= T_j/2 and h_j <= T_j+1/2, the ramps of one stage never overlap, so
at most two stages have weight at any position and the primary stage (argmax, ties to the lower index)
never moves backwards. That is what lets `transition_steps` find every change by bisection instead of
walking a million steps.

Only stages o - 1, o and o + 1 can have weight at x, o the stage whose budget holds x (B_o-1 <= x < B_o):
stage i ends by B_i + h_i <= B_i+1 and starts at B_i-1 - h_i-1 >= B_i-2, and rounding to doubles keeps
both bounds (every B_j is exact). So a query looks at three stages, not n, and building the schedule is
O(n log N), not O(n^2 log N): a run's cost in stages stays linear up to the bound the config check sets.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Collection
from dataclasses import dataclass

from rewind.states.config import Config, GrowthStep
from rewind.states.features import Features
from rewind.states.lr import lr_at


@dataclass(frozen=True, slots=True)
class Ramp:
    boundary: int
    start: float  # token position where the fade begins (inclusive)
    end: float  # token position where it is complete (exclusive)

    @property
    def width(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Everything the schedule says about one optimizer step (index k, starting at `tokens`)."""

    step: int
    tokens: int
    stage: int
    weights: tuple[float, ...]
    rows: tuple[int, ...]
    lr: float
    beta: float


def curve_value(curve: str, t: float, steepness: float) -> float:
    if curve == "linear":
        return t
    if curve == "cosine":
        return (1.0 - math.cos(math.pi * t)) / 2.0
    if curve == "sigmoid":
        z = steepness * (t - 0.5)
        # exp(-z) overflows below z = -709 (a steep curve near the ramp's start); there the value is
        # exp(z) to double precision. Elsewhere the original form, so existing runs keep their bits.
        return math.exp(z) if z < -700.0 else 1.0 / (1.0 + math.exp(-z))
    raise ValueError(f"unknown fade curve {curve!r}")


def allocate_rows(weights: tuple[float, ...] | list[float], num_rows: int) -> tuple[int, ...]:
    """Largest remainder: floor(w_i * rows) each, leftovers to the largest fractional parts, ties to the
    higher index. Always sums to num_rows."""
    exact = [w * num_rows for w in weights]
    counts = [math.floor(e) for e in exact]
    leftover = num_rows - sum(counts)
    if leftover > 0:
        # By fractional part descending, then index descending (ties go to the higher stage index). Only
        # the stages with a fractional part are sorted (at most three of a schedule's); the others all
        # come after them, by index descending.
        whole = [i for i in range(len(weights) - 1, -1, -1) if exact[i] == counts[i]]
        parts = sorted(
            (i for i in range(len(weights)) if exact[i] != counts[i]), key=lambda i: (exact[i] - counts[i], i)
        )
        for i in [*reversed(parts), *whole][:leftover]:
            counts[i] += 1
    return tuple(counts)


class Schedule:
    """Pure, precomputed view of a config's schedule. Built in O(num_stages log num_steps); a query
    about one position is O(log num_stages), one returning a weight or row per stage O(num_stages)."""

    def __init__(self, config: Config, features: Collection[str] | None = None):
        """`features`: the behaviours of the run this schedule is for (RunStarted.features); None for a
        run started today. They decide the LR of old runs' warmups (see rewind.states.lr)."""
        t = config.training
        self.config = config
        self.budgets: tuple[int, ...] = tuple(s.tokens for s in config.stages)
        self.num_stages = len(self.budgets)
        self.tokens_per_step = config.tokens_per_step
        self.total_tokens = sum(self.budgets)
        self.num_steps = self.total_tokens // self.tokens_per_step
        self.curve = t.fade.curve
        self.steepness = t.fade.steepness
        self.betas: tuple[float, ...] = tuple(s.beta or 0.0 for s in config.stages)
        self.reference_update_stages = frozenset(i for i, s in enumerate(config.stages) if s.refresh_reference)
        self.optimizer_reset_stages = frozenset(i for i, s in enumerate(config.stages) if s.reset_optimizer)
        # B_j = T_0 + ... + T_j; the last one is the total.
        self.boundaries: tuple[int, ...] = tuple(itertools.accumulate(self.budgets))
        overlaps = [config.fade_overlap(j) for j in range(self.num_stages - 1)]
        self.ramps: tuple[Ramp, ...] = tuple(
            Ramp(
                boundary=j,
                start=self.boundaries[j] - overlaps[j] * min(self.budgets[j], self.budgets[j + 1]) / 2,
                end=self.boundaries[j] + overlaps[j] * min(self.budgets[j], self.budgets[j + 1]) / 2,
            )
            for j in range(self.num_stages - 1)
        )
        self.fades: tuple[Ramp, ...] = tuple(r for r in self.ramps if r.width > 0)
        # Both non-decreasing (a fade ends before the next one starts, see the module doc): which fades
        # are due at a step is a bisection (rewind.states.plan.fade_due).
        self.fade_boundaries: list[int] = [r.boundary for r in self.fades]
        self.fade_start_steps: tuple[int, ...] = tuple(self.fade_start_step(r) for r in self.fades)
        self.fade_end_steps: tuple[int, ...] = tuple(self.fade_end_step(r) for r in self.fades)
        # entry_steps[i]: first step whose primary stage is >= i (num_steps if the run ends first).
        self.entry_steps: tuple[int, ...] = (0, *(self.stage_entry_step(i) for i in range(1, self.num_stages)))
        # growth_steps[i]: the step before which config.growth[i] joins (join_step).
        self.growth_steps: tuple[int, ...] = tuple(self.join_step(g) for g in config.growth)
        self._transition_steps = self._find_transition_steps()
        self.warmup_from_zero = features is not None and not Features.of(features).lr_warmup_floor
        # Steps at which an optimizer reset restarts the LR curve (reset_restarts_lr): the entries of the
        # reset stages. What `rewind.states.plan.step_lr` gives a run that never changed its config.
        opt = config.optimization
        restarts = {self.entry_steps[s] for s in self.optimizer_reset_stages if s > 0}
        self.lr_restarts: tuple[int, ...] = tuple(sorted(restarts)) if opt.reset_restarts_lr else ()

    # --- positions and steps -------------------------------------------------------------------
    def step_of(self, tokens: float) -> int:
        """First step whose start position is >= tokens."""
        return max(0, math.ceil(tokens / self.tokens_per_step))

    def tokens_of(self, step: int) -> int:
        return step * self.tokens_per_step

    # --- fade weights ----------------------------------------------------------------------------
    def raw_weight(self, stage: int, x: float) -> float:
        fade_in = self.ramps[stage - 1] if stage > 0 else None
        fade_out = self.ramps[stage] if stage < self.num_stages - 1 else None
        start = fade_in.start if fade_in else 0.0
        end = fade_out.end if fade_out else float(self.total_tokens)
        if x < start or x >= end:
            return 0.0
        weight = 1.0
        if fade_in is not None and x < fade_in.end:
            weight = min(weight, self._ramp_value(fade_in, x))
        if fade_out is not None and x >= fade_out.start:
            weight = min(weight, 1.0 - self._ramp_value(fade_out, x))
        return weight

    def _ramp_value(self, ramp: Ramp, x: float) -> float:
        return curve_value(self.curve, (x - ramp.start) / ramp.width, self.steepness)

    def weighted_stages_at(self, x: float) -> tuple[range, tuple[float, ...]]:
        """(stages, their weights) at x: the stages that can have weight there (see the module doc), in
        order; every other stage's weight is exactly 0."""
        owner = bisect.bisect_right(self.boundaries, x)
        stages = range(max(owner - 1, 0), min(owner + 2, self.num_stages))
        raw = [self.raw_weight(i, x) for i in stages]
        total = sum(raw)  # the sum over all stages: adding their zeros changes no bit
        if total <= 0.0:
            # Past the end (or in a degenerate gap): the stage owning x, else the last, gets it all.
            owner = owner if owner < self.num_stages else self.num_stages - 1
            return range(owner, owner + 1), (1.0,)
        return stages, tuple(w / total for w in raw)

    def weights_at(self, x: float) -> tuple[float, ...]:
        stages, weights = self.weighted_stages_at(x)
        out = [0.0] * self.num_stages
        out[stages.start : stages.stop] = weights
        return tuple(out)

    def primary_at(self, x: float) -> int:
        stages, weights = self.weighted_stages_at(x)
        return stages[weights.index(max(weights))]  # the lowest index among ties

    # --- per step --------------------------------------------------------------------------------
    def weights(self, step: int) -> tuple[float, ...]:
        return self.weights_at(self.tokens_of(step))

    def rows(self, step: int) -> tuple[int, ...]:
        return allocate_rows(self.weights(step), self.config.training.batch_size)

    def primary(self, step: int) -> int:
        return self.primary_at(self.tokens_of(step))

    def lr(self, step: int) -> float:
        restart = bisect.bisect_right(self.lr_restarts, step)
        count = step - self.lr_restarts[restart - 1] if restart else step
        curve = lr_at(
            self.config.optimization, count, self.num_steps, self.entry_steps, warmup_from_zero=self.warmup_from_zero
        )
        return curve * self.lr_scale(step)

    def lr_scale(self, step: int) -> float:
        """The step's primary stage's `lr_scale` (1.0 unless a stage sets it: x 1.0 changes no bit)."""
        return self.config.stages[self.primary(step)].lr_scale if self.config.stages else 1.0

    def beta(self, step: int) -> float:
        return self.betas[self.primary(step)]

    def step_plan(self, step: int) -> StepPlan:
        weights = self.weights(step)
        stage = weights.index(max(weights))
        return StepPlan(
            step=step,
            tokens=self.tokens_of(step),
            stage=stage,
            weights=weights,
            rows=allocate_rows(weights, self.config.training.batch_size),
            lr=self.lr(step),
            beta=self.betas[stage],
        )

    # --- where things change ---------------------------------------------------------------------
    def join_step(self, growth: GrowthStep) -> int:
        """The step before which a growth happens: its stage's entry, or the first step starting at or
        after its token count."""
        if growth.at_stage >= 0:
            return self.entry_steps[growth.at_stage]
        return self.step_of(growth.at_tokens)

    def stage_entry_step(self, stage: int) -> int:
        """First step (<= num_steps) whose primary stage is >= `stage`; num_steps if none is."""
        lo, hi = 0, self.num_steps
        while lo < hi:  # primary is non-decreasing in the step (see module docstring)
            mid = (lo + hi) // 2
            if self.primary(mid) >= stage:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def fade_start_step(self, ramp: Ramp) -> int:
        return min(self.step_of(ramp.start), self.num_steps)

    def fade_end_step(self, ramp: Ramp) -> int:
        return min(self.step_of(ramp.end), self.num_steps)

    def _find_transition_steps(self) -> list[int]:
        steps = {0, self.num_steps, *self.entry_steps, *self.growth_steps}
        for ramp in self.fades:
            steps.add(self.fade_start_step(ramp))
            steps.add(self.fade_end_step(ramp))
        return sorted(steps)

    def next_transition_step(self, step: int) -> int:
        """Smallest step >= `step` at which a control event may be due (the end at the latest)."""
        i = bisect.bisect_left(self._transition_steps, step)
        return self._transition_steps[i] if i < len(self._transition_steps) else self.num_steps

    def stage_tokens(self) -> list[int]:
        """Tokens actually trained per primary stage (whole steps), for the dry-run summary."""
        entries = [*self.entry_steps, self.num_steps]
        return [
            max(0, entries[i + 1] - entries[i]) * self.tokens_per_step for i in range(self.num_stages)
        ]
