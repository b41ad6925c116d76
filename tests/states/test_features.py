"""A run's behaviours: the names a log records, read as one typed bool each."""

from __future__ import annotations

import msgspec
import pytest

from rewind.states import events
from rewind.states.config_reading import loads_config
from rewind.states.events import RunStarted
from rewind.states.features import RUN_FEATURES, Features
from rewind.states.fold import apply
from rewind.states.state import State

CONFIG = loads_config(
    """
[training]
batch_size = 2
tokens = [1280]
datasets = [[{ name = "grammar" }]]
[architecture]
block_size = 32
"""
)


def test_the_names_a_run_records_are_the_fields_in_the_order_logs_hold_them():
    # Logs written since 0.2 hold these names in this order; a renamed or reordered field would strand them.
    assert RUN_FEATURES == (
        "lr_warmup_floor",
        "baseline_evaluation",
        "reference_checkpoints_kept",
        "data_identity",
        "content_named_checkpoints",
        "scored_reward_figures",
    )
    assert events.RUN_FEATURES is RUN_FEATURES  # one list: the events' vocabulary reads the same one


@pytest.mark.parametrize("name", RUN_FEATURES)
def test_each_name_turns_on_its_own_behaviour_and_no_other(name):
    on = msgspec.structs.asdict(Features.of([name]))
    assert on == {other: other == name for other in RUN_FEATURES}


def test_no_names_are_an_old_run_and_every_name_a_run_started_today():
    assert not any(msgspec.structs.asdict(Features.of([])).values())
    assert all(msgspec.structs.asdict(Features.of(RUN_FEATURES)).values())


def test_a_name_this_release_does_not_know_turns_nothing_on():
    # stores.trust refuses such a run before it is opened (tests/tools/test_crafted_rundirs.py); here it is inert.
    assert Features.of(["from_the_future", "data_identity"]) == Features(data_identity=True)


def test_the_state_and_its_run_started_record_read_the_same_behaviours():
    started = RunStarted(
        step=0, tokens=0, config=CONFIG, config_hash="h", features=["data_identity", "lr_warmup_floor"]
    )
    state = apply(State(), started)
    want = Features(data_identity=True, lr_warmup_floor=True)
    assert started.behaviours == want and state.behaviours == want
    assert state.features == ["data_identity", "lr_warmup_floor"]  # the log's list stays as recorded
    old = apply(State(), RunStarted(step=0, tokens=0, config=CONFIG, config_hash="h"))  # rewind <= 0.2
    assert old.behaviours == Features()
