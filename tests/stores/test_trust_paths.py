"""Every name a record gives a path is held inside the run (rewind.stores.trust): an activation cache's
path is one rewind writes, of the record's own trunk and step; a logged config's dataset names are
plain names (each names a directory under RUN/data); a fork's parent is a printable path and a
checkpoint name. End to end (a forged log refused by resume and verify): tests/tools/test_crafted_growth_runs.py.
"""

from __future__ import annotations

import os
import posixpath

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rewind.states.config_reading import loads_config
from rewind.states.events import ActivationsCached, ForkOrigin, RunStarted
from rewind.stores.cachenames import cache_path
from rewind.stores.trust import RecordChecker
from tests.conftest import EXAMPLES

TINY = (EXAMPLES / "tiny.toml").read_text()


def _cached(path: str, version: int = 1, step: int = 10) -> ActivationsCached:
    return ActivationsCached(
        step=step, tokens=step * 256, version=version, num_steps=10, num_rows=80, path=path
    )


@pytest.mark.parametrize(
    "path",
    ["", cache_path(1, 10, "0123456789abcdef"), "cache/trunk-1.zarr"],
    ids=["dry-run", "this-release", "first-growth-release"],
)
def test_the_paths_rewind_writes_pass(path):
    assert RecordChecker().problem(_cached(path)) == ""


@pytest.mark.parametrize(
    ("path", "expect"),
    [
        ("../other/cache/trunk-1-00000010-0123456789ab.zarr", "is not one rewind writes"),
        ("/elsewhere/cache/trunk-1-00000010-0123456789ab.zarr", "is not one rewind writes"),
        ("cache/../../other/cache/trunk-1.zarr", "is not one rewind writes"),
        ("cache/trunk-1.zarr/..", "is not one rewind writes"),
        ("cache\\trunk-1.zarr", "is not one rewind writes"),
        ("cache/trunk-1.zarr\n", "is not one rewind writes"),
        ("cache/trunk-2-00000010-0123456789ab.zarr", "not the cache of its record's trunk 1 at step 10"),
        ("cache/trunk-1-00000011-0123456789ab.zarr", "not the cache of its record's trunk 1 at step 10"),
    ],
)
def test_any_other_cache_path_is_refused(path, expect):
    problem = RecordChecker().problem(_cached(path))
    assert "activation cache path" in problem and expect in problem


@given(st.text(alphabet="cachetrunkz/.-0123456789ab\\", max_size=60))
def test_a_cache_path_that_passes_stays_in_the_runs_cache_directory(path):
    if RecordChecker().problem(_cached(path, version=1, step=10)):
        return
    assert path == "" or posixpath.normpath(posixpath.join("/run", path)).startswith("/run/cache/trunk-")
    assert ".." not in path.split("/") and "\\" not in path


def _started(config_text: str, parent: ForkOrigin | None = None) -> RunStarted:
    return RunStarted(step=0, tokens=0, config=loads_config(config_text), config_hash="x", parent=parent)


@pytest.mark.parametrize("name", ["../evil", "a/b", ".."])
def test_a_logged_dataset_name_must_be_a_plain_name(name):
    config = TINY + f'\n[data."{name}"]\nkind = "tokens"\npath = "x.bin"\n'
    problem = RecordChecker().problem(_started(config))
    assert "is not a plain name" in problem and repr(name) in problem


def test_a_forks_parent_is_a_printable_path_and_a_checkpoint_name():
    good = ForkOrigin(
        run=os.path.join("runs", "parent"), step=8, checkpoint="00000008-0123abcd", config_hash="x"
    )
    assert RecordChecker().problem(_started(TINY, good)) == ""
    shown = ForkOrigin(run="runs/\x1b[2Jparent", step=8, checkpoint="00000008-0123abcd", config_hash="x")
    assert "control characters" in RecordChecker().problem(_started(TINY, shown))
    named = ForkOrigin(run="runs/parent", step=8, checkpoint="../../x", config_hash="x")
    assert "is not a checkpoint name" in RecordChecker().problem(_started(TINY, named))


def test_a_snapshot_whose_cache_path_leaves_the_run_is_not_used():
    """A snapshot is a cache of the fold: one naming a cache no record could name is passed over (the
    log is folded instead, and its records are checked)."""
    from rewind.states.admission import state_problem
    from rewind.states.events import ActivationsCached
    from rewind.states.state import State

    config = loads_config(TINY)
    ref = ActivationsCached(
        step=10, tokens=640, version=1, num_steps=10, num_rows=80, path=cache_path(1, 10, "0123456789ab")
    )
    assert state_problem(State(activation_cache=ref), config) == ""
    forged = msgspec.structs.replace(ref, path="../other/cache/trunk-1.zarr")
    assert "is not one rewind writes" in state_problem(State(activation_cache=forged), config)
