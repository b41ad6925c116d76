"""The entry decision (rewind.states.entry): the restore point chosen one way, the tokenizer rule stated
once (rewind.states.check_continuation), the records a resume and a fork append
(rewind.states.opening), each checked by the fold before anything is written."""

from __future__ import annotations

import msgspec
import pytest

from rewind.states.check_continuation import tokenizer_problem
from rewind.states.config_identity import config_hash
from rewind.states.config_reading import loads_config
from rewind.states.entry import EntryRefused, checkpoint_points, choose_point, site_of
from rewind.states.events import CheckpointCommitted, ConfigChanged, ForkOrigin, RunResumed, RunStarted
from rewind.states.fold import fold
from rewind.states.history import anchor_end, point_of
from rewind.states.opening import Computed, fork_records, resume_records
from rewind.states.strategies import simulate_run

replace = msgspec.structs.replace

CONFIG = loads_config(
    """
[architecture]
block_size = 8

[training]
batch_size = 2
tokens = [160, 160, 160]
datasets = [[{ name = "grammar" }], [{ name = "reverse" }], [{ name = "sort" }]]

[optimization.kl]
betas = [0.0, 0.1, 0.1]
reference_update_stages = [1]

[logging]
checkpoint_interval = 4
keep_last_checkpoints = 2
"""
)
HERE = Computed(device="cpu", world_size=1, num_threads=2)


def crashed_after(step: int) -> list:
    """The run's log up to just before the checkpoint after the one at `step` (a process that died)."""
    log = simulate_run(CONFIG)
    at = next(i for i, e in enumerate(log) if isinstance(e, CheckpointCommitted) and e.step == step)
    end = anchor_end(list(enumerate(log)), at)
    return log[: next(i for i in range(end, len(log)) if isinstance(log[i], CheckpointCommitted))]


def test_a_runs_tokenizer_is_fixed_when_it_starts():
    other = replace(CONFIG, tokenizer=replace(CONFIG.tokenizer, train_vocab_size=300))
    assert tokenizer_problem(CONFIG, CONFIG) == ""
    assert tokenizer_problem(CONFIG, replace(CONFIG, run=replace(CONFIG.run, seed=9))) == ""
    assert "a run's tokenizer is fixed when it starts" in tokenizer_problem(CONFIG, other)


def test_restore_points_are_chosen_by_name_step_or_bound_last_or_first():
    records = list(enumerate(simulate_run(CONFIG)))
    points = checkpoint_points(records)
    names = [p.checkpoint for p in points]
    assert names and len(set(names)) == len(names) and all(names)  # once per checkpoint, each a checkpoint
    steps = [p.state.step for p in points]
    assert steps == sorted(steps) and steps[0] == 4
    assert choose_point(points) is points[-1] and choose_point(points, first=True) is points[0]
    assert choose_point(points, step=8).state.step == 8
    assert choose_point(points, step=9) is None
    assert choose_point(points, at_or_before=9).state.step == 8
    assert choose_point(points, at_or_before=3) is None
    assert choose_point(points, name=names[1]) is points[1]
    assert choose_point(points, name="00000004-00000000") is None


def test_a_resume_appends_run_resumed_and_a_config_change_when_the_config_differs():
    log = crashed_after(8)
    current = fold(log)
    point = point_of(current)
    (resumed,) = resume_records(current, point, len(log) - 1, HERE)
    assert isinstance(resumed, RunResumed) and (resumed.step, resumed.checkpoint) == (8, point.checkpoint)
    assert (resumed.superseded_first_seq, resumed.superseded_last_seq) == (point.seq + 1, len(log) - 1)
    assert (resumed.device, resumed.world_size, resumed.num_threads) == ("cpu", 1, 2)
    changed = replace(CONFIG, run=replace(CONFIG.run, seed=CONFIG.run.seed + 1))
    data = {"data": {}, "tokenizer": "a" * 64}
    first, change = resume_records(current, point, len(log) - 1, HERE, changed, data)
    assert first == resumed and isinstance(change, ConfigChanged) and change.step == 8
    assert (change.config_hash, change.previous_hash) == (config_hash(changed), point.state.config_hash)
    # The data's identities go on record only in a run that records them.
    recorded = change.tokenizer == "a" * 64
    assert recorded == ("data_identity" in current.features)
    older = replace(current, features=[f for f in current.features if f != "data_identity"])
    assert resume_records(older, point, len(log) - 1, HERE, changed, data)[1].tokenizer == ""


def test_a_resume_the_fold_refuses_is_a_run_problem_and_a_refused_config_a_usage_one():
    log = crashed_after(8)
    current = fold(log)
    wrong_end = len(log) + 5  # not where the log ends
    with pytest.raises(EntryRefused, match="cannot resume") as refused:
        resume_records(current, point_of(current), wrong_end, HERE)
    assert refused.value.exit_code == 1
    changed = replace(CONFIG, run=replace(CONFIG.run, seed=CONFIG.run.seed + 1))
    with pytest.raises(EntryRefused, match="cannot fork in place") as refused:
        resume_records(current, point_of(current), wrong_end, HERE, changed)
    assert refused.value.exit_code == 2


def test_a_fork_starts_naming_its_parent_and_goes_on_from_the_parents_control_state():
    records = list(enumerate(simulate_run(CONFIG)))
    started = records[0][1]
    assert isinstance(started, RunStarted)
    point = choose_point(checkpoint_points(records), at_or_before=13)
    assert point is not None
    origin = ForkOrigin(
        run="/parent", step=point.state.step, checkpoint=point.checkpoint, config_hash=point.state.config_hash
    )
    same = fork_records(started, point, CONFIG, CONFIG, origin, 0, None, "9.9")
    child, resumed = same
    assert isinstance(child, RunStarted) and child.parent == origin and child.rewind_version == "9.9"
    assert child.num_threads == point.state.num_threads and child.features == started.features
    assert (
        isinstance(resumed, RunResumed)
        and resumed.seed is not None
        and resumed.checkpoint == point.checkpoint
    )
    assert fold(same).step == point.state.step
    assert fork_records(started, point, CONFIG, CONFIG, origin, 3, None, "9.9")[0].num_threads == 3  # --threads
    changed = replace(CONFIG, run=replace(CONFIG.run, seed=CONFIG.run.seed + 1))
    *_, change = fork_records(started, point, CONFIG, changed, origin, 0, None, "9.9")
    assert isinstance(change, ConfigChanged) and change.config_hash == config_hash(changed)


def test_the_site_is_what_the_run_records():
    state = fold(simulate_run(CONFIG)[:1])
    site = site_of(state, reading=True, num_threads=5)
    assert (site.cpu_capability, site.device, site.num_threads, site.reading) == (
        state.cpu_capability,
        state.device,
        5,
        True,
    )
    assert site_of(state).num_threads == state.num_threads and not site_of(state).reading
