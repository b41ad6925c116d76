"""Learning-rate curves: `cosine_rewarm` per stage, the warmup floor of cosine and sgdr (and the old
form kept for runs started without it), the LR a run trains at (`plan.step_lr`: the run's features,
an optimizer reset that restarts the curve), and the config rules of the new fields."""

from __future__ import annotations

import itertools
import json
import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.states.check_schedule import schedule_warnings
from rewind.states.config import ConfigError, OptimizationSection
from rewind.states.config_identity import canonical
from rewind.states.config_reading import loads_config
from rewind.states.events import OptimizerReset, RunStarted, StageEntered
from rewind.states.fold import apply
from rewind.states.lr import lr_at, stage_span
from rewind.states.plan import started_state, step_lr
from rewind.states.schedule import Schedule
from rewind.states.state import State

replace = msgspec.structs.replace


@st.composite
def rewarm_cases(draw: st.DrawFn) -> tuple[OptimizationSection, int, tuple[int, ...]]:
    """(optimization, N, stage starts): starts ascending from 0, some stages empty (shorter than a
    step: two stages start at the same step), some ending at N."""
    num_steps = draw(st.integers(1, 400))
    cuts = draw(st.lists(st.integers(0, num_steps), max_size=5))
    opt = OptimizationSection(
        schedule="cosine_rewarm",
        lr=draw(st.floats(1e-5, 1.0)),
        rewarm_lr=draw(st.floats(1e-6, 1.0)),
        warmup_pct=draw(st.floats(0.0, 1.0)),
        min_lr_ratio=draw(st.floats(0.0, 0.9)),
    )
    return opt, num_steps, (0, *sorted(cuts))


def stages_of(num_steps: int, starts: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(stage, first step, end) for every stage that owns at least one step."""
    ends = [*starts[1:], num_steps]
    return [(i, s, e) for i, (s, e) in enumerate(zip(starts, ends, strict=True)) if e > s]


@settings(max_examples=300, deadline=None)
@given(rewarm_cases())
def test_cosine_rewarm_per_stage_warms_up_peaks_and_decays_to_its_floor(case):
    opt, n, starts = case
    m = opt.min_lr_ratio
    for stage, first, end in stages_of(n, starts):
        peak = opt.lr if stage == 0 else opt.rewarm_lr
        curve = [lr_at(opt, k, n, starts) for k in range(first, end)]
        length = end - first
        warmup = max(1, math.floor(length * opt.warmup_pct))
        low = m * opt.lr  # every stage's warmup starts at the run's floor, as the original's does
        tol = max(peak, low) * 1e-12
        # Starts at the floor: always at least one warmup step, even at warmup_pct = 0.
        assert curve[0] == pytest.approx(low, rel=1e-12)
        # Never outside the warmup's and the cosine's ranges.
        assert all(min(low, m * peak) - tol <= lr <= max(peak, low) + tol for lr in curve)
        # Linear from the floor to the peak through the warmup (up, or down when rewarm_lr is below
        # the floor), then down along the cosine.
        warming, falling = curve[: warmup + 1], curve[warmup:]
        direction = 1.0 if peak >= low else -1.0
        assert all(direction * (b - a) >= -tol for a, b in itertools.pairwise(warming))
        assert all(a + tol >= b for a, b in itertools.pairwise(falling))
        if warmup < length:  # the step after the warmup is the peak
            assert curve[warmup] == pytest.approx(peak, rel=1e-12)
            # By the stage's end the cosine is at the floor: the last step is one cosine step from it.
            span = length - warmup
            assert curve[-1] - m * peak <= (1 - m) * peak * (math.pi / span) ** 2 / 4 + tol
        # Continuous inside the stage: no jump bigger than the steepest slope of either part.
        slope = max(abs(peak - low) / warmup, (1 - m) * peak * math.pi / (2 * max(length - warmup, 1)))
        assert all(abs(b - a) <= slope + tol for a, b in itertools.pairwise(curve))


def test_cosine_rewarm_rewarms_at_every_stage_entry_to_rewarm_lr():
    opt = OptimizationSection(
        schedule="cosine_rewarm", lr=1e-3, rewarm_lr=2e-4, warmup_pct=0.1, min_lr_ratio=0.1
    )
    starts, n = (0, 100, 150), 200
    assert lr_at(opt, 0, n, starts) == pytest.approx(1e-4)
    assert lr_at(opt, 10, n, starts) == pytest.approx(1e-3)  # stage 0 peaks at lr after 10 steps
    assert lr_at(opt, 99, n, starts) < 1.01e-4
    assert lr_at(opt, 100, n, starts) == pytest.approx(1e-4)  # stage 1 warms up again from m x lr
    assert lr_at(opt, 105, n, starts) == pytest.approx(2e-4)  # to rewarm_lr in 5 steps (10% of 50)
    assert lr_at(opt, 149, n, starts) < 2.1e-5  # and decays to m x rewarm_lr by the stage's end
    assert lr_at(opt, 150, n, starts) == pytest.approx(1e-4)
    assert max(lr_at(opt, k, n, starts) for k in range(150, 200)) == pytest.approx(2e-4)


def test_stage_span_skips_stages_shorter_than_a_step():
    starts = (0, 5, 5, 9)  # stage 1 owns no step: stage 2 starts where it does
    assert stage_span(4, 12, starts) == (0, 0, 5)
    assert stage_span(5, 12, starts) == (2, 5, 9)
    assert stage_span(11, 12, starts) == (3, 9, 12)


def test_cosine_rewarm_takes_its_stages_from_the_schedule():
    config = loads_config(
        """
[training]
batch_size = 2
tokens = [1280, 640]
datasets = [[{ name = "grammar" }], [{ name = "reverse" }]]
[architecture]
block_size = 32
[optimization]
schedule = "cosine_rewarm"
lr = 1e-3
rewarm_lr = 5e-4
warmup_pct = 0.1
"""
    )
    schedule = Schedule(config)
    assert schedule.entry_steps == (0, 20) and schedule.num_steps == 30
    _, state = started_state(config)
    lrs = [step_lr(state, schedule, k) for k in range(30)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[2] == pytest.approx(1e-3)  # 2 warmup steps of 20
    assert lrs[20] == pytest.approx(1e-4) and lrs[21] == pytest.approx(5e-4)  # 1 warmup step of 10, from m x lr


# --- the warmup floor of cosine and sgdr -----------------------------------------------------------


@pytest.mark.parametrize("schedule", ["cosine", "sgdr"])
def test_cosine_and_sgdr_warm_up_from_the_warmup_multiplier(schedule):
    opt = OptimizationSection(schedule=schedule, lr=2e-3, warmup_pct=0.1, warmup_lr_mult=0.05, sgdr_period=20)
    n, warmup = 100, 10
    new = [lr_at(opt, k, n, warmup_from_zero=False) for k in range(warmup + 1)]
    assert new[0] == pytest.approx(0.05 * 2e-3)
    assert all(a < b for a, b in itertools.pairwise(new))
    assert new[warmup] == pytest.approx(2e-3)
    # Past the warmup the two forms are one curve.
    assert all(lr_at(opt, k, n, warmup_from_zero=False) == lr_at(opt, k, n) for k in range(warmup, n))


@pytest.mark.parametrize("schedule", ["cosine", "sgdr"])
def test_runs_started_without_the_floor_keep_the_old_warmup_bit_for_bit(schedule):
    opt = OptimizationSection(schedule=schedule, lr=3e-3, warmup_pct=0.05)
    n = 20  # one warmup step: the old form trained step 0 at LR 0
    assert [lr_at(opt, 0, n)] == [0.0]
    old = State()
    old = apply(old, RunStarted(step=0, tokens=0, config=_config(schedule), config_hash="h"))
    schedule_ = Schedule(_config(schedule))
    k_warm = math.floor(schedule_.num_steps * 0.05)
    for k in range(k_warm):
        assert step_lr(old, schedule_, k) == 3e-3 * k / k_warm  # the literal old formula
    _, new = started_state(_config(schedule))
    assert step_lr(new, schedule_, 0) == pytest.approx(3e-3 * 0.01)


def _config(schedule: str, **optimization):
    extra = "".join(f"{k} = {json.dumps(v)}\n" for k, v in optimization.items())
    return loads_config(
        f"""
[training]
batch_size = 2
tokens = [1280, 1280, 1280]
datasets = [[{{ name = "grammar" }}], [{{ name = "reverse" }}], [{{ name = "sort" }}]]
[architecture]
block_size = 32
[optimization]
schedule = "{schedule}"
lr = 3e-3
warmup_pct = 0.05
{extra}"""
    )  # N = 60, stages entered at 0, 20, 40


# --- the LR after an optimizer reset ---------------------------------------------------------------


@pytest.mark.parametrize("restarts", [False, True])
def test_an_optimizer_reset_restarts_the_curve_only_when_it_says_so(restarts):
    config = _config("wsd", reset_optimizer_stages=[1], reset_restarts_lr=restarts, decay_pct=0.2)
    schedule = Schedule(config)
    _, state = started_state(config)
    entry = schedule.entry_steps[1]
    state = apply(
        apply(state, StageEntered(step=0, tokens=0, stage=0)), StageEntered(step=entry, tokens=0, stage=1)
    )
    unbroken = [step_lr(state, schedule, k) for k in range(entry, schedule.num_steps)]
    state = apply(state, OptimizerReset(step=entry, tokens=0, stage=1, lr_restarted=restarts))
    after = [step_lr(state, schedule, k) for k in range(entry, schedule.num_steps)]
    if restarts:  # the schedule from its step 0 again: warmup first, and no decay by the end
        assert after[0] == pytest.approx(0.01 * 3e-3) and after[-1] == pytest.approx(3e-3)
        assert after == [
            lr_at(config.optimization, k, schedule.num_steps, warmup_from_zero=False)
            for k in range(len(after))
        ]
    else:
        assert after == unbroken
        assert after[-1] < 3e-3


# --- config rules and warnings ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ("rewarm_lr = 0.0", "optimization.rewarm_lr: must be positive, got 0.0"),
        ("rewarm_lr = -1e-4", "optimization.rewarm_lr: must be positive"),
        ("rewarm_lr = nan", "optimization.rewarm_lr: must be a finite number, got nan"),
        ("rewarm_lr = inf", "optimization.rewarm_lr: must be a finite number, got inf"),
        ("reset_optimizer_stages = [0]", "optimization.reset_optimizer_stages[0]: stage 0 has no moments"),
        (
            "reset_optimizer_stages = [1, 3]",
            "optimization.reset_optimizer_stages[1]: stage 3 is out of range 1..2",
        ),
        ("reset_optimizer_stages = [-1]", "optimization.reset_optimizer_stages[0]: stage -1 is out of range"),
        ("reset_optimizer_stages = [2, 2]", "optimization.reset_optimizer_stages: stages must not repeat"),
    ],
)
def test_the_new_fields_are_checked(setting, problem):
    with pytest.raises(ConfigError) as caught:
        loads_config(_text(setting))
    assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems
    assert len(caught.value.problems) == 1


def _text(setting: str) -> str:
    return f"""
[training]
tokens = [10240, 10240, 10240]
datasets = [[{{ name = "grammar" }}], [{{ name = "reverse" }}], [{{ name = "sort" }}]]
[optimization]
{setting}
"""


def test_valid_new_fields_and_their_defaults_keep_old_configs_identical():
    config = loads_config(
        _text('schedule = "cosine_rewarm"\nrewarm_lr = 2e-4\nreset_optimizer_stages = [2, 1]')
    )
    assert [s.reset_optimizer for s in config.stages] == [False, True, True]
    assert not config.optimization.reset_restarts_lr
    plain = loads_config(_text(""))
    assert {"reset_optimizer_stages", "reset_restarts_lr", "rewarm_lr"}.isdisjoint(
        canonical(plain).get("optimization", {})
    )


@pytest.mark.parametrize(
    ("settings", "warned"),
    [
        ("warmup_lr_mult = 0.0\nwarmup_pct = 0.2", True),
        ('schedule = "cosine"\nwarmup_lr_mult = 0.0\nwarmup_pct = 0.2', True),
        ('schedule = "cosine_rewarm"\nmin_lr_ratio = 0.0', True),  # always one warmup step
        ('schedule = "cosine"\nwarmup_pct = 0.2', False),  # the floor: 0.01 x lr
        ("warmup_lr_mult = 0.0\nwarmup_pct = 0.0", False),  # no warmup: the first step is at lr
    ],
)
def test_a_first_step_at_lr_zero_is_warned_about(settings, warned):
    warnings = schedule_warnings(loads_config(_text(settings)))
    assert any("the first step trains at LR 0" in w for w in warnings) == warned, warnings


def test_a_restart_that_skips_the_decay_is_warned_about():
    restarted = loads_config(_text("reset_optimizer_stages = [2]\nreset_restarts_lr = true\ndecay_pct = 0.3"))
    assert any("reset_restarts_lr" in w and "ends at LR" in w for w in schedule_warnings(restarted))
    unbroken = loads_config(_text("reset_optimizer_stages = [2]\ndecay_pct = 0.3"))
    assert not any("reset_restarts_lr" in w for w in schedule_warnings(unbroken))
