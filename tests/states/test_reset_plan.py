"""Optimizer resets and the baseline evaluation as decisions: where the plan puts them, what the fold
accepts, and that a run cut anywhere and resumed decides them exactly as the one that never stopped.
Old runs (a RunStarted without features) are decided as before."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.states.config import Config
from rewind.states.config_reading import loads_config
from rewind.states.events import (
    CheckpointCommitted,
    Evaluated,
    NonFiniteLoss,
    OptimizerReset,
    ReferenceRefreshed,
    RunFinished,
    RunResumed,
    RunStarted,
    StageEntered,
    StepCommitted,
)
from rewind.states.fold import IllegalTransition, apply, fold, seed_of
from rewind.states.history import effective
from rewind.states.plan import Evaluate, control_intent, decide, plan, started_state
from rewind.states.schedule import Schedule
from rewind.states.state import State
from rewind.states.strategies import configs, engine_logs, simulate_run

replace = msgspec.structs.replace

CONFIG = loads_config(
    """
[architecture]
block_size = 8

[training]
batch_size = 2
tokens = [160, 160, 160]
datasets = [[{ name = "grammar" }], [{ name = "reverse" }], [{ name = "sort" }]]
evaluations = ["sort"]

[training.fade]
overlap = 0.5

[optimization]
reset_optimizer_stages = [2, 1]
reset_restarts_lr = true

[optimization.kl]
betas = [0.0, 0.1, 0.1]
reference_update_stages = [1]

[logging]
checkpoint_interval = 4
"""
)  # tps = 16, N = 30, stages entered at steps 0, 11 and 21


def with_resets(config: Config, stages: list[int], restarts: bool) -> Config:
    opt = replace(config.optimization, reset_restarts_lr=restarts)
    resets = [replace(s, reset_optimizer=i in stages) for i, s in enumerate(config.stages)]
    return replace(config, optimization=opt, stages=resets)


@st.composite
def reset_configs(draw: st.DrawFn) -> Config:
    config = draw(configs(max_stages=4, max_steps=40))
    later = list(range(1, config.num_stages))
    stages = draw(st.lists(st.sampled_from(later), unique=True)) if later else []
    return with_resets(config, stages, draw(st.booleans()))


def test_the_plan_resets_after_the_stage_entry_and_its_refresh():
    events = list(plan(Schedule(CONFIG)))
    around = [(type(e).__name__, e.step) for e in events if e.step in (11, 21)]
    assert around == [
        ("StageEntered", 11),
        ("ReferenceRefreshed", 11),
        ("OptimizerReset", 11),
        ("StageEntered", 21),
        ("OptimizerReset", 21),
    ]
    resets = [e for e in events if isinstance(e, OptimizerReset)]
    assert [(e.stage, e.step, e.lr_restarted) for e in resets] == [(1, 11, True), (2, 21, True)]


def test_no_reset_without_reset_stages_and_the_flag_is_the_configs():
    assert not any(isinstance(e, OptimizerReset) for e in plan(Schedule(with_resets(CONFIG, [], False))))
    unbroken = list(plan(Schedule(with_resets(CONFIG, [2], False))))
    assert [(e.stage, e.lr_restarted) for e in unbroken if isinstance(e, OptimizerReset)] == [(2, False)]


def entered(stage: int, step: int) -> State:
    _, state = started_state(CONFIG)
    for i in range(stage + 1):
        state = apply(state, StageEntered(step=step if i else 0, tokens=0, stage=i))
        if i == 1:
            state = apply(state, ReferenceRefreshed(step=step, tokens=0, stage=1, checkpoint=""))
    return replace(state, step=step, tokens=step * 16)


def test_a_step_may_not_run_and_the_run_may_not_finish_while_a_reset_is_due():
    state = entered(1, 11)
    assert state.pending_optimizer_resets == [1]
    assert control_intent(state, Schedule(CONFIG), 11) == OptimizerReset(step=11, tokens=176, stage=1, lr_restarted=True)
    step = StepCommitted(step=12, tokens=192, stage=1, lr=1e-3, beta=0.1, loss=1.0)
    with pytest.raises(IllegalTransition, match="an optimizer reset is due"):
        apply(state, step)
    with pytest.raises(IllegalTransition, match="an optimizer reset is still due"):
        apply(replace(state, num_stages_entered=3), RunFinished(step=11, tokens=176))
    reset = apply(state, OptimizerReset(step=11, tokens=176, stage=1, lr_restarted=True))
    assert reset.pending_optimizer_resets == [] and reset.last_optimizer_reset.step == 11
    apply(reset, step)  # legal now


@pytest.mark.parametrize("stage", [0, 2])
def test_a_reset_that_is_not_due_is_illegal(stage):
    with pytest.raises(IllegalTransition, match=f"no optimizer reset is due for stage {stage}"):
        apply(entered(1, 11), OptimizerReset(step=11, tokens=176, stage=stage))


def test_a_checkpoint_between_the_entry_and_the_reset_keeps_the_reset_due_on_resume():
    state = entered(1, 11)
    state = apply(state, CheckpointCommitted(step=11, tokens=176, checkpoint="c11", manifest_sha256="0"))
    state = apply(state, OptimizerReset(step=11, tokens=176, stage=1, lr_restarted=True))
    resumed = apply(
        state,
        RunResumed(
            step=11,
            tokens=176,
            checkpoint="c11",
            superseded_first_seq=state.anchor.next_seq,
            superseded_last_seq=state.next_seq - 1,
        ),
    )
    assert resumed.pending_optimizer_resets == [1] and resumed.last_optimizer_reset is None


@settings(max_examples=60, deadline=None)
@given(reset_configs())
def test_the_resumed_plan_is_the_one_pass_plan_with_resets(config):
    schedule = Schedule(config)
    events = list(plan(schedule))
    resets = [e.stage for e in events if isinstance(e, OptimizerReset)]
    assert resets == [i for i, s in enumerate(config.stages) if s.reset_optimizer]
    _, started = started_state(config)
    for cut in range(len(events) + 1):
        prefix = events[:cut]
        from_step = prefix[-1].step if prefix else 0
        assert list(plan(schedule, fold(prefix, started), from_step=from_step)) == events[cut:]


@settings(max_examples=40, deadline=None)
@given(st.data(), reset_configs())
def test_a_crashed_run_with_resets_keeps_exactly_the_one_pass_resets(data, config):
    one_pass = simulate_run(config)
    crashed = data.draw(engine_logs(config, max_crashes=3))
    kept = [e for _, e in effective(list(enumerate(crashed))) if isinstance(e, OptimizerReset | Evaluated)]
    assert kept == [e for e in one_pass if isinstance(e, OptimizerReset | Evaluated)]
    assert fold(crashed).last_optimizer_reset == fold(one_pass).last_optimizer_reset


# --- the baseline evaluation ------------------------------------------------------------------------


def test_a_new_run_with_evaluations_evaluates_once_before_anything_else():
    _, state = started_state(CONFIG)
    schedule = Schedule(CONFIG)
    assert state.baseline_step == 0 and decide(state, schedule) == Evaluate(-1)
    after = apply(state, Evaluated(step=0, tokens=0, boundary=-1, scores={"sort": 0.0}))
    assert after.baseline_step == -1 and after.last_evaluated_boundary == -1
    assert decide(after, schedule) != Evaluate(-1)
    events = simulate_run(CONFIG)
    baselines = [e for e in events if isinstance(e, Evaluated) and e.boundary == -1]
    assert len(baselines) == 1 and events.index(baselines[0]) == 1 and baselines[0].step == 0


def test_no_baseline_without_evaluations_or_for_a_run_started_without_the_feature():
    plain = replace(CONFIG, training=replace(CONFIG.training, evaluations=[]))
    _, state = started_state(plain)
    assert state.baseline_step == -1 and decide(state, Schedule(plain)) != Evaluate(-1)
    old = apply(State(), RunStarted(step=0, tokens=0, config=CONFIG, config_hash="h"))  # rewind <= 0.2
    assert old.features == [] and old.baseline_step == -1
    assert decide(old, Schedule(CONFIG)) != Evaluate(-1)


def test_a_resume_past_step_0_never_asks_for_the_baseline():
    _, state = started_state(CONFIG)
    at_4 = replace(state, step=4, tokens=64)  # a run whose baseline was lost with its first records
    assert decide(at_4, Schedule(CONFIG)) != Evaluate(-1)


def test_a_fork_computes_as_its_parent_and_does_not_evaluate_its_inherited_weights_again():
    parent = fold(simulate_run(CONFIG)[:40])
    checkpoint = parent.last_checkpoint
    old_parent = replace(parent, features=[])  # as if started by rewind 0.2
    for source, features in ((parent, parent.features), (old_parent, [])):
        started = RunStarted(
            step=0,
            tokens=0,
            config=CONFIG,
            config_hash="h",
            parent=_origin(),
            features=["baseline_evaluation", "lr_warmup_floor"],
        )
        state = apply(State(), started)
        seed = seed_of(replace(source, step=checkpoint.step, tokens=checkpoint.tokens))
        seeded = apply(
            state,
            RunResumed(
                step=checkpoint.step,
                tokens=checkpoint.tokens,
                checkpoint=checkpoint.checkpoint,
                superseded_first_seq=1,
                superseded_last_seq=0,
                seed=seed,
            ),
        )
        assert seeded.features == features  # the parent's: an unchanged fork is the parent
        assert seeded.baseline_step == -1  # the parent evaluated those weights; diff would trip on it
        assert decide(seeded, Schedule(CONFIG)) != Evaluate(-1)
        assert seeded.last_optimizer_reset == parent.last_optimizer_reset


def _origin():
    from rewind.states.events import ForkOrigin

    return ForkOrigin(run="/runs/parent", step=0, checkpoint="c", config_hash="h")


def test_non_finite_loss_names_the_quantity_and_old_records_decode_as_the_loss():
    old = msgspec.json.encode(
        {"type": "NonFiniteLoss", "step": 3, "tokens": 48, "loss": 1.0, "action": "skip"}
    )
    from rewind.states.events import AnyEvent

    assert msgspec.json.decode(old, type=AnyEvent).quantity == "loss"
    event = NonFiniteLoss(step=3, tokens=48, loss=1.0, action="skip", quantity="grad_norm")
    assert msgspec.json.decode(msgspec.json.encode(event), type=AnyEvent) == event
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(old.replace(b'"skip"', b'"skip","quantity":"lr"'), type=AnyEvent)
