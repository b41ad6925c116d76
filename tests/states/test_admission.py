"""Admission: what a record may carry, decided in states/ beside the fold (the reader, stores.trust, only
raises what it finds; tests/stores/test_trust*.py and tests/tools/test_crafted*.py hold the commands'
lines and exit codes)."""

from __future__ import annotations

import pytest

from rewind.states.admission import Admission, cache_path_problem, plain_name_problem
from rewind.states.config_reading import loads_config
from rewind.states.events import ActivationsCached, CheckpointCommitted, CheckpointDeleted, StepCommitted
from rewind.states.strategies import simulate_run

CONFIG = loads_config(
    """
[training]
batch_size = 2
tokens = [64, 64]
datasets = [[{ name = "grammar" }], [{ name = "reverse" }]]

[logging]
checkpoint_interval = 2
"""
)


def test_every_record_a_run_writes_is_admitted():
    admission, events = Admission(), simulate_run(CONFIG, crash_after=[3])
    assert [admission.problem(event) for event in events] == [""] * len(events)
    assert admission.config == CONFIG  # the config in force, which a fork's seed is checked against


@pytest.mark.parametrize(
    ("event", "problem"),
    [
        (
            CheckpointCommitted(step=4, tokens=8, checkpoint="../../etc", manifest_sha256=""),
            "'../../etc' is not a checkpoint name (<step:08d>-<8 hex digits>)",
        ),
        (
            CheckpointCommitted(step=4, tokens=8, checkpoint="00000005-0123abcd", manifest_sha256=""),
            "checkpoint 00000005-0123abcd is named for step 5, not 4",
        ),
        (
            CheckpointCommitted(
                step=4, tokens=8, checkpoint="00000004-0123abcd", manifest_sha256="", files={"../x": ""}
            ),
            "file name '../x' is not a plain <group>.safetensors name",
        ),
        (
            CheckpointDeleted(step=4, tokens=8, checkpoint=""),
            "'' is not a checkpoint name (<step:08d>-<8 hex digits>)",
        ),
        (
            StepCommitted(step=1, tokens=8, stage=0, lr=0.0, beta=0.0, loss=1.0, cursors={"grammar": -1}),
            "data cursor 'grammar' is negative",
        ),
        (
            StepCommitted(step=-1, tokens=8, stage=0, lr=0.0, beta=0.0, loss=1.0),
            "step and tokens must be >= 0",
        ),
    ],
)
def test_a_record_carrying_what_no_run_writes_is_refused_with_its_problem(event, problem):
    assert Admission().problem(event) == problem


def test_activation_cache_paths_are_names_rewind_writes_of_the_records_trunk_and_step():
    assert cache_path_problem("", 1, 10) == ""
    assert cache_path_problem("cache/trunk-1-00000010-0123456789ab.zarr", 1, 10) == ""
    assert cache_path_problem("cache/trunk-1.zarr", 1, 10) == ""
    assert "is not one rewind writes" in cache_path_problem("/etc/passwd", 1, 10)
    assert "is not the cache of its record's trunk 2 at step 10" in cache_path_problem(
        "cache/trunk-1-00000010-0123456789ab.zarr", 2, 10
    )
    event = ActivationsCached(step=10, tokens=20, version=1, num_steps=1, num_rows=2, path="cache/../x.zarr")
    assert Admission().problem(event) == cache_path_problem("cache/../x.zarr", 1, 10) != ""


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b", "a\0b", 5])
def test_a_plain_name_is_one_path_component(name):
    assert plain_name_problem(name) != ""
    assert plain_name_problem("grammar") == ""
