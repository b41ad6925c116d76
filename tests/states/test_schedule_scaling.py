"""The schedule is linear in its stages, and bounded by them.

A query looks at the (at most three) stages that can have weight at a position, the plan finds the due
fade by bisection, and a stage's end by bisection: each shortcut is checked here bit for bit against
the definition it replaces (written out below as it was), and the work of building and planning a
schedule is counted (calls, not seconds) at growing numbers of stages. A config may have at most
MAX_STAGES stages, said by field path.
"""

from __future__ import annotations

import bisect

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.states import plan as plan_module
from rewind.states.check_stages import MAX_STAGES
from rewind.states.config import ConfigError
from rewind.states.config_reading import loads_config
from rewind.states.config_rules import check_config
from rewind.states.events import FadeEnded, FadeStarted
from rewind.states.plan import boundary_ending_at, fade_due, plan
from rewind.states.schedule import Schedule
from rewind.states.state import State
from rewind.states.strategies import configs, token_positions

replace = msgspec.structs.replace
SMALL = configs(max_stages=8, max_steps=300)


# --- the definitions the shortcuts replace -------------------------------------------------------


def weights_by_definition(schedule: Schedule, x: float) -> tuple[float, ...]:
    raw = [schedule.raw_weight(i, x) for i in range(schedule.num_stages)]
    total = sum(raw)
    if total <= 0.0:
        owner = min(bisect.bisect_right(schedule.boundaries, x), schedule.num_stages - 1)
        return tuple(1.0 if i == owner else 0.0 for i in range(schedule.num_stages))
    return tuple(w / total for w in raw)


def fade_by_definition(state: State, schedule: Schedule, step: int) -> FadeStarted | FadeEnded | None:
    at = {"step": step, "tokens": schedule.tokens_of(step)}
    for ramp in schedule.fades:
        started = ramp.boundary in state.fades_started
        if not started and schedule.fade_start_step(ramp) <= step:
            return FadeStarted(**at, boundary=ramp.boundary)
        if started and ramp.boundary not in state.fades_ended and schedule.fade_end_step(ramp) <= step:
            return FadeEnded(**at, boundary=ramp.boundary)
    return None


def boundary_by_definition(schedule: Schedule, done: int) -> int | None:
    if done >= schedule.num_steps:
        return schedule.num_stages - 1
    ended = [i for i in range(schedule.num_stages - 1) if schedule.entry_steps[i + 1] == done]
    return ended[-1] if ended else None


@settings(max_examples=150, deadline=None)
@given(st.data(), SMALL)
def test_weights_and_primary_stage_are_the_definitions_bit_for_bit(data, config):
    schedule = Schedule(config)
    positions = data.draw(st.lists(token_positions(config), min_size=1, max_size=30))
    for x in [
        *positions,
        *schedule.boundaries,
        *(r.start for r in schedule.ramps),
        *(r.end for r in schedule.ramps),
    ]:
        expected = weights_by_definition(schedule, x)
        assert schedule.weights_at(x) == expected
        assert schedule.primary_at(x) == expected.index(max(expected))


@settings(max_examples=100, deadline=None)
@given(SMALL)
def test_the_boundary_a_step_ends_is_the_definitions(config):
    schedule = Schedule(config)
    for done in range(schedule.num_steps + 2):
        assert boundary_ending_at(schedule, done) == boundary_by_definition(schedule, done)


@st.composite
def fade_records(draw: st.DrawFn, schedule: Schedule) -> tuple[list[int], list[int]]:
    """(fades_started, fades_ended) as a state may hold them: a prefix of the schedule's fades in order
    (a run under one config), or any ascending boundaries and any subset of them in any order (another
    config's fades, after a ConfigChanged or in a fork's seed)."""
    order = schedule.fade_boundaries
    if draw(st.booleans()):
        started = order[: draw(st.integers(0, len(order)))]
        return started, started[: draw(st.integers(0, len(started)))]
    started = sorted(draw(st.sets(st.integers(0, max(schedule.num_stages - 2, 0)))))
    ended = draw(st.permutations(started)) if started else []
    return started, ended[: draw(st.integers(0, len(ended)))]


@settings(max_examples=300, deadline=None)
@given(st.data(), SMALL)
def test_the_due_fade_is_the_definitions_for_any_fades_on_record(data, config):
    schedule = Schedule(config)
    started, ended = data.draw(fade_records(schedule))
    state = replace(State(), started=True, fades_started=started, fades_ended=ended)
    for step in range(schedule.num_steps + 1):
        assert fade_due(state, schedule, step) == fade_by_definition(state, schedule, step)


# --- linear in stages ------------------------------------------------------------------------------


def many_stages(n: int) -> str:
    """n stages of 10 steps each, every boundary faded."""
    stages = ", ".join(["320"] * n)
    mixtures = ", ".join(['[{ name = "grammar" }]'] * n)
    return f"""
[architecture]
block_size = 8
[training]
batch_size = 4
tokens = [{stages}]
datasets = [{mixtures}]
[training.fade]
overlap = 0.5
"""


def count_work(n: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls made while a schedule of n stages is built and its whole plan computed."""
    calls = {"raw_weight": 0, "fade_due": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(Schedule, "raw_weight", counted("raw_weight", Schedule.raw_weight))
    monkeypatch.setattr(plan_module, "fade_due", counted("fade_due", plan_module.fade_due))
    schedule = Schedule(loads_config(many_stages(n)))
    events = list(plan(schedule))
    assert len(events) == 3 * n - 1  # every stage entered, every fade started and ended, the end
    monkeypatch.undo()
    return calls


def test_building_and_planning_a_schedule_is_linear_in_its_stages(monkeypatch):
    small, large = count_work(100, monkeypatch), count_work(800, monkeypatch)
    # The weight of a stage at a position is asked O(log N) times per stage (finding its entry by
    # bisection, three stages each time), the due fade O(1) times per transition: per stage, the count
    # may grow with log N (10 steps a stage: log2 1,000 -> log2 8,000) but not with the stages.
    # (Asking every stage at every bisection point, as before, made 8x the stages 64x the calls.)
    for name in ("raw_weight", "fade_due"):
        assert large[name] / 800 <= 1.4 * small[name] / 100, (name, small, large)


# --- the bound -------------------------------------------------------------------------------------


def test_a_config_may_have_at_most_max_stages_stages_said_once_by_field_path():
    assert check_config(loads_config(many_stages(MAX_STAGES))) == []
    with pytest.raises(ConfigError) as caught:
        loads_config(many_stages(MAX_STAGES + 1), "many.toml")
    assert caught.value.problems == [
        f"training.tokens: at most {MAX_STAGES:,} stages (one budget each), got {MAX_STAGES + 1:,}"
    ]
