"""A grown run's records and files are untrusted input too: an activation cache is read only from inside
the run, and a fork falls back past checkpoints whose frozen stacks' files are gone.

The runs are examples/progressive.toml shrunk as tests/engine/test_growth.py shrinks it, stopped after
step 14: stack 1 was appended at step 10 on a frozen trunk whose outputs are cached (ActivationsCached
at step 10), with a boundary checkpoint taken before the growth and a reference one after it, at the
same step. A second run with another seed has a cache of the same shape: what a forged record would
have the first one read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import pytest

from rewind.states.events import ActivationsCached, CheckpointCommitted, RunResumed
from tests.engine.test_growth import grown_args
from tests.engine.test_loop import events_of, run_cli
from tests.tools.rundir_forgery import opened_paths, rewrite_log, tree_state

pytestmark = pytest.mark.slow  # two grown runs of 14 steps, ~20 s

replace = msgspec.structs.replace


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("grown")
    own, other = base / "own", base / "other"
    for run, extra in ((own, ()), (other, ("--set", "run.seed=12"))):
        code, _, err = run_cli(*grown_args(run, "--max-steps", "14", *extra))
        assert code == 0, err
    return own, other


@pytest.fixture
def run(runs, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(runs[0], copy, symlinks=True)
    return copy


def _cache_record(run: Path) -> ActivationsCached:
    (cached,) = [e for e in events_of(run) if isinstance(e, ActivationsCached)]
    return cached


def _other_cache(runs) -> Path:
    return runs[1] / _cache_record(runs[1]).path


def _files_under(root: Path, seen: list[str]) -> list[str]:
    real = os.path.realpath(root)
    return [path for path in seen if path.startswith(real + os.sep)]


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_a_forged_cache_path_is_refused_by_resume_and_verify(runs, run, how):
    other_cache = _other_cache(runs)
    forged = os.path.relpath(other_cache, run) if how == "relative" else str(other_cache)
    assert (run / forged).resolve() == other_cache.resolve()  # it would lead there
    rewrite_log(run, lambda seq, e: replace(e, path=forged) if isinstance(e, ActivationsCached) else e)
    before = tree_state(run)
    with opened_paths() as seen:
        code, out, err = run_cli("verify", run)
    assert code == 1 and err == ""
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert any("activation cache path" in line and "is not one rewind writes" in line for line in problems), (
        out
    )
    with opened_paths() as seen_too:
        code, out, err = run_cli(*grown_args(run))
    assert code == 1, out + err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "ActivationsCached at step 10" in err and "is not one rewind writes" in err, err
    assert not _files_under(runs[1], seen + seen_too)  # nothing of the other run was read
    assert tree_state(run) == before  # nor anything written


def test_a_cache_linked_out_of_the_run_is_never_read_nor_written_through_and_verify_names_it(runs, run):
    """The record names the run's own cache, but the cache is a link to the other run's (a valid cache
    of the same shape): verify says why, and training is refused in one line before it reads or writes
    anything (rewind.stores.runguard: a writer writes only inside its run), the link left for a person."""
    own_cache = run / _cache_record(run).path
    shutil.rmtree(own_cache)
    own_cache.symlink_to(_other_cache(runs), target_is_directory=True)
    before = tree_state(run)
    with opened_paths() as seen:
        code, out, err = run_cli("verify", run)
        assert code == 1 and "leads outside the run directory" in out, out + err
        code, out, err = run_cli(*grown_args(run, "--max-steps", "2"))
    assert code == 1 and err.count("\n") == 1 and f"{own_cache} leads outside the run directory" in err, err
    assert not _files_under(runs[1], seen)
    assert tree_state(run) == before  # the link left for a person to look at, nothing written


def test_a_fork_falls_back_past_checkpoints_whose_frozen_stacks_are_gone(runs, run, tmp_path):
    """Without RUN/trunks/, every checkpoint after the growth is unusable, but the boundary checkpoint
    taken before it at the same step needs none of its files: the fork starts there and grows the
    model again, into the very checkpoint the parent took after the growth."""
    shutil.rmtree(run / "trunks")
    checkpoints = [e for e in events_of(run) if isinstance(e, CheckpointCommitted)]
    before_growth = next(e.checkpoint for e in checkpoints if e.step == 10 and e.reason == "boundary")
    after_growth = next(e.checkpoint for e in checkpoints if e.step == 10 and e.reason == "reference")
    child = tmp_path / "child"
    code, out, err = run_cli("fork", run, child, "--at-step", "14", "--max-steps", "0", "--no-progress")
    assert code == 0, out + err
    events = events_of(child)
    assert next(e for e in events if isinstance(e, RunResumed)).checkpoint == before_growth
    regrown = [e.checkpoint for e in events if isinstance(e, CheckpointCommitted)]
    assert regrown == [after_growth]
