"""The schedule oracle: the spec's invariants, re-derived independently of `rewind.states.schedule`.

`check_schedule(config)` recomputes what the spec (docs/schedule.md) defines -- boundaries, ramps,
fade weights, rows, LR, KL weight, the control events and when they fall -- from the config alone,
sharing no code with `Schedule`, and compares it with what `Schedule.step_plan` and `plan` produce. A
violation means the schedule code disagrees with the spec. This is a test helper: the property tests
in `test_checks.py` run it over generated configs, and break the code on purpose to see that it notices.
(What a user gets from `rewind schedule --check` is the warnings in `rewind.states.check_schedule`.)

Every step is checked when N <= 200_000. Beyond, a 1M-step config is sampled to keep the tests quick:
every step near a change (entries, ramp edges, LR phases), every fade step while the fades are short
(a stride inside long ones) and a regular stride elsewhere; entries and hard switches stay exact.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field

import rewind.states.plan as planning
from rewind.states.config import Config
from rewind.states.events import Event, FadeEnded, FadeStarted, ReferenceRefreshed, RunFinished, StageEntered
from rewind.states.fold import IllegalTransition, fold
from rewind.states.lr import decay_window
from rewind.states.schedule import Schedule
from rewind.states.state import State

EXHAUSTIVE_MAX_STEPS = 200_000
# Sampling budget of a long run in stage-steps (a step costs O(num_stages)): 3/4 inside the fades
# (every fade step if they are short enough), 1/4 as an even stride across the whole run.
SAMPLE_BUDGET = 400_000
EDGE_RADIUS = 32  # steps checked on each side of a landmark in a long run
MAX_RESUME_CUTS = 200
MAX_EXAMPLES = 5  # messages kept per invariant; the rest are counted
TOLERANCE = 1e-9


@dataclass(frozen=True)
class OracleReport:
    violations: list[str] = field(default_factory=list)
    num_steps: int = 0
    num_steps_checked: int = 0  # == num_steps when every step was checked

    @property
    def ok(self) -> bool:
        return not self.violations


class _Findings:
    """Violations grouped by invariant: a broken rule usually breaks at every step, so keep a few."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.counts: Counter[str] = Counter()

    def add(self, invariant: str, message: str) -> None:
        self.counts[invariant] += 1
        if self.counts[invariant] <= MAX_EXAMPLES:
            self.messages.append(f"{invariant}: {message}")

    def lines(self) -> list[str]:
        more = [
            f"{inv}: ... and {c - MAX_EXAMPLES} more" for inv, c in self.counts.items() if c > MAX_EXAMPLES
        ]
        return self.messages + more


class _Spec:
    """The schedule's figures straight from the spec's formulas, sharing no code with `Schedule`."""

    def __init__(self, config: Config):
        t, opt = config.training, config.optimization
        stages = config.stages
        self.budgets = [s.tokens for s in stages]
        self.num_stages = len(self.budgets)
        self.batch_size = t.batch_size
        self.tps = config.tokens_per_step
        self.num_steps = sum(self.budgets) // self.tps
        self.boundaries = [sum(self.budgets[: i + 1]) for i in range(self.num_stages)]
        self.overlaps = [t.fade.overlap if s.overlap is None else s.overlap for s in stages[:-1]]
        self.half_widths = [
            self.overlaps[j] * min(self.budgets[j], self.budgets[j + 1]) / 2
            for j in range(self.num_stages - 1)
        ]
        # Fading boundaries only: (boundary, start, end) with end > start, ascending and disjoint.
        self.ramps = [
            (j, b - h, b + h)
            for j, (b, h) in enumerate(zip(self.boundaries[:-1], self.half_widths, strict=True))
            if b + h > b - h
        ]
        self.ramp_starts = [start for _, start, _ in self.ramps]
        self.curve_name, self.steepness = t.fade.curve, t.fade.steepness
        self.betas = [s.beta or 0.0 for s in stages]
        self.resets = [i for i, s in enumerate(stages) if s.reset_optimizer]
        self.opt = opt

    def curve(self, t: float) -> float:
        if self.curve_name == "linear":
            return t
        if self.curve_name == "cosine":
            return (1 - math.cos(math.pi * t)) / 2
        return 1 / (1 + math.exp(-self.steepness * (t - 0.5)))

    def first_step_at(self, x: float) -> int:
        """First step whose start position is >= x, capped at N."""
        return min(max(math.ceil(x / self.tps), 0), self.num_steps)

    def ramp_at(self, x: float) -> tuple[int, float, float] | None:
        i = bisect.bisect_right(self.ramp_starts, x) - 1
        return self.ramps[i] if i >= 0 and x < self.ramps[i][2] else None

    def owner(self, x: float) -> int:
        return min(bisect.bisect_right(self.boundaries, x), self.num_stages - 1)

    def lr(self, k: int, entries: list[int]) -> float:
        """The LR of step k of a run started today; `entries`: each stage's entry step (checked
        against the weights separately). Resets that restart the LR count k from the last one."""
        opt, n = self.opt, self.num_steps
        if opt.reset_restarts_lr:
            restarts = sorted(entries[s] for s in self.resets if 0 < s < len(entries))
            k -= max((r for r in restarts if r <= k), default=0)
        base, warmup = opt.lr, math.floor(n * opt.warmup_pct)
        a, m = opt.warmup_lr_mult, opt.min_lr_ratio
        if opt.schedule in ("wsd", "wsds"):
            decay = math.floor(n * opt.decay_pct)
            stable = n - warmup - decay - (math.floor(n * opt.constant_pct) if opt.schedule == "wsds" else 0)
            b = opt.decay_lr_mult
            if k < warmup:
                return base * (a + (1 - a) * k / warmup)
            if k < warmup + stable:
                return base
            if k < warmup + stable + decay:
                return base * (1 - (1 - b) * (k - warmup - stable) / decay)
            return base * b
        if opt.schedule == "constant":
            return base
        if opt.schedule == "cosine_rewarm":  # each stage: from m x lr up to its peak, cosine to m x peak
            stage = max(i for i, start in enumerate(entries) if start <= k)
            start, end = entries[stage], entries[stage + 1] if stage + 1 < len(entries) else n
            length = max(end - start, 1)
            peak = base if stage == 0 else opt.rewarm_lr
            rewarm = max(1, math.floor(length * opt.warmup_pct))
            if k - start < rewarm:
                return m * base + (peak - m * base) * (k - start) / rewarm
            progress = min((k - start - rewarm) / max(length - rewarm, 1), 1.0)
            return peak * (m + (1 - m) * (1 + math.cos(math.pi * progress)) / 2)
        if k < warmup:  # cosine and sgdr warm up from the floor a x lr, as wsd does
            return base * (a + (1 - a) * k / warmup)
        if opt.schedule == "cosine":
            return base * (m + (1 - m) * (1 + math.cos(math.pi * (k - warmup) / (n - warmup))) / 2)
        period, start = opt.sgdr_period, warmup  # sgdr: restarts at warmup + period * (2^i - 1)
        while k >= start + period:
            start, period = start + period, period * 2
        return base * (m + (1 - m) * (1 + math.cos(math.pi * (k - start) / period)) / 2)


def check_schedule(config: Config) -> OracleReport:
    """Check `config`'s schedule against the spec; see the module docstring for what is sampled."""
    schedule, spec, found = Schedule(config), _Spec(config), _Findings()
    (_, started), events = planning.started_state(config), []
    try:  # without a sound step count or event stream, the step checks would only add noise
        if schedule.num_steps != spec.num_steps:
            found.add("steps", f"{schedule.num_steps} steps, but floor(sum T / tps) = {spec.num_steps}")
        elif not _finishes(schedule, started, 0):
            found.add("events", "the plan never reaches RunFinished: it stops deciding before the end")
        else:
            events = list(planning.plan(schedule))
    except IllegalTransition as exc:
        found.add("events", f"the plan is not a legal event stream: {exc}")
    if not events:
        return OracleReport(violations=found.lines(), num_steps=schedule.num_steps)
    _check_events(schedule, spec, events, found)
    _check_resume(schedule, started, events, found)
    _check_hard_switches(schedule, spec, found)
    checked = _steps_to_check(spec, events)
    _check_steps(schedule, spec, events, checked, found)
    return OracleReport(violations=found.lines(), num_steps=spec.num_steps, num_steps_checked=len(checked))


def _check_events(schedule: Schedule, spec: _Spec, events: list[Event], found: _Findings) -> None:
    n, last_step = spec.num_steps, 0
    for event in events:
        if event.tokens != event.step * spec.tps or not last_step <= event.step <= n:
            found.add("events", f"{event!r} has a bad step/tokens (previous step {last_step}, N = {n})")
        last_step = event.step
    if not events or not isinstance(events[-1], RunFinished) or events[-1].step != n:
        found.add("events", f"the plan must end with RunFinished at step {n}, ends with {events[-1:]!r}")

    entered = [e for e in events if isinstance(e, StageEntered)]
    if [e.stage for e in entered] != list(range(spec.num_stages)):
        found.add(
            "stages", f"stages entered {[e.stage for e in entered]}, not 0..{spec.num_stages - 1} in order"
        )
    for event in entered:  # at the first step whose primary stage is >= it (N if none is)
        k, stage = event.step, event.stage
        if k < n and _primary(schedule.step_plan(k).weights) < stage:
            found.add("stages", f"stage {stage} entered at step {k}, whose primary stage is lower")
        if 0 < k <= n and _primary(schedule.step_plan(k - 1).weights) >= stage:
            found.add(
                "stages", f"stage {stage} entered at step {k}, but step {k - 1} already has it as primary"
            )

    refreshed = [(i, e) for i, e in enumerate(events) if isinstance(e, ReferenceRefreshed)]
    expected_refreshes = [i for i, s in enumerate(schedule.config.stages) if s.refresh_reference]
    if sorted(e.stage for _, e in refreshed) != expected_refreshes:
        found.add("references", f"refreshed {[e.stage for _, e in refreshed]}, expected {expected_refreshes}")
    for i, event in refreshed:
        before = events[i - 1] if i > 0 else None
        if before != StageEntered(step=event.step, tokens=event.tokens, stage=event.stage):
            found.add("references", f"{event!r} does not directly follow the StageEntered of its stage")

    expected_fades = {j: (spec.first_step_at(start), spec.first_step_at(end)) for j, start, end in spec.ramps}
    starts = {e.boundary: e.step for e in events if isinstance(e, FadeStarted)}
    ends = {e.boundary: e.step for e in events if isinstance(e, FadeEnded)}
    for j in sorted(set(expected_fades) | set(starts) | set(ends)):
        got, want = (starts.get(j), ends.get(j)), expected_fades.get(j, (None, None))
        if got != want:
            found.add("fades", f"boundary {j}: FadeStarted/FadeEnded at steps {got}, expected {want}")


def _finishes(schedule: Schedule, state: State, step: int) -> bool:
    """Whether `plan` from here reaches RunFinished: it loops until then, so a plan that stops
    deciding early would hang it. Each round visits the next transition step; there are < 3n + 3."""
    for _ in range(4 * schedule.num_stages + 8):
        state, _ = planning.due_events(state, schedule, step)
        if state.finished:
            return True
        step = schedule.next_transition_step(step + 1)
    return False


def _check_resume(schedule: Schedule, started: State, events: list[Event], found: _Findings) -> None:
    """A run resumed after any prefix of its control events must plan exactly the rest of them."""
    cuts = range(len(events) + 1)
    if len(cuts) > MAX_RESUME_CUTS:
        cuts = sorted({round(i * len(events) / MAX_RESUME_CUTS) for i in range(MAX_RESUME_CUTS + 1)})
    for cut in cuts:
        prefix = events[:cut]
        from_step = prefix[-1].step if prefix else 0
        state = fold(prefix, started)
        resumed = (
            list(planning.plan(schedule, state, from_step)) if _finishes(schedule, state, from_step) else []
        )
        if resumed != events[cut:]:
            found.add("resume", f"resumed after event {cut} (step {from_step}): {resumed[:2]!r}... differs")


def _check_hard_switches(schedule: Schedule, spec: _Spec, found: _Findings) -> None:
    """Overlap 0 means all of stage j just before B_j and all of stage j + 1 from B_j on."""
    for j in range(spec.num_stages - 1):
        if spec.half_widths[j] > 0:
            continue
        b = spec.boundaries[j]
        for x, stage in ((math.nextafter(b, -math.inf), j), (b, j + 1)):
            weights = schedule.weights_at(x)
            if weights != tuple(float(i == stage) for i in range(spec.num_stages)):
                found.add(
                    "hard switch", f"boundary {j} has overlap 0, but at x={x!r} the weights are {weights}"
                )


def _steps_to_check(spec: _Spec, events: list[Event]) -> list[int]:
    n = spec.num_steps
    if n <= EXHAUSTIVE_MAX_STEPS:
        return list(range(n))
    budget = SAMPLE_BUDGET // max(spec.num_stages, 5)
    chosen = set(range(0, n, max(1, 4 * n // budget)))
    fades = [(spec.first_step_at(start), spec.first_step_at(end)) for _, start, end in spec.ramps]
    stride = max(1, math.ceil(4 * sum(end - start for start, end in fades) / (3 * budget)))
    for start, end in fades:
        chosen.update(range(start, end, stride))
    landmarks = {n - 1, *(e.step for e in events), *(spec.first_step_at(b) for b in spec.boundaries)}
    landmarks.update(k for fade in fades for k in fade)
    landmarks.update((math.floor(n * spec.opt.warmup_pct), *(decay_window(spec.opt, n) or ())))
    for k in landmarks:
        chosen.update(range(max(0, k - EDGE_RADIUS), min(n, k + EDGE_RADIUS + 1)))
    return sorted(chosen)


def _check_steps(
    schedule: Schedule, spec: _Spec, events: list[Event], steps: list[int], found: _Findings
) -> None:
    entry_steps = [e.step for e in events if isinstance(e, StageEntered)]
    base_lr, n = spec.opt.lr, spec.num_stages
    highest_lr = max(base_lr, spec.opt.rewarm_lr) if spec.opt.schedule == "cosine_rewarm" else base_lr
    fading: tuple[int, float, float] | None = None  # (boundary, incoming, outgoing) at the last step
    last_primary = 0
    for k in steps:
        step = schedule.step_plan(k)
        x, w = k * spec.tps, step.weights
        if step.step != k or step.tokens != x:
            found.add("steps", f"step_plan({k}) says step {step.step} at {step.tokens} tokens, expected {x}")
        if len(w) != n or min(w) < 0.0 or abs(sum(w) - 1.0) > TOLERANCE:
            found.add("weights", f"step {k}: weights {w} are not {n} non-negative numbers summing to 1")
            continue
        fading = _check_weights(spec, k, x, w, fading, found)

        primary, entered = _primary(w), bisect.bisect_right(entry_steps, k) - 1
        if not step.stage == primary == entered or primary < last_primary:
            found.add(
                "stages",
                f"step {k}: stage {step.stage}, argmax of the weights {primary} (previous step checked: "
                f"{last_primary}), last stage entered {entered}",
            )
        last_primary = primary
        if step.beta != spec.betas[primary]:
            found.add("beta", f"step {k}: KL weight {step.beta}, betas[{primary}] = {spec.betas[primary]}")
        problem = _rows_problem(w, step.rows, spec.batch_size)
        if problem:
            found.add("rows", f"step {k}: rows {step.rows} for weights {w}: {problem}")
        expected = spec.lr(k, entry_steps)
        in_range = 0.0 <= step.lr <= highest_lr * (1 + TOLERANCE)
        if not in_range or not math.isclose(step.lr, expected, rel_tol=TOLERANCE, abs_tol=base_lr * 1e-12):
            found.add(
                "lr", f"step {k}: LR {step.lr!r}, expected {expected!r} ({spec.opt.schedule}, peak {base_lr})"
            )


def _check_weights(
    spec: _Spec,
    k: int,
    x: int,
    w: tuple[float, ...],
    fading: tuple[int, float, float] | None,
    found: _Findings,
) -> tuple[int, float, float] | None:
    """Outside fades: all weight on the stage owning x. In the fade of boundary j: only stages j and
    j + 1, the incoming one at curve(t) (raw weights c and 1 - c already sum to 1), and monotone."""
    n, ramp = spec.num_stages, spec.ramp_at(x)
    if ramp is None:
        if w[spec.owner(x)] != 1.0 or w.count(0.0) != n - 1:
            found.add("weights", f"step {k} (x={x}) is outside every fade but has weights {w}")
        return None
    j, start, end = ramp
    incoming = spec.curve((x - start) / (end - start))
    others_zero = w[:j].count(0.0) == j and w[j + 2 :].count(0.0) == n - j - 2
    if abs(w[j + 1] - incoming) > TOLERANCE or not others_zero:
        found.add(
            "weights",
            f"step {k} (x={x}), fade of boundary {j}: weights {w}, stage {j + 1} should be {incoming}",
        )
    was = fading if fading is not None and fading[0] == j else (j, 0.0, 1.0)
    if w[j + 1] < was[1] - TOLERANCE or w[j] > was[2] + TOLERANCE:
        found.add(
            "monotone", f"step {k}, fade of boundary {j}: (in, out) went from {was[1:]} to {w[j + 1], w[j]}"
        )
    return (j, w[j + 1], w[j])


def _rows_problem(weights: tuple[float, ...], counts: tuple[int, ...], num_rows: int) -> str:
    """Largest remainder, checked without redoing it: floors plus one extra row for the stages with
    the largest fractional parts (ties to the higher index). Runs every step, hence the plain loop."""
    if len(counts) != len(weights) or sum(counts) != num_rows:
        return f"expected {len(weights)} counts summing to {num_rows}"
    lowest_with = highest_without = None  # (fractional part, stage) of who got / missed an extra row
    for stage, (weight, count) in enumerate(zip(weights, counts, strict=True)):
        exact = weight * num_rows
        floor = math.floor(exact)
        if count not in (floor, floor + 1) or abs(count - exact) >= 1:
            return f"stage {stage}: {count} rows is not floor({exact!r}) or one more"
        rank = (exact - floor, stage)
        if count > floor:
            lowest_with = rank if lowest_with is None else min(lowest_with, rank)
        else:
            highest_without = rank if highest_without is None else max(highest_without, rank)
    if lowest_with is not None and highest_without is not None and lowest_with < highest_without:
        return f"stage {lowest_with[1]} got an extra row before stage {highest_without[1]} (remainder, tie)"
    return ""


def _primary(weights: tuple[float, ...]) -> int:
    return weights.index(max(weights))  # ties to the lower index
