"""When a grpo stage samples: before the first step of each window of num_iterations steps from its
entry, once (a resume inside a window samples nothing; one at its first step samples again, as the
straight run did); the fold takes the prompt cursors from the record; a forged rollout path is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rewind.states.admission import Admission, rollout_path_problem
from rewind.states.config_reading import loads_config
from rewind.states.events import RolloutsRecorded, StepCommitted
from rewind.states.history import effective
from rewind.states.schedule import Schedule
from rewind.states.strategies import simulate_run
from tests.conftest import EXAMPLES

TINY = (EXAMPLES / "tiny.toml").read_text()
THIRD = 'datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]\nbeta = 0.2'
GRPO = loads_config(
    TINY.replace(THIRD, 'strategy = "grpo"\ndatasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]\n'
                 "grpo = { num_iterations = 3 }")
    .replace("[training.fade]\noverlap = 0.5", "[training.fade]\noverlap = 0.0")
    .replace("checkpoint_interval = 40", "checkpoint_interval = 7")
)


def _sampled_at(events) -> list[int]:
    return [e.step for e in events if isinstance(e, RolloutsRecorded)]


def test_a_grpo_stage_samples_before_the_first_step_of_each_window():
    schedule = Schedule(GRPO)
    start, end = schedule.entry_steps[2], schedule.num_steps
    assert _sampled_at(simulate_run(GRPO)) == list(range(start, end, 3))
    steps = [e for e in simulate_run(GRPO) if isinstance(e, StepCommitted)]
    assert [e.step for e in steps] == list(range(1, end + 1))  # every step still runs, once


@given(st.lists(st.integers(1, 100), max_size=3))
def test_a_crash_anywhere_resumes_to_the_windows_of_the_straight_run(crashes):
    straight = simulate_run(GRPO)
    crashed = simulate_run(GRPO, crash_after=crashes)
    kept = [e for _, e in effective(list(enumerate(crashed)))]
    assert _sampled_at(kept) == _sampled_at(straight)


def test_the_fold_takes_the_prompt_cursors_and_refuses_a_record_at_another_step_or_stage():
    from rewind.states.fold import IllegalTransition, apply, fold

    log = simulate_run(GRPO)
    first = next(i for i, e in enumerate(log) if isinstance(e, RolloutsRecorded))
    state = fold(log[:first])
    record = log[first]
    moved = RolloutsRecorded(**{**{f: getattr(record, f) for f in record.__struct_fields__}, "cursors": {"sort": 9}})
    assert apply(state, moved).cursors == {"sort": 9} and apply(state, moved).rollouts == moved
    for wrong in ({"step": record.step + 1}, {"stage": 1}):
        fields = {f: getattr(record, f) for f in record.__struct_fields__} | wrong
        with pytest.raises(IllegalTransition):
            apply(state, RolloutsRecorded(**fields))


@pytest.mark.parametrize(
    "path",
    ["../rollouts/" + "a" * 64 + ".safetensors", "rollouts/" + "b" * 64 + ".safetensors", "/etc/passwd",
     "rollouts/" + "a" * 64 + ".safetensors/../x", "cache/trunk-1.zarr"],
)
def test_a_rollout_path_other_than_its_own_name_is_refused(path):
    assert rollout_path_problem(path, "a" * 64)
    event = RolloutsRecorded(step=0, tokens=0, stage=0, path=path, sha256="a" * 64, num_prompts=1, group_size=2)
    assert Admission().problem(event)
    assert rollout_path_problem("rollouts/" + "a" * 64 + ".safetensors", "a" * 64) == ""


def test_what_shapes_a_batch_is_in_its_settings_digest_and_what_only_updates_on_it_is_not():
    import msgspec

    from rewind.states.plan import rollout_settings

    def with_grpo(**changes):
        stage = GRPO.stages[2]
        settings = msgspec.structs.replace(stage.grpo, **changes)
        stages = [*GRPO.stages[:2], msgspec.structs.replace(stage, grpo=settings)]
        return msgspec.structs.replace(GRPO, stages=stages)

    base = rollout_settings(GRPO, 2)
    for same in ({"num_iterations": 5}, {"loss_type": "grpo"}, {"epsilon_high": 0.3}, {"kl_beta": 0.0}):
        assert rollout_settings(with_grpo(**same), 2) == base, same
    for other in ({"temperature": 0.5}, {"group_size": 2}, {"max_new_tokens": 3}, {"kl_beta": 0.1}):
        assert rollout_settings(with_grpo(**other), 2) != base, other


def test_a_config_that_samples_otherwise_samples_the_window_again_and_one_that_only_updates_otherwise_not():
    import msgspec

    from rewind.states.fold import apply, fold
    from rewind.states.plan import SampleRollouts, rollout_settings, rollouts_due

    def with_grpo(**changes):
        stage = GRPO.stages[2]
        stages = [*GRPO.stages[:2], msgspec.structs.replace(stage, grpo=msgspec.structs.replace(stage.grpo, **changes))]
        return msgspec.structs.replace(GRPO, stages=stages)

    log = simulate_run(GRPO)
    first = next(i for i, e in enumerate(log) if isinstance(e, RolloutsRecorded))
    record = msgspec.structs.replace(log[first], settings=rollout_settings(GRPO, 2))
    state = apply(fold(log[:first]), record)
    assert rollouts_due(state, Schedule(GRPO), state.step + 1) is None  # inside its window
    assert rollouts_due(state, Schedule(with_grpo(num_iterations=5)), state.step + 1) is None
    assert rollouts_due(state, Schedule(with_grpo(temperature=0.5)), state.step + 1) == SampleRollouts(2)
