"""The schedule against the spec: fade weights, batch rows, stage entries, KL weights and LR."""

from __future__ import annotations

import bisect
import itertools
import math

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rewind.states.config import Config
from rewind.states.config_reading import loads_config
from rewind.states.events import (
    FadeEnded,
    FadeStarted,
    ReferenceRefreshed,
    RunFinished,
    StageEntered,
)
from rewind.states.plan import plan
from rewind.states.schedule import Schedule, StepPlan, allocate_rows
from rewind.states.strategies import configs, steps, token_positions

SMALL = configs(max_steps=300)

TWO_STAGES = """
[architecture]
block_size = 8

[training]
batch_size = 8
tokens = [1000, 1000]
datasets = [[{ name = "grammar" }], [{ name = "reverse" }]]
"""

GOLDEN = """
[architecture]
block_size = 8

[training]
batch_size = 2
tokens = [136, 64, 56]
datasets = [[{ name = "grammar" }], [{ name = "reverse" }], [{ name = "sort" }]]

[training.fade]
curve = "linear"
per_boundary_overlap = [1.0, 0.0]

[optimization]
lr = 1.0
schedule = "wsd"
warmup_pct = 0.25
decay_pct = 0.25
warmup_lr_mult = 0.5
decay_lr_mult = 0.5

[optimization.kl]
betas = [0.0, 0.5, 0.25]
reference_update_stages = [2]
"""
replace = msgspec.structs.replace


def with_fade(config, per_boundary_overlap=None, **fields):
    """`config` with `fields` of [training.fade] and, given `per_boundary_overlap`, each stage's fade into
    the next (one per boundary; [] = none given, so every boundary fades by training.fade.overlap)."""
    training = config.training
    config = replace(config, training=replace(training, fade=replace(training.fade, **fields)))
    if per_boundary_overlap is None:
        return config
    overlaps = [*per_boundary_overlap, None] if per_boundary_overlap else [None] * config.num_stages
    return replace(config, stages=[replace(s, overlap=o) for s, o in zip(config.stages, overlaps, strict=True)])


def owner(schedule: Schedule, x: float) -> int:
    """The stage whose budget contains x (the last one past the end)."""
    return min(bisect.bisect_right(schedule.boundaries, x), schedule.num_stages - 1)


def one_hot(stage: int, num_stages: int) -> tuple[float, ...]:
    return tuple(1.0 if i == stage else 0.0 for i in range(num_stages))


# --- fade weights ------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(st.data(), SMALL)
def test_weights_are_non_negative_and_sum_to_one_anywhere(data, config):
    schedule = Schedule(config)
    for x in data.draw(st.lists(token_positions(config), min_size=1, max_size=20)):
        weights = schedule.weights_at(x)
        assert len(weights) == config.num_stages
        assert min(weights) >= 0.0
        assert sum(weights) == pytest.approx(1.0, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(SMALL)
def test_weights_of_every_step_are_those_at_its_start(config):
    schedule = Schedule(config)
    for k in range(schedule.num_steps):
        assert schedule.weights(k) == schedule.weights_at(k * schedule.tokens_per_step)
        assert min(schedule.weights(k)) >= 0.0 and sum(schedule.weights(k)) == pytest.approx(1.0, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.data(), SMALL)
def test_overlap_zero_is_exactly_a_hard_switch(data, config):
    schedule = Schedule(with_fade(config, overlap=0.0, per_boundary_overlap=[]))
    assert schedule.fades == ()
    for x in data.draw(st.lists(token_positions(config), max_size=20)):
        assert schedule.weights_at(x) == one_hot(owner(schedule, x), schedule.num_stages)
    for k in range(schedule.num_steps):
        assert schedule.weights(k) == one_hot(
            owner(schedule, k * schedule.tokens_per_step), schedule.num_stages
        )


@settings(max_examples=60, deadline=None)
@given(SMALL)
def test_a_boundary_with_overlap_zero_switches_at_exactly_its_position(config):
    num_boundaries = config.num_stages - 1
    assume(num_boundaries > 0)
    overlaps = [0.0 if j % 2 == 0 else 1.0 for j in range(num_boundaries)]
    schedule = Schedule(with_fade(config, per_boundary_overlap=overlaps))
    for j in range(0, num_boundaries, 2):
        b = schedule.boundaries[j]
        assert schedule.weights_at(math.nextafter(b, -math.inf)) == one_hot(j, schedule.num_stages)
        assert schedule.weights_at(b) == one_hot(j + 1, schedule.num_stages)


@settings(max_examples=80, deadline=None)
@given(st.data(), SMALL)
def test_weights_are_monotone_across_each_fade(data, config):
    schedule = Schedule(config)
    tps = schedule.tokens_per_step
    for ramp in schedule.fades:
        j = ramp.boundary
        inside = [float(k * tps) for k in range(schedule.fade_start_step(ramp), schedule.fade_end_step(ramp))]
        inside += data.draw(st.lists(st.floats(ramp.start, ramp.end, exclude_max=True), max_size=10))
        positions = [ramp.start, *sorted(inside)]
        weights = [schedule.weights_at(x) for x in positions]
        for before, after in itertools.pairwise(weights):
            assert after[j + 1] >= before[j + 1] - 1e-12
            assert after[j] <= before[j] + 1e-12
        for x, w in zip(positions, weights, strict=True):
            assert [i for i, v in enumerate(w) if v] in ([j], [j + 1], [j, j + 1]), (x, w)
        # Outside the ramp, nothing of the incoming stage before it, nothing of the outgoing one after.
        assert schedule.weights_at(math.nextafter(ramp.start, -math.inf))[j + 1] == 0.0
        assert schedule.weights_at(ramp.end)[j] == 0.0


@pytest.mark.parametrize("curve", ["linear", "cosine", "sigmoid"])
def test_a_fade_follows_its_curve(curve):
    config = with_fade(loads_config(TWO_STAGES), curve=curve, overlap=1.0, steepness=8.0)
    schedule = Schedule(config)
    (ramp,) = schedule.fades
    assert (ramp.start, ramp.end) == (500.0, 1500.0)
    formula = {
        "linear": lambda t: t,
        "cosine": lambda t: (1 - math.cos(math.pi * t)) / 2,
        "sigmoid": lambda t: 1 / (1 + math.exp(-8.0 * (t - 0.5))),
    }[curve]
    for t in (0.0, 0.1, 0.25, 0.5, 0.9):
        incoming = schedule.weights_at(500.0 + 1000.0 * t)[1]
        assert incoming == pytest.approx(formula(t), abs=1e-12)
    assert schedule.weights_at(1500.0) == (0.0, 1.0)
    assert schedule.weights_at(499.0) == (1.0, 0.0)


def test_past_the_end_all_weight_goes_to_the_last_stage():
    schedule = Schedule(loads_config(TWO_STAGES))
    assert schedule.weights_at(schedule.total_tokens) == (0.0, 1.0)
    assert schedule.weights_at(10 * schedule.total_tokens) == (0.0, 1.0)


# --- batch rows --------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(SMALL)
def test_rows_of_every_step_sum_to_the_batch_and_follow_the_weights(config):
    schedule = Schedule(config)
    batch = config.training.batch_size
    for k in range(schedule.num_steps):
        rows, weights = schedule.rows(k), schedule.weights(k)
        assert sum(rows) == batch
        assert all(abs(r - w * batch) < 1 for r, w in zip(rows, weights, strict=True))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=6), st.integers(1, 64))
def test_allocate_rows_is_largest_remainder(raw, num_rows):
    assume(sum(raw) > 0)
    weights = [w / sum(raw) for w in raw]
    rows = allocate_rows(weights, num_rows)
    assert sum(rows) == num_rows
    exact = [w * num_rows for w in weights]
    extra = [r - math.floor(e) for r, e in zip(rows, exact, strict=True)]
    assert set(extra) <= {0, 1}
    got = [(e - math.floor(e), i) for i, e in enumerate(exact) if extra[i]]
    missed = [(e - math.floor(e), i) for i, e in enumerate(exact) if not extra[i]]
    # Every stage given an extra row outranks every stage not given one: larger remainder, then index.
    assert not got or not missed or min(got) > max(missed)


@pytest.mark.parametrize(
    ("weights", "num_rows", "expected"),
    [
        ((0.5, 0.5), 3, (1, 2)),  # a tie goes to the higher stage index
        ((0.25, 0.25, 0.5), 2, (0, 1, 1)),  # tie between stages 0 and 1 -> stage 1
        ((0.75, 0.25), 2, (1, 1)),  # 1.5 / 0.5: equal remainders, the leftover row to stage 1
        ((0.7, 0.3), 1, (1, 0)),  # the largest remainder wins over the index
        ((0.2, 0.3, 0.5), 4, (1, 1, 2)),  # 0.8, 1.2, 2.0: the one leftover row goes to stage 0
        ((1.0,), 5, (5,)),
        ((0.0, 1.0, 0.0), 3, (0, 3, 0)),
    ],
)
def test_allocate_rows_on_hand_made_examples(weights, num_rows, expected):
    assert allocate_rows(weights, num_rows) == expected


# --- stage entries, references, KL weight --------------------------------------------------------------


def stages_entered_at(events) -> dict[int, list[int]]:
    entered: dict[int, list[int]] = {}
    for e in events:
        if isinstance(e, StageEntered):
            entered.setdefault(e.step, []).append(e.stage)
    return entered


@settings(max_examples=100, deadline=None)
@given(SMALL)
def test_every_stage_is_entered_once_in_order_when_the_primary_changes(config):
    schedule = Schedule(config)
    events = list(plan(schedule))
    assert [e.stage for e in events if isinstance(e, StageEntered)] == list(range(config.num_stages))
    entered = stages_entered_at(events)
    previous = -1
    for k in range(schedule.num_steps):
        primary = schedule.primary(k)
        # Stages passed over between two steps (shorter than a step) are entered at the same step.
        assert entered.get(k, []) == list(range(previous + 1, primary + 1))
        previous = primary
    assert entered.get(schedule.num_steps, []) == list(range(previous + 1, config.num_stages))
    assert isinstance(events[-1], RunFinished) and events[-1].step == schedule.num_steps


@settings(max_examples=100, deadline=None)
@given(SMALL)
def test_primary_is_the_argmax_with_ties_to_the_lower_index_and_beta_follows_it(config):
    schedule = Schedule(config)
    betas = [s.beta or 0.0 for s in config.stages]
    for k in range(schedule.num_steps):
        weights = schedule.weights(k)
        primary = schedule.primary(k)
        assert weights[primary] == max(weights) and max(weights) not in weights[:primary]
        assert schedule.beta(k) == betas[primary]
        assert schedule.step_plan(k) == StepPlan(
            step=k,
            tokens=k * schedule.tokens_per_step,
            stage=primary,
            weights=weights,
            rows=schedule.rows(k),
            lr=schedule.lr(k),
            beta=betas[primary],
        )


@settings(max_examples=100, deadline=None)
@given(SMALL)
def test_reference_refreshed_right_after_its_stage_is_entered(config):
    events = list(plan(Schedule(config)))
    refreshed = [(i, e) for i, e in enumerate(events) if isinstance(e, ReferenceRefreshed)]
    assert sorted(e.stage for _, e in refreshed) == [i for i, s in enumerate(config.stages) if s.refresh_reference]
    for i, event in refreshed:
        assert events[i - 1] == StageEntered(step=event.step, tokens=event.tokens, stage=event.stage)


@settings(max_examples=100, deadline=None)
@given(SMALL)
def test_events_carry_step_and_tokens_and_fades_bracket_the_mixed_steps(config):
    schedule = Schedule(config)
    events = list(plan(schedule))
    tps = schedule.tokens_per_step
    assert all(e.tokens == e.step * tps for e in events)
    assert [e.step for e in events] == sorted(e.step for e in events)
    started = {e.boundary: e.step for e in events if isinstance(e, FadeStarted)}
    ended = {e.boundary: e.step for e in events if isinstance(e, FadeEnded)}
    assert set(started) == set(ended) == {r.boundary for r in schedule.fades}
    for k in range(schedule.num_steps):
        mixed = [i for i, w in enumerate(schedule.weights(k)) if w > 0]
        if len(mixed) > 1:
            j = mixed[0]
            assert mixed == [j, j + 1] and started[j] <= k < ended[j]


@settings(max_examples=60, deadline=None)
@given(SMALL)
def test_stage_tokens_account_for_every_step(config):
    schedule = Schedule(config)
    assert sum(schedule.stage_tokens()) == schedule.num_steps * schedule.tokens_per_step
    assert schedule.num_steps == sum(s.tokens for s in config.stages) // config.tokens_per_step


@settings(max_examples=60, deadline=None)
@given(st.data(), SMALL)
def test_nothing_happens_before_the_next_transition_step(data, config):
    """plan() jumps from one transition step to the next: no event may fall in between."""
    schedule = Schedule(config)
    event_steps = sorted({e.step for e in plan(schedule)})
    for k in data.draw(st.lists(steps(config), min_size=1, max_size=10)):
        upcoming = next((s for s in event_steps if s >= k), schedule.num_steps)
        assert k <= schedule.next_transition_step(k) <= upcoming


def test_a_stage_shorter_than_a_step_is_entered_with_the_next_one():
    text = TWO_STAGES.replace("tokens = [1000, 1000]", "tokens = [1088, 5, 1024]").replace(
        "datasets = [", 'datasets = [[{ name = "add" }], '
    )
    config = loads_config(text + "\n[optimization.kl]\nreference_update_stages = [1]\n")
    schedule = Schedule(config)  # tps = 64: step 17 starts at 1088 in stage 1, step 18 at 1152 in stage 2
    events = list(plan(schedule))
    at_17 = [e for e in events if e.step == 17]
    assert at_17 == [
        StageEntered(step=17, tokens=1088, stage=1),
        ReferenceRefreshed(step=17, tokens=1088, stage=1),
    ]
    at_18 = [e for e in events if e.step == 18]
    assert at_18 == [StageEntered(step=18, tokens=1152, stage=2)]
    # Two tokens shorter: no step starts inside stage 1 at all, so stages 1 and 2 enter together.
    squeezed = loads_config(text.replace("[1088, 5, 1024]", "[1090, 5, 1024]"))
    entered = stages_entered_at(plan(Schedule(squeezed)))
    assert entered[18] == [1, 2]


# --- learning rate -------------------------------------------------------------------------------------


def without_lr_restarts(config: Config) -> Config:
    optimization = msgspec.structs.replace(config.optimization, reset_restarts_lr=False)
    return msgspec.structs.replace(config, optimization=optimization)


def reference_lr(opt, k: int, n: int) -> float:
    """The spec's formulas, written out once more, as plainly as possible."""
    top = opt.lr
    w = math.floor(n * opt.warmup_pct)
    if opt.schedule == "constant":
        return top
    if opt.schedule in ("wsd", "wsds"):
        d = math.floor(n * opt.decay_pct)
        s2 = math.floor(n * opt.constant_pct) if opt.schedule == "wsds" else 0
        s1 = n - w - d - s2
        a, b = opt.warmup_lr_mult, opt.decay_lr_mult
        if k < w:
            return top * (a + (1 - a) * k / w)
        if k < w + s1:
            return top
        if k < w + s1 + d:
            return top * (1 - (1 - b) * (k - w - s1) / d)
        return top * b
    assert opt.schedule == "cosine"
    if k < w:  # from the floor, as wsd's warmup (runs started before it warmed up from 0)
        a = opt.warmup_lr_mult
        return top * (a + (1 - a) * k / w)
    p = (k - w) / (n - w)
    m = opt.min_lr_ratio
    return top * (m + (1 - m) * (1 + math.cos(math.pi * p)) / 2)


@settings(max_examples=150, deadline=None)
@given(configs(max_stages=3, max_steps=400, lr_schedules=("wsd", "wsds", "cosine", "constant")))
def test_lr_matches_the_formulas_at_every_step(config):
    config = without_lr_restarts(config)  # restarts after optimizer resets: tests/states/test_lr.py
    schedule = Schedule(config)
    opt = config.optimization
    for k in range(schedule.num_steps):
        lr = schedule.lr(k)
        assert 0.0 <= lr <= opt.lr * (1 + 1e-12)
        assert lr == pytest.approx(reference_lr(opt, k, schedule.num_steps), rel=1e-12, abs=1e-15)


@settings(max_examples=100, deadline=None)
@given(configs(max_stages=3, max_steps=400, lr_schedules=("sgdr",)))
def test_sgdr_restarts_at_warmup_plus_doubling_periods(config):
    config = without_lr_restarts(config)
    schedule = Schedule(config)
    opt, n = config.optimization, schedule.num_steps
    warmup = math.floor(n * opt.warmup_pct)
    lrs = [schedule.lr(k) for k in range(n)]
    assert all(0.0 <= lr <= opt.lr * (1 + 1e-12) for lr in lrs)
    assert all(lr >= opt.lr * opt.min_lr_ratio * (1 - 1e-12) for lr in lrs[warmup:])
    restarts = [warmup + opt.sgdr_period * (2**i - 1) for i in range(20)]
    restarts = [r for r in restarts if r < n]
    for r in restarts:
        assert lrs[r] == pytest.approx(opt.lr, rel=1e-12)
    for i, start in enumerate(restarts):
        end = restarts[i + 1] if i + 1 < len(restarts) else n
        # Within a period the LR only goes down, and strictly unless min_lr_ratio is about 1.
        period = lrs[start:end]
        assert all(b <= a for a, b in itertools.pairwise(period))
        if opt.min_lr_ratio < 0.99 and end - start > 1:
            assert period[-1] < period[0]


# --- a golden example, worked out by hand ----------------------------------------------------------------


def test_golden_three_stage_schedule():
    # tps = 2 x 8 = 16, N = 256 / 16 = 16. Boundary 0 at 136 fades over [104, 168) (h = 1.0 x 64 / 2);
    # boundary 1 at 200 is a hard switch. Steps 7..10 start at t = 1/8, 3/8, 5/8, 7/8 into the fade.
    schedule = Schedule(loads_config(GOLDEN))
    assert (schedule.tokens_per_step, schedule.num_steps) == (16, 16)
    a, b, c = (1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0)
    expected = (
        [(a, (2, 0, 0), 0)] * 7
        + [
            ((0.875, 0.125, 0.0), (2, 0, 0), 0),  # 1.75 / 0.25: the leftover row to the larger remainder
            ((0.625, 0.375, 0.0), (1, 1, 0), 0),  # 1.25 / 0.75
            ((0.375, 0.625, 0.0), (1, 1, 0), 1),
            ((0.125, 0.875, 0.0), (0, 2, 0), 1),
        ]
        + [(b, (0, 2, 0), 1)] * 2
        + [(c, (0, 0, 2), 2)] * 3
    )
    lrs = [0.5, 0.625, 0.75, 0.875] + [1.0] * 8 + [1.0, 0.875, 0.75, 0.625]
    betas = [0.0, 0.5, 0.25]
    for k, ((weights, rows, stage), lr) in enumerate(zip(expected, lrs, strict=True)):
        step = schedule.step_plan(k)
        assert (step.weights, step.rows, step.stage, step.lr, step.beta) == (
            weights,
            rows,
            stage,
            lr,
            betas[stage],
        ), k
    assert list(plan(schedule)) == [
        StageEntered(step=0, tokens=0, stage=0),
        FadeStarted(step=7, tokens=112, boundary=0),
        StageEntered(step=9, tokens=144, stage=1),
        FadeEnded(step=11, tokens=176, boundary=0),
        StageEntered(step=13, tokens=208, stage=2),
        ReferenceRefreshed(step=13, tokens=208, stage=2),
        RunFinished(step=16, tokens=256),
    ]
    assert schedule.entry_steps == (0, 9, 13)
    assert schedule.stage_tokens() == [9 * 16, 4 * 16, 3 * 16]


@given(st.floats(0.0, 1.0), st.floats(1e-3, 1e6))
def test_a_steep_sigmoid_fade_never_overflows_and_keeps_the_old_bits_where_it_worked(t, steepness):
    """Found by adversarial runs: steepness above ~1420 raised OverflowError in `rewind schedule` and
    `train`. Where the original formula did not overflow, the value is bit for bit the same."""
    from rewind.states.schedule import curve_value

    value = curve_value("sigmoid", t, steepness)
    assert 0.0 <= value <= 1.0
    try:
        original = 1.0 / (1.0 + math.exp(-steepness * (t - 0.5)))
    except OverflowError:
        return
    if steepness * (t - 0.5) >= -700.0:
        assert value == original
    else:
        assert value == pytest.approx(original, abs=1e-300)


def test_a_steep_sigmoid_schedule_builds_and_its_weights_rise():
    config = loads_config(
        """
[training]
batch_size = 4
tokens = [4000, 4000]
datasets = [[{ name = "grammar" }], [{ name = "sort" }]]
[training.fade]
overlap = 1.0
curve = "sigmoid"
steepness = 5000.0
"""
    )
    schedule = Schedule(config)
    incoming = [schedule.weights_at(x)[1] for x in range(0, 8000, 97)]
    assert incoming == sorted(incoming) and incoming[0] == 0.0 and incoming[-1] == 1.0


def test_a_stage_s_lr_scale_multiplies_its_primary_steps_lr_and_nothing_else():
    import msgspec

    from rewind.states.config_identity import config_hash
    from rewind.states.config_reading import loads_config
    from rewind.states.plan import started_state, step_lr
    from rewind.states.schedule import Schedule
    from tests.conftest import EXAMPLES

    plain = loads_config((EXAMPLES / "tiny.toml").read_text())
    stages = [*plain.stages[:2], msgspec.structs.replace(plain.stages[2], lr_scale=0.1)]
    scaled = msgspec.structs.replace(plain, stages=stages)
    a, b = Schedule(plain), Schedule(scaled)
    _, state = started_state(scaled)
    for k in range(a.num_steps):
        factor = 0.1 if b.primary(k) == 2 else 1.0
        assert b.lr(k) == a.lr(k) * factor and step_lr(state, b, k) == b.lr(k)
    assert any(b.primary(k) == 2 for k in range(b.num_steps))
    assert config_hash(scaled) != config_hash(plain)
    unscaled = msgspec.structs.replace(plain, stages=[*plain.stages[:2], msgspec.structs.replace(plain.stages[2], lr_scale=1.0)])
    assert config_hash(unscaled) == config_hash(plain)  # the default changes no identity
