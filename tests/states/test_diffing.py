"""diffing: which events are compared, how forks are aligned, where the first divergence is found, and
the per-metric summaries after it. Synthetic logs from `strategies.simulate_run`; no engine."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.states.config_identity import config_hash
from rewind.states.config_reading import loads_config
from rewind.states.diffing import (
    CONTENT_TYPES,
    abs_delta,
    aligned_streams,
    config_changes,
    content_events,
    diff_runs,
    final_config,
    summarize_metrics,
)
from rewind.states.events import (
    CheckpointCommitted,
    CheckpointDeleted,
    ConfigChanged,
    Evaluated,
    Event,
    ForkOrigin,
    ReferenceRefreshed,
    RunResumed,
    RunStarted,
    RunStopped,
    StepCommitted,
    Validated,
)
from rewind.states.fold import fold
from rewind.states.history import anchor_end, effective
from rewind.states.state import State
from rewind.states.strategies import configs, simulate_run

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

[optimization.kl]
betas = [0.0, 0.1, 0.1]
reference_update_stages = [1]

[logging]
checkpoint_interval = 4
validation_interval = 5
keep_last_checkpoints = 2
"""
)  # N = 30; checkpoints every 4 steps and at the boundaries (11, 21); stage 1 refreshes the reference.
STRAIGHT = simulate_run(CONFIG)
SMALL_RUNS = configs(max_stages=3, max_steps=30)


def seq_events(events: list[Event]) -> list[tuple[int, Event]]:
    return list(enumerate(events))


def resumed_event(restored: State, *, fork: bool, **fields) -> RunResumed:
    """A RunResumed for a log made by hand, on either side of the schema change that takes the restored
    state out of the event: before it, the event carries that state; after it, only a fork's first
    one carries anything, a seed of its parent's state. (The diff reads neither.)"""
    if "restored" in RunResumed.__struct_fields__:
        return RunResumed(restored=restored, **fields)
    from rewind.states.fold import seed_of

    return RunResumed(seed=seed_of(restored) if fork else None, **fields)


def fork_of(parent: list[Event], checkpoint: str, parent_run: str = "/runs/parent") -> list[Event]:
    """The log `rewind fork` writes: RunStarted naming the parent, RunResumed with the parent's state as
    of `checkpoint`, then what the parent did after it (its checkpoints under names of the child's)."""
    records = effective(seq_events(parent))
    cut = next(
        i
        for i, (_, e) in enumerate(records)
        if isinstance(e, CheckpointCommitted) and e.checkpoint == checkpoint
    )
    end = anchor_end(records, cut)
    restored = fold(e for _, e in records[:end])
    started = records[0][1]
    origin = ForkOrigin(
        run=parent_run, step=restored.step, checkpoint=checkpoint, config_hash=started.config_hash
    )
    child = [
        replace(started, parent=origin),
        resumed_event(
            restored,
            fork=True,
            step=restored.step,
            tokens=restored.tokens,
            checkpoint=checkpoint,
            superseded_first_seq=1,
            superseded_last_seq=0,
            config_hash=started.config_hash,
        ),
    ]
    for _, event in records[end:]:
        if isinstance(event, ReferenceRefreshed):
            event = replace(event, checkpoint=f"{event.checkpoint}-child")
        if isinstance(event, CONTENT_TYPES):
            child.append(event)
    return child


def checkpoints_of(events: list[Event]) -> list[str]:
    return [e.checkpoint for _, e in effective(seq_events(events)) if isinstance(e, CheckpointCommitted)]


# --- what is compared ---------------------------------------------------------------------------------


def test_content_is_everything_but_bookkeeping():
    events = [*simulate_run(CONFIG, crash_after=[6]), RunStopped(step=30, tokens=480, reason="test")]
    bookkeeping = (RunStarted, RunResumed, ConfigChanged, CheckpointCommitted, CheckpointDeleted, RunStopped)
    content = content_events(seq_events(events))
    assert [s for s, _ in content] == [s for s, e in enumerate(events) if not isinstance(e, bookkeeping)]
    kinds = (
        "StageEntered FadeStarted FadeEnded ReferenceRefreshed StepCommitted Validated Evaluated RunFinished"
    )
    assert {type(e).__name__ for _, e in content} == set(kinds.split())


@settings(max_examples=40, deadline=None)
@given(SMALL_RUNS, st.lists(st.integers(0, 30), max_size=3))
def test_a_crashed_and_resumed_run_equals_the_straight_one(config, crashes):
    straight = seq_events(simulate_run(config))
    resumed = seq_events(simulate_run(config, crash_after=crashes))
    report = diff_runs(straight, resumed)
    assert report.divergence is None
    assert report.config_differences == [] and report.config_changes == {"a": [], "b": []}
    assert report.runs["a"].num_compared == report.runs["b"].num_compared == len(content_events(straight))
    assert report.runs["b"].finished


def test_reference_checkpoint_names_are_not_compared():
    a = seq_events(STRAIGHT)
    renamed = [replace(e, checkpoint="other") if isinstance(e, ReferenceRefreshed) else e for e in STRAIGHT]
    assert diff_runs(a, seq_events(renamed)).divergence is None
    restaged = [replace(e, stage=2) if isinstance(e, ReferenceRefreshed) else e for e in STRAIGHT]
    found = diff_runs(a, seq_events(restaged)).divergence
    assert found is not None and found.a.type == "ReferenceRefreshed" and found.field == "stage"


# --- the first divergence -----------------------------------------------------------------------------

FLOAT_FIELDS = ("loss", "kl", "grad_norm", "lr", "beta")


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_perturbed_step_is_located_exactly(data):
    steps = [i for i, e in enumerate(STRAIGHT) if isinstance(e, StepCommitted)]
    index = data.draw(st.sampled_from(steps))
    name = data.draw(st.sampled_from(FLOAT_FIELDS))
    delta = data.draw(st.sampled_from((1e-9, 0.5, -3.0)))
    target = STRAIGHT[index]
    perturbed = list(STRAIGHT)
    perturbed[index] = replace(target, **{name: getattr(target, name) + delta})
    report = diff_runs(seq_events(STRAIGHT), seq_events(perturbed))
    found = report.divergence
    assert found is not None and found.kind == "event"
    assert (found.a.seq, found.b.seq, found.step, found.field) == (index, index, target.step, name)
    assert (found.value_a, found.value_b) == (getattr(target, name), getattr(target, name) + delta)
    summary = {m.name: m for m in report.metrics.scalars}
    assert summary[name].num_steps_different == 1 and summary[name].at_step == target.step
    assert summary[name].max_abs_delta == abs(getattr(perturbed[index], name) - getattr(target, name))
    assert all(m.num_steps_different == 0 for m in report.metrics.scalars if m.name != name)
    # Within a tolerance larger than the change, the runs agree.
    relative = abs(delta) / max(abs(getattr(target, name)), 1e-300)
    assert diff_runs(seq_events(STRAIGHT), seq_events(perturbed), rtol=relative * 4).divergence is None


@settings(max_examples=60, deadline=None)
@given(st.integers(1, len(STRAIGHT)))
def test_a_prefix_ends_early_at_the_first_missing_content_event(cut):
    full, prefix = seq_events(STRAIGHT), seq_events(STRAIGHT[:cut])
    report = diff_runs(prefix, full)
    missing = [(s, e) for s, e in content_events(full) if s >= cut]
    if not missing:
        assert report.divergence is None
        return
    found = report.divergence
    assert found is not None and found.kind == "ends" and found.ended == "a" and found.a is None
    assert (found.b.seq, found.b.step, found.b.type) == (
        missing[0][0],
        missing[0][1].step,
        type(missing[0][1]).__name__,
    )
    assert report.runs["a"].finished is False and report.runs["b"].finished is True
    # The other way round, B is the one that ends.
    flipped = diff_runs(full, prefix).divergence
    assert flipped.ended == "b" and flipped.b is None and flipped.a == found.b
    # Metrics from the step of B's next event: steps A logged from there on are in both.
    steps_a = {e.step for e in STRAIGHT[:cut] if isinstance(e, StepCommitted) and e.step >= found.step}
    steps_b = {e.step for e in STRAIGHT if isinstance(e, StepCommitted) and e.step >= found.step}
    assert report.metrics.from_step == found.step
    assert report.metrics.num_steps_both == len(steps_a)
    assert report.metrics.num_steps_only_b == len(steps_b - steps_a)


# --- fork alignment -----------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(SMALL_RUNS, st.data())
def test_a_fork_that_repeats_its_parent_does_not_diverge(config, data):
    parent = simulate_run(config)
    names = checkpoints_of(parent)
    if not names:
        return
    checkpoint = data.draw(st.sampled_from(names))
    child = fork_of(parent, checkpoint)
    fold(child)  # the hand-made layout is a legal log
    step = child[1].step
    for a, b in ((parent, child), (child, parent)):
        report = diff_runs(seq_events(a), seq_events(b))
        assert report.divergence is None
        assert report.compared_from_step == step
    report = diff_runs(seq_events(parent), seq_events(child), child="b")
    assert report.relation.child == "b" and report.relation.parent_b.checkpoint == checkpoint
    assert report.relation.parent_a is None and report.runs["b"].start_step == step


@pytest.mark.parametrize("checkpoint", checkpoints_of(STRAIGHT)[:-1])  # the last one has no step after it
def test_a_perturbed_step_in_a_fork_is_found_at_its_step(checkpoint):
    child = fork_of(STRAIGHT, checkpoint)
    steps = [i for i, e in enumerate(child) if isinstance(e, StepCommitted)]
    index = steps[len(steps) // 2]
    target = child[index]
    child[index] = replace(target, loss=target.loss * 2)
    found = diff_runs(seq_events(STRAIGHT), seq_events(child)).divergence
    parent_seq = {e.step: i for i, e in enumerate(STRAIGHT) if isinstance(e, StepCommitted)}[target.step]
    assert found is not None and found.field == "loss" and found.step == target.step
    assert (found.a.seq, found.b.seq) == (parent_seq, index)


def test_a_fork_from_a_checkpoint_after_a_stage_entry_starts_with_the_refresh():
    # 00000011 is the boundary checkpoint: the child's first content is StageEntered, then the refresh.
    (checkpoint,) = [c for c in checkpoints_of(STRAIGHT) if c.startswith("00000011-")]
    child = fork_of(STRAIGHT, checkpoint)
    step, content_a, content_b = aligned_streams(seq_events(STRAIGHT), seq_events(child))
    assert step == 11
    first_three = [type(e).__name__ for _, e in content_b[:3]]
    assert first_three == ["StageEntered", "ReferenceRefreshed", "StepCommitted"]
    assert [type(e) for _, e in content_a] == [type(e) for _, e in content_b]


def test_a_fork_at_step_0_from_a_reference_checkpoint():
    refreshing = [replace(s, refresh_reference=i in (0, 1)) for i, s in enumerate(CONFIG.stages)]
    config = replace(CONFIG, stages=refreshing)
    parent = simulate_run(config)
    first = checkpoints_of(parent)[0]
    assert first.startswith("00000000-")  # saved for stage 0's reference, after StageEntered(0)
    child = fork_of(parent, first)
    for a, b in ((parent, child), (child, parent)):
        step, content_a, content_b = aligned_streams(seq_events(a), seq_events(b))
        assert step == 0 and len(content_a) == len(content_b) < len(content_events(seq_events(parent)))
        assert diff_runs(seq_events(a), seq_events(b)).divergence is None


def test_a_fork_from_scratch_is_compared_from_the_start():
    started = STRAIGHT[0]
    origin = ForkOrigin(run="/runs/parent", step=0, checkpoint="", config_hash=started.config_hash)
    restored = fold([started])
    resumed = resumed_event(
        restored, fork=True, step=0, tokens=0, checkpoint="", superseded_first_seq=1, superseded_last_seq=0
    )
    child = [replace(started, parent=origin), resumed, *(e for e in STRAIGHT if isinstance(e, CONTENT_TYPES))]
    for a, b in ((STRAIGHT, child), (child, STRAIGHT)):
        report = diff_runs(seq_events(a), seq_events(b))
        assert report.divergence is None and report.compared_from_step == 0
        assert report.runs["a"].num_compared == len(content_events(seq_events(STRAIGHT)))


def test_sibling_forks_are_aligned_at_the_later_fork_step():
    names = checkpoints_of(STRAIGHT)
    early, late = fork_of(STRAIGHT, names[0]), fork_of(STRAIGHT, names[3])
    report = diff_runs(seq_events(early), seq_events(late))
    assert report.divergence is None
    assert report.compared_from_step == late[1].step > early[1].step
    assert report.relation.parent_a.checkpoint == names[0] and report.relation.parent_b.checkpoint == names[3]


def test_a_fork_against_a_run_that_never_got_to_the_fork_step():
    names = checkpoints_of(STRAIGHT)
    child = fork_of(STRAIGHT, names[-2])
    short = STRAIGHT[:5]  # four steps
    report = diff_runs(seq_events(short), seq_events(child))
    found = report.divergence
    assert report.runs["a"].num_compared == 0 and found.kind == "ends" and found.ended == "a"
    assert found.b.seq == 2  # the child's first content event, right after RunResumed


# --- configs ------------------------------------------------------------------------------------------


SEEDED = replace(CONFIG, run=replace(CONFIG.run, seed=5))


def seed_change(step: int) -> ConfigChanged:
    hashes = {"config_hash": config_hash(SEEDED), "previous_hash": config_hash(CONFIG)}
    return ConfigChanged(step=step, tokens=16 * step, config=SEEDED, **hashes)


def test_config_changes_mid_run_and_the_config_in_force_at_the_end():
    cut = next(i for i, e in enumerate(STRAIGHT) if isinstance(e, CheckpointCommitted) and e.step == 8) + 1
    records = seq_events([*STRAIGHT[:cut], seed_change(8), *STRAIGHT[cut:]])
    (found,) = config_changes(records)
    assert (found.step, found.seq, found.changes) == (8, cut, ["run.seed: 0 -> 5"])
    assert final_config(records) == SEEDED
    report = diff_runs(seq_events(STRAIGHT), records)
    assert report.config_differences == ["run.seed: 0 -> 5"]
    assert report.config_changes["a"] == [] and report.config_changes["b"] == [found]
    assert report.divergence is None  # a config record is bookkeeping; the simulated steps are the same


def test_a_config_change_that_a_resume_superseded_does_not_count():
    cut = next(i for i, e in enumerate(STRAIGHT) if isinstance(e, CheckpointCommitted) and e.step == 4) + 1
    events = [*STRAIGHT[:cut], seed_change(4)]  # RunStarted .. CheckpointCommitted(4), then the change
    resumed = resumed_event(
        fold(events[:cut]),
        fork=False,
        step=4,
        tokens=64,
        checkpoint=events[cut - 1].checkpoint,
        superseded_first_seq=cut,
        superseded_last_seq=cut,
    )
    records = seq_events([*events, resumed])
    assert config_changes(records) == [] and final_config(records) == CONFIG


def test_a_fork_under_a_changed_config_is_compared_with_its_parents_config():
    child = fork_of(STRAIGHT, checkpoints_of(STRAIGHT)[2])
    step = child[1].step
    child[0] = replace(child[0], config=SEEDED, config_hash=config_hash(SEEDED))  # the child's config
    child.insert(2, seed_change(step))
    (alone,) = config_changes(seq_events(child))  # the parent's config is not in the child's log
    assert not alone.previous_known and alone.changes == [] and alone.previous_hash == config_hash(CONFIG)
    report = diff_runs(seq_events(STRAIGHT), seq_events(child))
    (change,) = report.config_changes["b"]
    assert change.previous_known and (change.step, change.changes) == (step, ["run.seed: 0 -> 5"])
    assert report.config_differences == ["run.seed: 0 -> 5"] and report.divergence is None


# --- after the divergence -----------------------------------------------------------------------------


def step(k: int, **fields) -> StepCommitted:
    values = {"stage": 0, "lr": 0.1, "beta": 0.0, "loss": 1.0, "rows": [2, 0], "cursors": {"g": 2 * k}}
    return StepCommitted(step=k, tokens=16 * k, **{**values, **fields})


def test_metric_summaries_over_steps_matched_by_step():
    a = [
        (1, step(1)),
        (2, step(2, loss=2.0, rows=[1, 1])),
        (3, Validated(step=2, tokens=32, losses={"g": 3.0, "r": 1.0})),
        (4, Evaluated(step=2, tokens=32, boundary=0, scores={"g": 0.5})),
        (5, step(3, loss=0.0)),
        (6, step(4)),
    ]
    b = [
        (1, step(1)),
        (2, step(2, loss=2.5, rows=[0, 2, 0], cursors={"g": 3})),
        (3, Validated(step=2, tokens=32, losses={"g": 3.25, "s": 9.0})),
        (4, Evaluated(step=2, tokens=32, boundary=0, scores={"g": 0.75})),
        (5, step(3, loss=-0.0, kl=math.nan)),
        (6, Evaluated(step=3, tokens=48, boundary=1, scores={"g": 1.0})),
    ]
    metrics = summarize_metrics(a, b, from_step=2)
    assert (metrics.num_steps_both, metrics.num_steps_only_a, metrics.num_steps_only_b) == (2, 1, 0)
    by_name = {m.name: m for m in metrics.scalars}
    assert (by_name["loss"].max_abs_delta, by_name["loss"].at_step) == (0.5, 2)
    assert by_name["loss"].num_steps_different == 2  # -0.0 against 0.0 counts, with a delta of 0
    assert (by_name["kl"].max_abs_delta, by_name["kl"].at_step) == (math.inf, 3)
    assert by_name["lr"].max_abs_delta == 0.0 and by_name["lr"].at_step is None
    assert (metrics.num_rows_steps_different, metrics.max_row_difference) == (1, 1)
    assert metrics.num_cursor_steps_different == 1
    (validation,) = metrics.validation  # only the dataset both runs validated
    assert (validation.name, validation.max_abs_delta, validation.at_step) == ("g", 0.25, 2)
    assert [(e.boundary, e.scores_a, e.scores_b) for e in metrics.evaluations] == [
        (0, {"g": 0.5}, {"g": 0.75}),
        (1, None, {"g": 1.0}),
    ]
    later = summarize_metrics(a, b, from_step=3)
    assert later.num_steps_both == 1 and later.validation == [] and len(later.evaluations) == 1


def test_abs_delta_is_zero_for_equal_bits_and_inf_against_a_nan():
    assert abs_delta(1.0, 3.5) == 2.5 and abs_delta(1.0, 1.0) == 0.0
    assert abs_delta(0.0, -0.0) == 0.0 and abs_delta(math.nan, math.nan) == 0.0
    assert abs_delta(math.nan, 1.0) == math.inf == abs_delta(math.inf, 1.0)
