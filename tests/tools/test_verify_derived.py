"""An activation cache is bound to the run that made it: another run's cache copied in under the right
name is never read (the trunk is recomputed, to the same bits), the resume says so in one warning, and
`rewind verify` names it.

The runs are examples/progressive.toml shrunk as tests/engine/test_growth.py shrinks it: stack 1 is
appended at step 10 on a frozen trunk whose outputs are cached for the steps 10-19. The other run has
another seed, so its cache has the same shape and other values.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import msgspec
import pytest

from rewind.engine.model.trunkreader import ForeignCache
from rewind.states.events import ActivationsCached, StepCommitted
from tests.engine.test_growth import grown_args
from tests.engine.test_loop import events_of, run_cli

pytestmark = pytest.mark.slow  # two grown runs of 11-12 steps and two resumes of 2, ~20 s


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("grown")
    own, other = base / "own", base / "other"
    for run, extra in ((own, ("--max-steps", "12")), (other, ("--max-steps", "11", "--set", "run.seed=12"))):
        code, _, err = run_cli(*grown_args(run, *extra))
        assert code == 0, err
    return own, other


def cache_of(run: Path) -> Path:
    (cached,) = [e for e in events_of(run) if isinstance(e, ActivationsCached)]
    return run / cached.path


def steps(run: Path) -> list[bytes]:
    return [msgspec.msgpack.encode(e) for e in events_of(run) if isinstance(e, StepCommitted) and e.step > 12]


def test_another_runs_activation_cache_under_the_right_name_is_not_trained_on(runs, tmp_path):
    own, other = runs
    straight, run = tmp_path / "straight", tmp_path / "run"
    shutil.copytree(own, straight)
    shutil.copytree(own, run)
    assert run_cli("verify", run)[0] == 0
    shutil.rmtree(cache_of(run))
    shutil.copytree(cache_of(other), cache_of(run))  # under this run's name
    code, out, _ = run_cli("verify", run)
    name = cache_of(run).relative_to(run)
    problem = f"PROBLEM activation cache {name}: not this run's: made by another run, config or data"
    assert code == 1 and problem in out, out

    assert run_cli(*grown_args(straight, "--max-steps", "2"))[0] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("always", ForeignCache)
        code, _, err = run_cli(*grown_args(run, "--max-steps", "2"))
    assert code == 0, err
    assert steps(run) == steps(straight) and len(steps(run)) == 2  # the trunk recomputed, bit for bit
    said = [line for line in err.splitlines() if "warning" in line]
    assert len(said) == 1 and f"activation cache {name}: not this run's" in said[0], err
    assert problem in run_cli("verify", run)[1]  # still there, still named
