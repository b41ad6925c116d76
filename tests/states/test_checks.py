"""The schedule, two ways.

The oracle (`schedule_oracle.check_schedule`, an independent re-derivation of the spec) finds no
violation on generated configs, and finds one whenever the schedule code is broken (by monkeypatching
one piece of it). The product's `schedule_warnings` (what `rewind schedule --check` prints) warns on a
config made to trigger each warning, and not on a plain one."""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import time

import msgspec
import pytest
from hypothesis import given, settings

import rewind.states.plan as plan_module
import rewind.states.schedule as schedule_module
from rewind.states.check_schedule import schedule_warnings
from rewind.states.config_reading import loads_config
from rewind.states.events import FadeEnded, FadeStarted
from rewind.states.schedule import Schedule
from rewind.states.strategies import config_variants, configs
from tests.states.schedule_oracle import OracleReport, check_schedule

BASE = """
[architecture]
block_size = 8

[training]
batch_size = 8
tokens = {tokens}
datasets = {datasets}

[training.fade]
overlap = {overlap}
curve = "{curve}"

[optimization]
schedule = "{schedule}"
warmup_pct = 0.0
decay_pct = {decay_pct}
constant_pct = {constant_pct}

[optimization.kl]
betas = {betas}
reference_update_stages = {references}
"""


def config_of(
    tokens=(6400, 6400, 6400),
    overlap=0.5,
    curve="linear",
    schedule="wsd",
    decay_pct=0.0,
    constant_pct=0.0,
    betas=(),
    references=(),
):
    """A config with tps = 64 (8 x 8) and one built-in dataset per stage."""
    datasets = "[" + ", ".join('[{ name = "grammar" }]' for _ in tokens) + "]"
    text = BASE.format(
        tokens=list(tokens),
        datasets=datasets,
        overlap=overlap,
        curve=curve,
        schedule=schedule,
        decay_pct=decay_pct,
        constant_pct=constant_pct,
        betas=list(betas),
        references=list(references),
    )
    return loads_config(text)


def warnings_about(config, needle: str) -> list[str]:
    return [w for w in schedule_warnings(config) if needle in w]


# --- sound configs pass the oracle ---------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(configs(max_steps=300))
def test_generated_configs_pass_every_check(config):
    report = check_schedule(config)
    assert report.violations == []
    assert report.ok
    assert report.num_steps_checked == report.num_steps == Schedule(config).num_steps
    assert all(isinstance(w, str) and w for w in schedule_warnings(config))  # and warnings never fail


@settings(max_examples=30, deadline=None)
@given(
    config_variants(config_of(tokens=(6400, 30, 3200, 6400), betas=(0.0, 0.1, 0.1, 0.2), references=(1, 3)))
)
def test_variants_of_a_config_pass_every_check(config):
    assert check_schedule(config).violations == []


def test_a_plain_config_has_neither_violations_nor_warnings():
    report = check_schedule(config_of())
    assert report.violations == []
    assert report.num_steps == 300 == report.num_steps_checked
    assert schedule_warnings(config_of()) == []


def test_a_million_step_config_is_sampled():
    config = config_of(tokens=(32_000_000, 16_000_000, 100, 16_000_000), overlap=1.0, curve="sigmoid")
    start = time.process_time()
    report = check_schedule(config)
    elapsed = time.process_time() - start
    assert report.num_steps == 1_000_001
    assert report.violations == []
    assert 10_000 < report.num_steps_checked < 200_000
    # Sampled so that the suite stays quick, not a promise: generous for a busy machine.
    assert elapsed < 10.0, f"the oracle took {elapsed:.2f} s of CPU for 1M steps"


# --- warnings ----------------------------------------------------------------------------------------


def test_warns_about_a_stage_shorter_than_one_step():
    (warning,) = warnings_about(config_of(tokens=(6400, 10, 6400)), "shorter than one step")
    assert warning.startswith("stage 1: its budget of 10 tokens") and "(64 tokens)" in warning


def test_warns_about_kl_before_any_reference_refresh():
    (warning,) = warnings_about(config_of(betas=(0.0, 0.1, 0.2), references=(2,)), "KL weight")
    assert warning.startswith("stage 1: KL weight 0.1 > 0") and "[2]" in warning
    assert warnings_about(config_of(betas=(0.0, 0.1, 0.2), references=(1,)), "KL") == []
    assert warnings_about(config_of(betas=(0.1, 0.0, 0.0), references=(0,)), "KL") == []


def test_warns_about_a_fade_that_spans_most_of_a_stage():
    (warning,) = warnings_about(config_of(overlap=1.0), "inside the fades")
    # Stage 1 is faded in over its first half and out over its second; the outer stages only half.
    assert warning.startswith("stage 1: 6400 of its 6400 tokens (100%)") and "[0, 1]" in warning
    assert warning.endswith("more than 75%")
    assert warnings_about(config_of(overlap=0.7), "inside the fades") == []
    # Each ramp lies half in each stage, so only a stage faded at both ends can pass 75%: at overlap 0.75
    # exactly 75% of stage 1 is faded, which is not more than the limit.
    assert warnings_about(config_of(overlap=0.75), "inside the fades") == []
    (warning,) = warnings_about(config_of(overlap=0.76), "inside the fades")
    assert warning.startswith("stage 1: 4864 of its 6400 tokens (76%)")


def test_warns_about_an_lr_decay_that_ends_far_from_a_stage_boundary():
    # 300 steps, stage 1 entered at step 151 (step 150 is the tie half way through the fade).
    two_stages = {"tokens": (9600, 9600), "schedule": "wsds", "decay_pct": 0.1}
    (warning,) = warnings_about(config_of(**two_stages, constant_pct=0.3), "LR decay")  # steps 180..210
    assert warning.startswith("the LR decay (steps 180..210) ends 59 steps (20% of the run)")
    assert warning.endswith("(step 151)")
    assert warnings_about(config_of(**two_stages, constant_pct=0.45), "LR decay") == []  # ends at 165
    assert warnings_about(config_of(decay_pct=0.2), "LR decay") == []  # wsd ends at N


def test_warns_about_tokens_lost_to_whole_steps():
    # tps = 64: stage 0 owns steps 0..9 (x < 630); the run has 760 // 64 = 11 steps, so stage 1 gets one
    # step (64 tokens) of its 130.
    (warning,) = warnings_about(config_of(tokens=(630, 130), overlap=0.0), "lost to rounding")
    assert (
        warning.startswith("stage 1: budget 130 tokens, but only 1 step(s) (64 tokens)")
        and "66 tokens" in warning
    )
    assert warnings_about(config_of(tokens=(640, 128), overlap=0.0), "lost") == []


def test_warns_that_the_constant_schedule_ignores_warmup_pct():
    config = config_of(schedule="constant")  # (warmup_pct = 0: nothing ignored)
    assert warnings_about(config, "warmup_pct") == []
    warmed = msgspec.structs.replace(config, optimization=msgspec.structs.replace(config.optimization, warmup_pct=0.05))
    (warning,) = warnings_about(warmed, "warmup_pct")
    assert warning.startswith("optimization.warmup_pct: 0.05 is ignored by the constant schedule")
    wsd = msgspec.structs.replace(warmed, optimization=msgspec.structs.replace(warmed.optimization, schedule="wsd"))
    assert warnings_about(wsd, "warmup_pct") == []


def test_warns_about_a_run_without_steps():
    assert warnings_about(config_of(tokens=(10, 20)), "the run has no steps")
    assert check_schedule(config_of(tokens=(10, 20))).violations == []


def test_warnings_accept_the_schedule_already_built():
    config = config_of(tokens=(6400, 10, 6400), overlap=1.0, betas=(0.0, 0.1, 0.1))
    warnings = schedule_warnings(config)
    kinds = ["shorter than one step", "KL weight", "inside the fades", "KL weight"]
    assert [w.split(":")[0] for w in warnings] == ["stage 1", "stage 1", "stage 1", "stage 2"]
    assert all(kind in w for kind, w in zip(kinds, warnings, strict=True))
    assert schedule_warnings(config, Schedule(config)) == warnings


# --- violations when the code is broken ------------------------------------------------------------------


def invariants_violated(report: OracleReport) -> set[str]:
    return {v.split(":")[0] for v in report.violations}


def test_wrong_rows_are_a_violation(monkeypatch):
    def everything_to_the_first_stage(weights, num_rows):
        return (num_rows, *([0] * (len(weights) - 1)))

    monkeypatch.setattr(schedule_module, "allocate_rows", everything_to_the_first_stage)
    report = check_schedule(config_of())
    assert "rows" in invariants_violated(report)
    assert not report.ok


def test_a_tie_given_to_the_lower_stage_is_a_violation(monkeypatch):
    original = schedule_module.allocate_rows

    def ties_to_the_lower_index(weights, num_rows):
        return tuple(reversed(original(tuple(reversed(weights)), num_rows)))

    monkeypatch.setattr(schedule_module, "allocate_rows", ties_to_the_lower_index)
    # tps = 64, ramp [2048, 6144): step 36 is 1/16 into it, weights (15/16, 1/16), rows 7.5 and 0.5:
    # the first tie, which belongs to stage 1.
    report = check_schedule(config_of(tokens=(4096, 4096), overlap=1.0))
    assert invariants_violated(report) == {"rows"}
    assert report.violations[0].startswith("rows: step 36: rows (8, 0)") and "tie" in report.violations[0]


def test_weights_that_do_not_sum_to_one_are_a_violation(monkeypatch):
    original = Schedule.weights_at
    monkeypatch.setattr(Schedule, "weights_at", lambda self, x: tuple(2 * w for w in original(self, x)))
    assert "weights" in invariants_violated(check_schedule(config_of()))


def test_a_blurred_hard_switch_is_a_violation(monkeypatch):
    original = Schedule.weights_at

    def blurred(self, x):
        if any(b - 1 < x < b for b in self.boundaries[:-1]):
            return (0.5, 0.5, 0.0)
        return original(self, x)

    monkeypatch.setattr(Schedule, "weights_at", blurred)
    report = check_schedule(config_of(overlap=0.0))
    assert "hard switch" in invariants_violated(report)
    assert any("boundary 0 has overlap 0" in v for v in report.violations)


def test_a_curve_that_turns_back_is_a_violation(monkeypatch):
    monkeypatch.setattr(schedule_module, "curve_value", lambda curve, t, steepness: min(t, 1 - t) * 2)
    violated = invariants_violated(check_schedule(config_of(overlap=1.0)))
    assert {"weights", "monotone"} <= violated


def test_a_wrong_lr_is_a_violation(monkeypatch):
    original = schedule_module.lr_at
    monkeypatch.setattr(schedule_module, "lr_at", lambda opt, step, n, *a, **kw: original(opt, step, n, *a, **kw) * 1.5)
    report = check_schedule(config_of(schedule="cosine"))
    assert invariants_violated(report) == {"lr"}
    # A broken rule is reported a few times, then counted.
    assert any(v.startswith("lr: ... and ") for v in report.violations)


def test_a_late_stage_entry_is_a_violation(monkeypatch):
    original = Schedule.stage_entry_step
    monkeypatch.setattr(Schedule, "stage_entry_step", lambda self, stage: original(self, stage) + 1)
    assert "stages" in invariants_violated(check_schedule(config_of()))


def test_fade_events_at_the_wrong_step_are_a_violation(monkeypatch):
    original = Schedule.fade_start_step
    monkeypatch.setattr(Schedule, "fade_start_step", lambda self, ramp: original(self, ramp) + 1)
    assert "fades" in invariants_violated(check_schedule(config_of()))


def test_a_decision_with_hidden_memory_breaks_resume_and_is_a_violation(monkeypatch):
    """The classic impurity: planning that remembers what it already announced instead of reading the
    state. One pass looks right; resumed from a cut, the plan skips fades it "already said"."""
    original, announced = plan_module.due_events, set()

    def remembers(state, schedule, step):
        if state.num_stages_entered == 0:  # a run from the start: the memory is "per run"
            announced.clear()
        after, events = original(state, schedule, step)
        fresh = [e for e in events if (type(e), getattr(e, "boundary", None)) not in announced]
        announced.update((type(e), e.boundary) for e in events if isinstance(e, FadeStarted | FadeEnded))
        return after, fresh

    monkeypatch.setattr(plan_module, "due_events", remembers)
    report = check_schedule(config_of())
    assert invariants_violated(report) == {"resume"}


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of hanging if the guard under test does not work."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_plan_that_never_finishes_is_a_violation_not_a_hang(monkeypatch):
    original = plan_module.due_events

    def stalls_after_stage_1(state, schedule, step):
        return (state, []) if state.num_stages_entered == 2 else original(state, schedule, step)

    monkeypatch.setattr(plan_module, "due_events", stalls_after_stage_1)
    with deadline(20):  # plan() itself would loop forever here
        report = check_schedule(config_of())
    assert report.violations == [
        "events: the plan never reaches RunFinished: it stops deciding before the end"
    ]


@pytest.mark.parametrize("stage", [0, 1])
def test_the_wrong_kl_weight_is_a_violation(monkeypatch, stage):
    original = Schedule.step_plan

    def other_beta(self, step):
        plan = original(self, step)
        return dataclasses.replace(plan, beta=9.0) if plan.stage == stage else plan

    monkeypatch.setattr(Schedule, "step_plan", other_beta)
    report = check_schedule(config_of(betas=(0.0, 0.1, 0.2), references=(0,)))
    assert invariants_violated(report) == {"beta"}
