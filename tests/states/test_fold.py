"""fold: a left fold over legal transitions. Splits, resumes, illegal events, retention and duties."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.states.config_reading import loads_config
from rewind.states.events import (
    EVENT_TYPES,
    CheckpointCommitted,
    CheckpointDeleted,
    Evaluated,
    FadeEnded,
    FadeStarted,
    ReferenceRefreshed,
    RunFinished,
    RunResumed,
    RunStopped,
    StackAppended,
    StageEntered,
    StepCommitted,
    Validated,
)
from rewind.states.fold import IllegalTransition, apply, fold, seed_of
from rewind.states.history import anchor_end, effective
from rewind.states.plan import (
    DeleteCheckpoints,
    Evaluate,
    TakeCheckpoint,
    Validate,
    checkpoints_to_delete,
    decide,
    pending_duty,
    plan,
    started_state,
)
from rewind.states.schedule import Schedule
from rewind.states.state import SEED_FALLS_BACK_TO_CHILD, ForkSeed, Reference, State
from rewind.states.strategies import configs, cut_points, engine_logs, simulate_run
from rewind.states.transition import MUTATORS

replace = msgspec.structs.replace
TINY_RUNS = configs(max_stages=4, max_steps=40)

CONFIG = loads_config(
    """
[architecture]
block_size = 8

[training]
batch_size = 2
tokens = [160, 160, 160]
datasets = [[{ name = "grammar" }], [{ name = "reverse" }], [{ name = "sort" }]]

[training.fade]
overlap = 0.5

[optimization.kl]
betas = [0.0, 0.1, 0.1]
reference_update_stages = [1]

[logging]
checkpoint_interval = 4
validation_interval = 5
keep_last_checkpoints = 2
"""
)  # tps = 16, N = 30. Steps 10 and 20 sit half way through the fades: a tie, which goes to the lower
# stage, so stages 1 and 2 are entered at steps 11 and 21.


def step_event(state: State, **fields) -> StepCommitted:
    step = state.step + 1
    values = {"step": step, "tokens": step * state.tokens_per_step, "stage": max(state.stage, 0)}
    return StepCommitted(**{**values, "lr": 1e-3, "beta": 0.0, "loss": 1.0, **fields})


def checkpoint_event(state: State, name: str, reason: str = "interval") -> CheckpointCommitted:
    return CheckpointCommitted(
        step=state.step, tokens=state.tokens, checkpoint=name, manifest_sha256="0" * 64, reason=reason
    )


# --- the fold splits anywhere ------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.data(), TINY_RUNS)
def test_fold_of_a_concatenation_is_fold_from_the_first_part(data, config):
    events = data.draw(engine_logs(config))
    whole = fold(events)
    assert whole.finished
    state = State()
    for split in range(len(events) + 1):
        # `state` is fold(events[:split]), built one event at a time.
        assert fold(events[split:], state) == whole
        if split < len(events):
            state = apply(state, events[split])


@settings(max_examples=60, deadline=None)
@given(TINY_RUNS)
def test_resumed_plan_is_the_one_pass_plan_for_every_cut(config):
    schedule = Schedule(config)
    events = list(plan(schedule))
    _, started = started_state(config)
    for cut in range(len(events) + 1):
        prefix = events[:cut]
        from_step = prefix[-1].step if prefix else 0
        assert list(plan(schedule, fold(prefix, started), from_step=from_step)) == events[cut:]


@settings(max_examples=60, deadline=None)
@given(st.data(), TINY_RUNS)
def test_a_run_crashed_and_resumed_anywhere_ends_like_the_one_that_never_stopped(data, config):
    one_pass = simulate_run(config)
    crashed = data.draw(engine_logs(config, max_crashes=3))
    resumes = [e for e in crashed if isinstance(e, RunResumed)]
    a, b = fold(one_pass), fold(crashed)
    assert len(b.resumes) == len(resumes)
    # A crash between a checkpoint record and its retention deletions (two commits) leaves those
    # checkpoints live, files and all, until the next save; nothing else may differ.
    assert {c.checkpoint for c in a.live_checkpoints} <= {c.checkpoint for c in b.live_checkpoints}
    # Bookkeeping of the log itself (record count, resumes, the anchor's copy of both) differs too.
    log_only = {"resumes": [], "next_seq": 0, "anchor": None, "anchor_open": False}
    assert replace(b, live_checkpoints=a.live_checkpoints, **log_only) == replace(a, **log_only)
    # What still counts in the crashed log is the one-pass log, up to where the deletions were written.
    kept = [
        e for _, e in effective(list(enumerate(crashed))) if not isinstance(e, RunResumed | CheckpointDeleted)
    ]
    assert kept == [e for e in one_pass if not isinstance(e, CheckpointDeleted)]


@settings(max_examples=30, deadline=None)
@given(st.data(), TINY_RUNS)
def test_a_cut_log_resumes_into_the_rest_of_the_plan(data, config):
    """Cut the dry-run plan anywhere (as cut_points draws it): the rest is what resuming plans."""
    events = list(plan(Schedule(config)))
    cut = data.draw(cut_points(events))
    _, started = started_state(config)
    state = fold(events[:cut], started)
    rest = list(plan(Schedule(config), state, from_step=events[cut - 1].step if cut else 0))
    assert [*events[:cut], *rest] == events


# --- RunResumed ----------------------------------------------------------------------------------------


def test_run_resumed_restores_the_folds_own_anchor_and_records_what_it_superseded():
    log = simulate_run(CONFIG)
    checkpoint_seq = next(i for i, e in enumerate(log) if isinstance(e, CheckpointCommitted) and e.step == 8)
    end = anchor_end(list(enumerate(log)), checkpoint_seq)  # with the retention deletions that follow it
    at_checkpoint = fold(log[:end])
    assert at_checkpoint.step == 8 and at_checkpoint.last_checkpoint.step == 8
    # The dead process got further than step 8, but not to its next checkpoint, before it died.
    crashed = log[: next(i for i in range(end, len(log)) if isinstance(log[i], CheckpointCommitted))]
    later = fold(crashed)
    assert later.step > 8 and later.anchor == replace(at_checkpoint, anchor=None)
    last_seq = len(crashed) - 1
    resumed_event = RunResumed(
        step=8,
        tokens=8 * 16,
        checkpoint=at_checkpoint.last_checkpoint.checkpoint,
        superseded_first_seq=end,
        superseded_last_seq=last_seq,
    )
    resumed = apply(later, resumed_event)
    ignored = {"resumes": [], "anchor": None, "next_seq": 0, "anchor_open": False}
    assert replace(resumed, **ignored) == replace(at_checkpoint, **ignored)
    assert resumed.next_seq == len(crashed) + 1 and resumed.anchor_open
    (record,) = resumed.resumes
    assert (record.first_seq, record.last_seq, record.step) == (end, last_seq, 8)
    assert record.checkpoint == at_checkpoint.last_checkpoint.checkpoint
    # The same resume folded over the effective records only (the superseded ones skipped) agrees.
    assert apply(fold(log[:end]), resumed_event) == resumed
    # A second resume (the first one is now the anchor) keeps the first one's record and adds its own.
    again = apply(
        resumed, replace(resumed_event, superseded_first_seq=last_seq + 2, superseded_last_seq=last_seq + 1)
    )
    assert [r.first_seq for r in again.resumes] == [end, last_seq + 2]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"checkpoint": "00000004-00000000"}, "the log's restore point is"),
        ({"checkpoint": ""}, "the log's restore point is"),
        ({"superseded_first_seq": 3}, "start at seq"),
        ({"superseded_last_seq": 5}, "but it is record"),
        ({"step": 7, "tokens": 7 * 16}, "the restore point is at step 8"),
    ],
)
def test_a_resume_that_disagrees_with_the_log_is_illegal(change, reason):
    log = simulate_run(CONFIG)
    checkpoint_seq = next(i for i, e in enumerate(log) if isinstance(e, CheckpointCommitted) and e.step == 8)
    end = anchor_end(list(enumerate(log)), checkpoint_seq)
    crashed = log[: next(i for i in range(end, len(log)) if isinstance(log[i], CheckpointCommitted))]
    honest = RunResumed(
        step=8,
        tokens=8 * 16,
        checkpoint=log[checkpoint_seq].checkpoint,
        superseded_first_seq=end,
        superseded_last_seq=len(crashed) - 1,
    )
    apply(fold(crashed), honest)
    with pytest.raises(IllegalTransition, match=reason):
        apply(fold(crashed), replace(honest, **change))


def test_run_resumed_clears_a_stop_from_the_start():
    _, started = started_state(CONFIG)
    stopped = apply(started, RunStopped(step=0, tokens=0, reason="Ctrl-C"))
    assert stopped.stopped_reason == "Ctrl-C"
    event = RunResumed(step=0, tokens=0, checkpoint="", superseded_first_seq=1, superseded_last_seq=1)
    resumed = apply(stopped, event)
    assert resumed.stopped_reason == "" and resumed.next_seq == 3
    with pytest.raises(IllegalTransition, match="restore point is the start"):
        apply(stopped, replace(event, checkpoint="00000000-00000000"))


def test_only_a_fork_may_seed_its_state():
    _, started = started_state(CONFIG)
    seed = ForkSeed(stage=0, num_stages_entered=1, live_checkpoints=[])
    event = RunResumed(step=0, tokens=0, checkpoint="c", superseded_first_seq=1, superseded_last_seq=0, seed=seed)
    with pytest.raises(IllegalTransition, match="only a fork"):
        apply(started, event)
    forked = replace(started, parent_run="/runs/parent")
    with pytest.raises(IllegalTransition, match="does not hold checkpoint c"):
        apply(forked, event)
    ref = CheckpointCommitted(checkpoint="c", step=4, tokens=64, reason="interval", manifest_sha256="0" * 64)
    good = replace(event, step=4, tokens=64, seed=replace(seed, live_checkpoints=[ref], cursors={"grammar": 9}))
    assert apply(forked, good).cursors == {"grammar": 9} and apply(forked, good).last_checkpoint == ref
    with pytest.raises(IllegalTransition, match="cursors must be >= 0"):
        apply(forked, replace(good, seed=replace(good.seed, cursors={"grammar": -1})))
    with pytest.raises(IllegalTransition, match="step and tokens disagree"):
        apply(forked, replace(good, tokens=65))


# --- illegal transitions -------------------------------------------------------------------------------


def started_and_entered() -> State:
    _, state = started_state(CONFIG)
    return apply(state, StageEntered(step=0, tokens=0, stage=0))


def test_events_before_run_started_are_illegal():
    for event in (StageEntered(step=0, tokens=0, stage=0), step_event(State(tokens_per_step=16))):
        with pytest.raises(IllegalTransition, match="must be RunStarted"):
            apply(State(), event)


def test_run_started_twice_is_illegal():
    started, state = started_state(CONFIG)
    with pytest.raises(IllegalTransition, match="already started"):
        apply(state, started)


@pytest.mark.parametrize("stage", [2, 0, -1])
def test_stages_must_be_entered_in_order(stage):
    with pytest.raises(IllegalTransition, match="expected stage 1 next"):
        apply(started_and_entered(), StageEntered(step=0, tokens=0, stage=stage))


def test_no_stage_beyond_the_last():
    state = started_and_entered()
    for stage in (1, 2):
        state = apply(state, StageEntered(step=0, tokens=0, stage=stage))
        if stage == 1:
            state = apply(state, ReferenceRefreshed(step=0, tokens=0, stage=1, checkpoint="c"))
    with pytest.raises(IllegalTransition, match="only 3 stages"):
        apply(state, StageEntered(step=0, tokens=0, stage=3))


@pytest.mark.parametrize(
    ("fields", "match"),
    [({"step": 2, "tokens": 32}, "expected step 1"), ({"tokens": 17}, "expected 16 tokens")],
)
def test_step_committed_with_the_wrong_step_or_tokens_is_illegal(fields, match):
    state = started_and_entered()
    with pytest.raises(IllegalTransition, match=match):
        apply(state, step_event(state, **fields))


def test_a_step_may_not_run_while_a_reference_refresh_is_due():
    state = apply(started_and_entered(), StageEntered(step=0, tokens=0, stage=1))
    assert state.pending_refreshes == [1]
    with pytest.raises(IllegalTransition, match="refresh is due"):
        apply(state, step_event(state))


def test_a_reference_refresh_that_is_not_due_is_illegal():
    state = started_and_entered()
    with pytest.raises(IllegalTransition, match="no refresh is due for stage 0"):
        apply(state, ReferenceRefreshed(step=0, tokens=0, stage=0))
    state = apply(state, StageEntered(step=0, tokens=0, stage=1))
    with pytest.raises(IllegalTransition, match="no refresh is due for stage 2"):
        apply(state, ReferenceRefreshed(step=0, tokens=0, stage=2))


def test_fades_start_in_order_and_end_only_when_running():
    state = started_and_entered()
    with pytest.raises(IllegalTransition, match="fade 0 is not running"):
        apply(state, FadeEnded(step=0, tokens=0, boundary=0))
    with pytest.raises(IllegalTransition, match="boundary 2 does not exist"):
        apply(state, FadeStarted(step=0, tokens=0, boundary=2))
    state = apply(state, FadeStarted(step=0, tokens=0, boundary=1))
    with pytest.raises(IllegalTransition, match="in order"):
        apply(state, FadeStarted(step=0, tokens=0, boundary=0))
    state = apply(state, FadeEnded(step=0, tokens=0, boundary=1))
    with pytest.raises(IllegalTransition, match="not running"):
        apply(state, FadeEnded(step=0, tokens=0, boundary=1))


def test_after_run_finished_nothing_is_legal():
    state = fold(simulate_run(CONFIG))
    assert state.finished
    for event in (
        RunFinished(step=30, tokens=480),
        Validated(step=30, tokens=480, losses={}),
        RunStopped(step=30, tokens=480, reason="late"),
    ):
        with pytest.raises(IllegalTransition, match="already finished"):
            apply(state, event)


def test_run_finished_needs_every_stage_and_no_pending_refresh():
    with pytest.raises(IllegalTransition, match="only 1 of 3 stages"):
        apply(started_and_entered(), RunFinished(step=0, tokens=0))
    state = started_and_entered()
    state = apply(state, StageEntered(step=0, tokens=0, stage=1))
    state = apply(state, StageEntered(step=0, tokens=0, stage=2))
    with pytest.raises(IllegalTransition, match="refresh is still due"):
        apply(state, RunFinished(step=0, tokens=0))


def test_checkpoints_deleted_must_be_live_and_not_the_reference():
    state = started_and_entered()
    state = apply(state, checkpoint_event(state, "a", "reference"))
    state = apply(state, StageEntered(step=0, tokens=0, stage=1))
    state = apply(state, ReferenceRefreshed(step=0, tokens=0, stage=1, checkpoint="a"))
    assert state.reference == Reference(stage=1, step=0, checkpoint="a")
    with pytest.raises(IllegalTransition, match="holds the current reference"):
        apply(state, CheckpointDeleted(step=0, tokens=0, checkpoint="a"))
    with pytest.raises(IllegalTransition, match="not live"):
        apply(state, CheckpointDeleted(step=0, tokens=0, checkpoint="b"))


def test_after_step_records_must_carry_the_current_step():
    state = started_and_entered()
    state = apply(state, step_event(state))
    for event in (
        checkpoint_event(replace(state, step=2), "x"),
        Validated(step=0, tokens=0, losses={}),
        Evaluated(step=2, tokens=32, boundary=0, scores={}),
    ):
        with pytest.raises(IllegalTransition, match="step"):
            apply(state, event)


def test_stacks_are_appended_in_order():
    # Stack 0 is the initial model: the first to join is stack 1, the next stack 2.
    state = apply(started_and_entered(), StackAppended(step=0, tokens=0, stack=1, num_blocks=2))
    assert [s.stack for s in state.layout.stacks] == [0, 1]
    with pytest.raises(IllegalTransition, match="expected stack 2 next"):
        apply(state, StackAppended(step=0, tokens=0, stack=1, num_blocks=2))


def test_an_illegal_transition_names_the_event_and_the_reason():
    event = StageEntered(step=3, tokens=48, stage=2)
    with pytest.raises(IllegalTransition) as info:
        apply(started_and_entered(), event)
    assert info.value.event is event
    assert str(info.value).startswith("StageEntered at step 3: expected stage 1")


def test_every_event_type_has_exactly_one_mutator():
    # Each is registered by `@mutates` where it is declared; apply would call one that is missing an
    # unknown event type.
    assert set(MUTATORS) == set(EVENT_TYPES.values())


def test_a_fork_seed_field_is_the_state_field_of_its_name_and_type():
    # So `seed_of` and the fold copy them by name, and a field a fork carries is declared once.
    seed_fields = {f.name: f.type for f in msgspec.structs.fields(ForkSeed)}
    state_fields = {f.name: f.type for f in msgspec.structs.fields(State)}
    assert {name: state_fields.get(name) for name in seed_fields} == seed_fields
    assert set(SEED_FALLS_BACK_TO_CHILD) <= set(seed_fields)


def test_a_fork_adopts_every_field_of_its_seed():
    parent = fold(simulate_run(CONFIG)[:-1])
    checkpoint = parent.last_checkpoint
    assert checkpoint is not None
    seed = seed_of(replace(parent, step=checkpoint.step, tokens=checkpoint.tokens))
    _, started = started_state(CONFIG)
    forked = replace(started, parent_run="runs/parent")
    event = RunResumed(
        step=checkpoint.step,
        tokens=checkpoint.tokens,
        checkpoint=checkpoint.checkpoint,
        superseded_first_seq=forked.next_seq,
        superseded_last_seq=forked.next_seq - 1,
        seed=seed,
    )
    child = apply(forked, event)
    assert seed_of(child) == seed
    # An unset config-derived figure is the child's own.
    unset = replace(seed, num_steps=0, config_hash="")
    child = apply(forked, replace(event, seed=unset))
    assert (child.num_steps, child.config_hash) == (forked.num_steps, forked.config_hash)


def test_the_state_holds_the_events_it_keeps_not_copies():
    committed = CheckpointCommitted(step=0, tokens=0, checkpoint="c0", manifest_sha256="0" * 64, files={"a": "b"})
    state = apply(started_and_entered(), committed)
    assert state.last_checkpoint is committed and state.live_checkpoints[-1] is committed


def test_an_event_type_without_a_mutator_is_illegal():
    class Unregistered(StageEntered, frozen=True, kw_only=True, tag="Unregistered"):
        pass

    with pytest.raises(IllegalTransition, match="unknown event type"):
        apply(started_and_entered(), Unregistered(step=0, tokens=0, stage=1))


# --- retention and duties ------------------------------------------------------------------------------


def live(*specs: tuple[str, int, str]) -> list[CheckpointCommitted]:
    return [
        CheckpointCommitted(checkpoint=name, step=step, tokens=step * 16, reason=reason, manifest_sha256="")
        for name, step, reason in specs
    ]


def test_checkpoints_to_delete_keeps_the_last_boundaries_final_and_reference():
    checkpoints = live(
        ("c4", 4, "interval"),
        ("c8", 8, "interval"),
        ("c10", 10, "boundary"),
        ("c12", 12, "interval"),
        ("c16", 16, "interval"),
        ("c20", 20, "reference"),
    )
    state = replace(State(), live_checkpoints=checkpoints)
    assert checkpoints_to_delete(state, keep_last=2) == ["c4", "c8", "c12"]
    assert checkpoints_to_delete(state, keep_last=4) == ["c4", "c8"]
    assert checkpoints_to_delete(state, keep_last=5) == ["c4"]
    with_reference = replace(state, reference=Reference(stage=1, step=8, checkpoint="c8"))
    assert checkpoints_to_delete(with_reference, keep_last=2) == ["c4", "c12"]
    # Oldest first, whatever order they went live in.
    shuffled = replace(state, live_checkpoints=[checkpoints[3], checkpoints[0], *checkpoints[4:]])
    assert checkpoints_to_delete(shuffled, keep_last=1) == ["c4", "c12", "c16"]
    assert checkpoints_to_delete(replace(state, live_checkpoints=live(("f", 30, "final"))), 1) == []


def test_runs_started_with_the_feature_keep_reference_checkpoints():
    # A boundary checkpoint's restore state names the reference of its time; growth takes reference
    # checkpoints after each growth, which a fork from the boundary needs long after the next refresh.
    checkpoints = live(("r4", 4, "reference"), ("c8", 8, "interval"), ("c12", 12, "interval"))
    old = replace(State(), live_checkpoints=checkpoints)  # started before the feature: as it was
    assert checkpoints_to_delete(old, keep_last=1) == ["r4", "c8"]
    new = replace(old, features=["reference_checkpoints_kept"])
    assert checkpoints_to_delete(new, keep_last=1) == ["c8"]
    grown = replace(old, num_growths=1)  # an old run that gained growth keeps them too
    assert checkpoints_to_delete(grown, keep_last=1) == ["c8"]


def test_duties_after_each_step_of_a_small_run():
    schedule = Schedule(CONFIG)
    assert schedule.num_steps == 30 and schedule.entry_steps == (0, 11, 21)
    _, state = started_state(CONFIG)

    def duty(step: int, **fields):
        return pending_duty(replace(state, step=step, **fields), schedule)

    def at(step: int, reason: str) -> CheckpointCommitted:
        return CheckpointCommitted(checkpoint=f"c{step}", step=step, tokens=0, reason=reason, manifest_sha256="")

    assert duty(3) is None
    assert duty(4) == TakeCheckpoint("interval")
    assert duty(5) == Validate() and duty(5, last_validated_step=5) is None
    assert duty(20) == Validate() and duty(20, last_validated_step=20) == TakeCheckpoint("interval")
    # Stage 1 starts at step 11: after 11 steps, stage 0's boundary is evaluated and checkpointed.
    assert duty(11) == Evaluate(0) and duty(11, last_evaluated_boundary=0) == TakeCheckpoint("boundary")
    assert duty(21) == Evaluate(1)
    assert duty(30) == Validate()
    assert duty(30, last_validated_step=30) == Evaluate(2)
    assert duty(30, last_validated_step=30, last_evaluated_boundary=2) == TakeCheckpoint("final")
    # Resuming onto a step whose duties were done asks for nothing again.
    assert duty(11, last_evaluated_boundary=0, last_checkpoint=at(11, "boundary")) is None
    # Retention runs once the checkpoint is on record.
    held = [at(4, "interval"), at(8, "interval"), at(11, "boundary"), at(12, "interval")]
    crowded = {"last_checkpoint": held[-1], "live_checkpoints": held}
    assert duty(12, **crowded) == DeleteCheckpoints(("c4", "c8"))


def test_decide_asks_for_a_checkpoint_before_a_reference_refresh_that_has_none():
    schedule = Schedule(CONFIG)
    _, state = started_state(CONFIG)
    due = replace(state, pending_refreshes=[0], num_stages_entered=1, stage=0)
    assert decide(due, schedule) == TakeCheckpoint("reference")
    held = CheckpointCommitted(checkpoint="c0", step=0, tokens=0, reason="reference", manifest_sha256="")
    refresh = ReferenceRefreshed(step=0, tokens=0, stage=0, checkpoint="c0")  # the checkpoint it holds
    assert decide(replace(due, last_checkpoint=held), schedule) == refresh


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 200),
    st.lists(st.tuples(st.integers(0, 220), st.integers(-5, 60)), max_size=30),
)
def test_effective_in_one_merge_pass_is_the_definition(num_records, declared):
    """`effective` keeps exactly the records no RunResumed's range covers, however many resumes
    (overlapping, touching, empty ranges included) and wherever they sit in the log."""
    records: list = [(seq, StageEntered(step=0, tokens=0, stage=0)) for seq in range(num_records)]
    ranges = [(first, first + length) for first, length in declared]
    for (first, last), seq in zip(ranges, range(num_records), strict=False):
        resumed = RunResumed(step=0, tokens=0, checkpoint="", superseded_first_seq=first, superseded_last_seq=last)
        records[seq] = (seq, resumed)
    used = [(e.superseded_first_seq, e.superseded_last_seq) for _, e in records if isinstance(e, RunResumed)]
    expected = [(s, e) for s, e in records if not any(a <= s <= b for a, b in used)]
    assert effective(records) == expected


@settings(max_examples=150, deadline=None)
@given(st.data(), TINY_RUNS)
def test_what_a_resume_loads_is_never_deleted(data, config):
    """At every record, the restore point's checkpoint and the reference it points to are live: a crash
    there resumes from files that exist. (Retention once deleted the old reference right after a
    refresh, while the restore point still named it.)"""
    refresh_everywhere = [msgspec.structs.replace(s, refresh_reference=True) for s in config.stages]
    config = msgspec.structs.replace(config, stages=refresh_everywhere)
    events = data.draw(engine_logs(config, max_crashes=2))
    state = State()
    for event in events:
        state = apply(state, event)
        anchor = state.anchor
        live = {c.checkpoint for c in state.live_checkpoints}
        if anchor.last_checkpoint is not None:
            assert anchor.last_checkpoint.checkpoint in live, event
        if anchor.reference is not None:
            assert anchor.reference.checkpoint in live, event
