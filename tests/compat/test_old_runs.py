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
def old_run(request, tmp_path, monkeypatch) -> tuple[Path, dict]:
    # A copy: the committed fixture must never be written to, by this test or any other.
    fixture = FIXTURES / request.param
    copy = tmp_path / request.param
    shutil.copytree(fixture, copy, ignore=shutil.ignore_patterns("expected.json", "run.toml", "*.py"))
    expected = json.loads((fixture / "expected.json").read_text())
    # The config file it was started with: its own where it pins another config's behaviour.
    own = fixture / "run.toml"
    expected["config"] = own if own.exists() else CONFIG
    if modules := sorted(fixture.glob("*.py")):
        # A grpo run's reward modules, beside a copy of its config and in the working directory (where the
        # commands without a config file look), as the run was made (make_fixture.py).
        home = tmp_path / "home"
        home.mkdir()
        for file in [own, *modules]:
            shutil.copyfile(file, home / file.name)
        expected["config"] = home / "run.toml"
        monkeypatch.chdir(home)
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


def test_the_grpo_fixture_pins_the_figures_of_runs_started_before_scored_reward_figures():
    """a41046e-grpo (made at commit a41046e) stopped and crashed inside grpo windows whose batches have
    unscored completions, with a KL term and 2 updates a batch: its records hold that release's figures (the
    mean reward with the unscored counted as 0, no unscored count, the plain mean of the KL estimate), which
    the tests below replay and resume under, bit for bit."""
    from safetensors.torch import load_file as load_rollouts

    from rewind.states.events import RolloutsRecorded, RunStarted, StepCommitted
    from rewind.stores.runs import read_seq_events

    fixture = FIXTURES / "a41046e-grpo"
    events = [e for _, e in read_seq_events(fixture)]
    assert isinstance(events[0], RunStarted) and "scored_reward_figures" not in events[0].features
    records = [e for e in events if isinstance(e, RolloutsRecorded)]
    assert records and all(r.unscored == 0 for r in records)  # not recorded then
    for record in records:
        rewards = load_rollouts(fixture / record.path)["rewards"]
        assert bool(rewards.isnan().any())  # unscored completions, counted as 0 in the mean on record
        assert record.mean_reward == float(rewards.nan_to_num().sum(dim=0).mean())
    steps = [e for e in events if isinstance(e, StepCommitted) and e.metrics]
    assert steps and not any("unscored" in e.metrics for e in steps)
    assert any(e.kl > 0 for e in steps)


def test_the_flat_fixture_pins_a_config_written_as_flat_lists_that_a41046e_logged_as_stages():
    """a41046e-flat (made at commit a41046e) was started from a config giving its stages as the six flat
    lists of the form before [[stages]] (a per-boundary overlap and an optimizer reset too); that release
    logged them as stage records. The tests below resume it under that very file, so its flat form must
    read to the config hash on record, bit for bit."""
    import tomllib

    from rewind.states.stageform import FLAT_FIELD, to_stage_form
    from rewind.stores.runs import read_seq_events

    fixture = FIXTURES / "a41046e-flat"
    raw = tomllib.loads((fixture / "run.toml").read_text())
    assert "stages" not in raw and to_stage_form(raw)[2]
    missing = []
    for path in FLAT_FIELD:  # all six lists
        table = raw
        for key in path[:-1]:
            table = table.get(key, {})
        if path[-1] not in table:
            missing.append(".".join(path))
    assert len(FLAT_FIELD) == 6 and missing == []
    stages = read_seq_events(fixture)[0][1].config.stages
    assert [(s.overlap, s.refresh_reference, s.reset_optimizer) for s in stages] == [
        (0.5, False, False),
        (0.25, True, False),
        (None, False, True),
    ]


def test_the_rollout_rules_read_an_old_runs_figures_by_its_features():
    """The check a resume and verify make (rolloutreader.rollout_problems) holds a run started before
    scored_reward_figures to the figures it records, and no other run to them."""
    from rewind.engine.posttrain.rolloutreader import batch_problem, rollout_problems, run_behaviours
    from rewind.states.events import RolloutsRecorded
    from rewind.stores.rollouts import read_rollouts
    from rewind.stores.runs import read_seq_events

    fixture = str(FIXTURES / "a41046e-grpo")
    events = [e for _, e in read_seq_events(fixture)]
    config, record = events[0].config, next(e for e in events if isinstance(e, RolloutsRecorded))
    tensors, metadata = read_rollouts(fixture, record.path, record.sha256)
    assert rollout_problems(tensors, metadata, record, config, None, scored_figures=False) == []
    (problem,) = rollout_problems(tensors, metadata, record, config, None)
    assert "mean_reward" in problem and "(2 unscored)" in problem
    assert not run_behaviours(fixture).scored_reward_figures and batch_problem(fixture, record, config, None) == ""



def test_rollouts_shows_an_old_runs_mean_without_an_unscored_count(rewind_cli, tmp_path):
    """Its mean counted unscored completions as 0, and it recorded no count: `rewind rollouts` says only
    the mean (a run started today: "over the scored completions (N unscored)")."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "a41046e-grpo", run)
    code, out, err = rewind_cli("rollouts", run)
    assert code == 0, err
    assert "mean reward " in out and "unscored" not in out, out
    code, out, err = rewind_cli("rollouts", run, "--json")
    assert code == 0 and json.loads(out)["unscored"] is None, err

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
