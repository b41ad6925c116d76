"""`rewind replay`: re-executed steps equal the logged ones bit for bit across stops, resumes, config
changes and forks; an injected nondeterminism (in the replay, or in the original training) is reported
at exactly the step it happened; tensor state no step reports is caught at the next checkpoint."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from rewind.engine.run import loop
from rewind.engine.step import mixed_step
from rewind.states.events import CheckpointCommitted, ConfigChanged, RunResumed
from rewind.states.history import effective
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import OVERRIDES, events_of, one_line, run_cli, train_args

NUM_STEPS = 20
# Every checkpoint the straight run ever committed (4, 8, 12 were later deleted by retention).
CHECKPOINT_STEPS = [4, 8, 11, 12, 16, 20]


def replay_json(*args: object) -> tuple[int, dict, str]:
    code, out, err = run_cli("replay", *args, "--json", "--no-progress")
    return code, (json.loads(out) if out.strip() else {}), err


def perturb_at(monkeypatch: pytest.MonkeyPatch, step_index: int, change) -> None:
    """Run `change(model, optimizer, result) -> result` around the step with index `step_index`."""
    real = mixed_step.train_step

    def train_step(model, optimizer, *args, step, **kwargs):
        result = real(model, optimizer, *args, step=step, **kwargs)
        return change(model, optimizer, result) if step == step_index else result

    monkeypatch.setattr(mixed_step, "train_step", train_step)


def nudge_the_weights(model, optimizer, result):
    with torch.no_grad():  # every tensor: an unused embedding row alone would change no loss
        for parameter in model.parameters():
            parameter.view(-1)[0] += 1e-3
    return result


# --- reproducible runs --------------------------------------------------------------------------------


def test_a_straight_run_replays_bit_for_bit_with_every_checkpoint_matched(straight):
    code, report, err = replay_json(straight)
    assert code == 0, err
    assert report["reproducible"] and report["mismatch"] is None
    assert report["start_checkpoint"] == "" and report["num_steps_compared"] == NUM_STEPS
    committed = [e for e in events_of(straight) if isinstance(e, CheckpointCommitted)]
    assert [e.step for e in committed] == CHECKPOINT_STEPS
    # deleted checkpoints included: their recorded hashes outlive their files
    assert report["checkpoints_matched"] == [e.checkpoint for e in committed]


def test_the_readable_report_names_the_window_and_says_reproducible(straight):
    code, out, err = run_cli("replay", straight, "--from-checkpoint", "11", "--to-step", "14", "--no-progress")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert "from checkpoint 00000011-" in lines[0] and "step 14" in lines[0]
    assert "steps 12..14: 3 recomputed" in out
    assert lines[-1] == "replay: reproducible"


def test_a_window_across_a_stop_and_resume_replays(tmp_path):
    run = tmp_path / "run"
    assert run_cli(*train_args(run, "--max-steps", "7"))[0] == 0
    assert run_cli(*train_args(run))[0] == 0
    assert any(isinstance(e, RunResumed) for e in events_of(run))
    code, report, err = replay_json(run)
    assert code == 0, err
    assert report["num_steps_compared"] == NUM_STEPS


def test_a_window_across_an_in_place_config_change_replays(tmp_path):
    run = tmp_path / "run"
    assert run_cli(*train_args(run, "--max-steps", "6"))[0] == 0
    changed = (*OVERRIDES, "run.seed=99", "optimization.lr=1e-3")
    assert run_cli(*train_args(run, "--fork", overrides=changed))[0] == 0
    assert any(isinstance(e, ConfigChanged) for e in events_of(run))
    code, report, err = replay_json(run, "--from-checkpoint", "4")  # deleted: refused, says why
    assert code == 1 and "deleted by the retention policy" in one_line(err)
    code, report, err = replay_json(run)
    assert code == 0, err
    assert report["num_steps_compared"] == NUM_STEPS


def test_a_fork_replays_from_the_checkpoint_it_started_from(straight, tmp_path):
    child = tmp_path / "child"
    assert run_cli("fork", straight, child, "--at-step", "16", "--set", "run.seed=5", "--no-progress")[0] == 0
    code, report, err = replay_json(child)
    assert code == 0, err
    assert report["start_step"] == 16 and report["num_steps_compared"] == NUM_STEPS - 16


# --- injected nondeterminism --------------------------------------------------------------------------


@pytest.mark.parametrize("step_index", [0, 9, 17])
def test_nondeterminism_injected_into_the_replay_is_reported_at_its_step(straight, monkeypatch, step_index):
    perturb_at(monkeypatch, step_index, nudge_the_weights)
    code, report, err = replay_json(straight)
    assert code == 1, err
    mismatch = report["mismatch"]
    # The nudge lands after step index k updated the weights: the step that commits k + 1 still
    # matches, the next step's loss does not (or, after the last step, the final checkpoint's hashes).
    if step_index + 1 < NUM_STEPS:
        assert (mismatch["event"], mismatch["step"], mismatch["field"]) == ("StepCommitted", step_index + 2, "loss")
        assert report["num_steps_compared"] == step_index + 2
    assert mismatch["logged"] != mismatch["recomputed"]


def test_nondeterminism_in_the_original_training_is_found_by_an_honest_replay(tmp_path, monkeypatch):
    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        perturb_at(patch, 12, nudge_the_weights)
        assert run_cli(*train_args(run))[0] == 0
    code, out, err = run_cli("replay", run, "--no-progress")
    assert code == 1, err
    assert "FIRST MISMATCH at step 14" in out and "StepCommitted.loss" in out
    assert out.strip().splitlines()[-1] == "replay: not reproducible at step 14"
    # from a checkpoint after the perturbation, the run is reproducible again
    code, report, _ = replay_json(run, "--from-checkpoint", "16")
    assert code == 0 and report["num_steps_compared"] == 4


def test_state_that_no_step_reports_is_caught_at_the_next_checkpoint(straight, monkeypatch):
    def nudge_the_optimizer(model, optimizer, result):
        moments = optimizer.state[next(model.parameters())]
        moments["exp_avg_sq"].view(-1)[0] += 1.0
        return result

    perturb_at(monkeypatch, NUM_STEPS - 1, nudge_the_optimizer)  # after the last step: no loss can show it
    code, report, _ = replay_json(straight)
    assert code == 1
    mismatch = report["mismatch"]
    assert (mismatch["event"], mismatch["step"], mismatch["field"]) == (
        "CheckpointCommitted",
        NUM_STEPS,
        "files.optimizer.safetensors",
    )
    assert report["num_steps_compared"] == NUM_STEPS


def test_rtol_tolerates_a_reporting_difference_that_exact_replay_flags(straight, monkeypatch):
    def misreport(model, optimizer, result):
        return dataclasses.replace(result, loss=result.loss * (1 + 1e-9))

    perturb_at(monkeypatch, 5, misreport)
    code, report, _ = replay_json(straight)
    assert code == 1 and report["mismatch"]["step"] == 6 and report["mismatch"]["field"] == "loss"
    code, report, err = replay_json(straight, "--rtol", "1e-6")
    assert code == 0, err
    assert report["rtol"] == 1e-6 and report["num_steps_compared"] == NUM_STEPS


# --- bad input ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, expected_code, needle",
    [
        (("--rtol", "-1"), 2, "--rtol -1"),
        (("--rtol", "nan"), 2, "--rtol nan"),
        (("--from-checkpoint", "7"), 2, "no checkpoint of that name or step"),
        (("--from-checkpoint", "00000012-0429b675x"), 2, "no checkpoint"),
        (("--from-checkpoint", "8"), 1, "deleted by the retention policy"),
        (("--to-step", "21"), 2, "at most the last step logged (20)"),
        (("--from-checkpoint", "16", "--to-step", "16"), 2, "after the start (step 16)"),
    ],
)
def test_bad_requests_exit_with_one_line(straight, extra, expected_code, needle):
    code, out, err = run_cli("replay", straight, *extra, "--no-progress")
    assert code == expected_code, err
    assert out == "" and "Traceback" not in err
    assert needle in one_line(err)


def test_replay_of_a_directory_without_a_run(tmp_path):
    code, _, err = run_cli("replay", tmp_path / "nothing")
    assert code == 2 and "no run here" in one_line(err)


def test_a_missing_checkpoint_file_is_one_line_exit_1(straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    (run / "checkpoints" / name_of(run, 16) / "model.safetensors").unlink()
    code, _, err = run_cli("replay", run, "--from-checkpoint", "16", "--no-progress")
    assert code == 1 and "cannot load checkpoint" in one_line(err)


def name_of(run: Path, step: int) -> str:
    (name,) = [
        e.checkpoint
        for _, e in effective(read_seq_events(run))
        if isinstance(e, CheckpointCommitted) and e.step == step
    ]
    return name


# --- found in review: config changes that rebuild the model, restarts from scratch, forks at step 0 -----


def test_a_dropout_change_in_place_replays(tmp_path):
    run = tmp_path / "run"
    assert run_cli(*train_args(run, "--max-steps", "6"))[0] == 0
    assert run_cli(*train_args(run, "--fork", overrides=(*OVERRIDES, "architecture.dropout=0.1")))[0] == 0
    code, report, err = replay_json(run)
    assert code == 0, err
    assert report["num_steps_compared"] == NUM_STEPS


def test_a_restart_from_scratch_under_a_new_seed_replays(tmp_path, monkeypatch):
    """A crash before the first checkpoint, then a resume under another seed: the resumed process
    starts from the new seed's weights, and so must the replay."""
    run = tmp_path / "run"
    no_checkpoints = (*OVERRIDES, "logging.checkpoint_interval=0", "logging.report_interval=1")
    real = loop.execute_step

    def crash_at_step_5(parts, state):
        if state.step == 5:
            raise RuntimeError("simulated crash")
        return real(parts, state)

    with monkeypatch.context() as patch:
        patch.setattr(loop, "execute_step", crash_at_step_5)
        with pytest.raises(RuntimeError, match="simulated crash"):
            run_cli(*train_args(run, overrides=no_checkpoints))
    code, _, err = run_cli(*train_args(run, "--fork", overrides=(*no_checkpoints, "run.seed=8")))
    assert code == 0, err
    resumed = [e for e in events_of(run) if isinstance(e, RunResumed)]
    assert [e.checkpoint for e in resumed] == [""]
    code, report, err = replay_json(run)
    assert code == 0, err
    assert report["num_steps_compared"] == NUM_STEPS


def test_a_fork_at_step_0_from_a_reference_checkpoint_replays_from_that_checkpoint(tmp_path):
    parent, child = tmp_path / "parent", tmp_path / "child"
    refresh_first = (*OVERRIDES, "optimization.kl.reference_update_stages=[0,1]", "optimization.kl.betas=[0.1,0.2,0.2]")
    assert run_cli(*train_args(parent, "--max-steps", "3", overrides=refresh_first))[0] == 0
    code, _, err = run_cli("fork", parent, child, "--at-step", "0", "--set", "run.seed=9", "--max-steps", "3",
                           "--no-progress")
    assert code == 0, err
    assert events_of(child)[1].checkpoint.startswith("00000000-")
    code, report, err = replay_json(child)
    assert code == 0, err
    assert report["start_checkpoint"].startswith("00000000-") and report["num_steps_compared"] == 3


def test_a_log_that_does_not_fold_is_one_line_and_exit_1(straight, tmp_path):
    from rewind.states.events import StepCommitted
    from rewind.stores.eventlog import EventLog

    run = tmp_path / "run"
    shutil.copytree(straight, run)
    with EventLog.open(run, "w") as log:
        log.append(StepCommitted(step=99, tokens=99 * 256, stage=2, lr=0.0, beta=0.0, loss=1.0))
        log.commit()
    for args in (["replay", run], ["resume", run], ["fork", run, tmp_path / "c", "--at-step", "3"]):
        code, _, err = run_cli(*args, "--no-progress")
        assert code == 1, err
        assert "Traceback" not in err and "StepCommitted at step 99" in one_line(err)


def test_an_infinite_rtol_is_refused(straight):
    code, _, err = run_cli("replay", straight, "--rtol", "inf")
    assert code == 2 and "finite" in one_line(err)
