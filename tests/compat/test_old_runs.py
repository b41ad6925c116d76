"""The compatibility promise: a run started by an older rewind resumes and replays under this one.

Each directory under fixtures/ was left by the release it is named after (see make_fixture.py): a run
stopped once, resumed, and crashed with records past its last checkpoint. This release must verify
it, replay its logged steps bit for bit, accept the very config file it was started with, resume it
(superseding the crashed records), and end with the final weights that release's straight run had.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.engine.test_loop import one_torch_thread

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CONFIG = FIXTURES / "run.toml"
RELEASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").exists())


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(params=RELEASES)
def old_run(request, tmp_path) -> tuple[Path, dict]:
    # A copy: the committed fixture must never be written to, by this test or any other.
    copy = tmp_path / request.param
    shutil.copytree(FIXTURES / request.param, copy, ignore=shutil.ignore_patterns("expected.json", "run.toml"))
    expected = json.loads((FIXTURES / request.param / "expected.json").read_text())
    # The config file it was started with: its own where it pins another config's behaviour.
    own = FIXTURES / request.param / "run.toml"
    expected["config"] = own if own.exists() else CONFIG
    return copy, expected


def _tensor_hashes(file: Path) -> dict[str, str]:
    return {n: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for n, t in sorted(load_file(file).items())}


def test_there_is_a_fixture_of_the_first_release():
    assert "0.1.0" in RELEASES


def test_the_cosine_fixture_pins_the_warmup_from_zero_of_runs_started_before_the_floor():
    """0.2.0-cosine (made by rewind 0.2) stopped and crashed inside a cosine warmup that started at LR 0:
    the tests below resume it to the weights its straight run had, which only that old warmup gives."""
    from rewind.stores.runs import read_seq_events

    events = [e for _, e in read_seq_events(FIXTURES / "0.2.0-cosine")]
    first_step = next(e for e in events if type(e).__name__ == "StepCommitted")
    assert events[0].features == [] and first_step.lr == 0.0


def test_an_old_run_verifies_and_replays_bit_for_bit(old_run, rewind_cli):
    run, expected = old_run
    code, out, err = rewind_cli("verify", run)
    assert code == 0, out + err
    code, out, err = rewind_cli("replay", run, "--from-checkpoint", "start")
    assert code == 0, out + err
    assert "replay: reproducible" in out
    assert f"towards step {expected['logged_last_step']}" in out


def test_an_old_run_resumes_under_its_own_config_file_to_the_same_final_weights(old_run, rewind_cli, tmp_path):
    run, expected = old_run
    code, out, err = rewind_cli("train", expected["config"], "--run-dir", run, "--no-progress")
    assert code == 0, err
    assert "the config differs" not in err
    assert f"resuming {run}" in err
    code, _, err = rewind_cli("export", run, "--to", tmp_path / "final.safetensors")
    assert code == 0, err
    assert _tensor_hashes(tmp_path / "final.safetensors") == expected["final_model_sha256"]
    code, out, err = rewind_cli("verify", run)
    assert code == 0, out + err


def test_an_old_run_resumes_under_its_logged_config(old_run, rewind_cli, tmp_path):
    run, expected = old_run
    code, _, err = rewind_cli("resume", run, "--no-progress")
    assert code == 0, err
    code, _, err = rewind_cli("export", run, "--to", tmp_path / "final.safetensors")
    assert code == 0, err
    assert _tensor_hashes(tmp_path / "final.safetensors") == expected["final_model_sha256"]


@pytest.mark.parametrize("at_step", [0, 12])  # from scratch (before any checkpoint), and from one
def test_a_fork_of_an_old_run_keeps_the_old_runs_behaviours(old_run, rewind_cli, tmp_path, at_step):
    """An unchanged fork is its parent: a fork of a run started before the warmup floor and the baseline
    evaluation computes without them, as its parent did (found in review: a fork from scratch took
    today's behaviours, and `rewind diff` then found it differing at step 0)."""
    from rewind.states.events import Evaluated, RunStarted
    from rewind.stores.runs import read_seq_events

    run, expected = old_run
    features = read_seq_events(run)[0][1].features
    if expected["made_by"] < "0.3":
        assert features == []  # a run of a release before features were recorded
    child = tmp_path / "child"
    code, _, err = rewind_cli("fork", run, child, "--at-step", str(at_step), "--no-progress", "--max-steps", "2")
    assert code == 0, err
    events = [e for _, e in read_seq_events(child)]
    assert isinstance(events[0], RunStarted) and events[0].features == features
    baseline = any(isinstance(e, Evaluated) and e.boundary == -1 for e in events)
    # From scratch (the fork point falls back to step 0 where retention deleted the checkpoints before it),
    # today's runs evaluate the model before training, as the parent did.
    from_scratch = events[0].parent is not None and events[0].parent.step == 0
    assert baseline == ("baseline_evaluation" in features and from_scratch)
