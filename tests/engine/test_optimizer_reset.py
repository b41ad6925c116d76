"""An optimizer reset at stage entries, end to end on the shrunken tiny run (stages entered at steps 0,
11 and 16), with the LR restarting at each reset: the moments really start from zero, and a run
stopped or killed around the boundary ends with the straight run's weights, bit for bit.

The resume cases are the two sides of the reset: a stop right after it (at step 11 the boundary
checkpoint was taken before the reset, so the resume performs the reset again) and a stop one update
later (its checkpoint holds the cleared-then-updated moments), and a process that dies right after the
reset was recorded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rewind.engine.run import effects, loop
from rewind.engine.step import mixed_step
from rewind.states.events import OptimizerReset, RunResumed, StepCommitted
from rewind.states.fold import fold
from tests.engine.test_loop import (
    OVERRIDES,
    assert_bitwise_equal,
    effective_steps,
    events_of,
    exported_weights,
    one_torch_thread,
    run_cli,
    train_args,
)

RESETS = (*OVERRIDES, "optimization.reset_optimizer_stages=[1,2]", "optimization.reset_restarts_lr=true")
BETA1, BETA2 = 0.9, 0.95  # the config's defaults


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, dict]:
    """The reset run trained straight through, with the optimizer state seen around the first reset."""
    seen: dict = {}
    real_train_step, real_clear = mixed_step.train_step, effects.clear_optimizer_state

    def train_step(model, optimizer, *args, step, **kwargs):
        if step in (10, 11):
            seen[f"before {step}"] = {p: dict(s) for p, s in optimizer.state.items()}
        result = real_train_step(model, optimizer, *args, step=step, **kwargs)
        if step == 11:
            seen["after 11"] = {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
        return result

    def clear(parts):
        seen.setdefault("cleared", []).append(len(parts.optimizer.state))
        real_clear(parts)

    run = tmp_path_factory.mktemp("reset") / "straight"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mixed_step, "train_step", train_step)
        patch.setattr(effects, "clear_optimizer_state", clear)
        code, _, err = run_cli(*train_args(run, overrides=RESETS))
    assert code == 0, err
    return run, seen


def test_the_resets_are_logged_at_the_stage_entries_and_restart_the_lr(straight):
    run, _ = straight
    events = events_of(run)
    resets = [e for e in events if isinstance(e, OptimizerReset)]
    assert [(e.stage, e.step, e.lr_restarted) for e in resets] == [(1, 11, True), (2, 16, True)]
    lrs = {e.step - 1: e.lr for e in events if isinstance(e, StepCommitted)}
    # Each reset starts the schedule over: the step right after it has step 0's LR.
    assert lrs[11] == lrs[16] == lrs[0] and lrs[10] != lrs[0]
    assert fold(events).last_optimizer_reset.step == 16


def test_the_moments_are_zero_right_after_the_reset(straight):
    _, seen = straight
    assert seen["cleared"] and all(n > 0 for n in seen["cleared"])  # there were moments to clear
    assert len(seen["before 10"]) > 0  # before the boundary the optimizer holds every parameter's state
    assert seen["before 11"] == {}  # after the reset: nothing, as a fresh optimizer
    after = seen["after 11"]
    assert after
    for state in after.values():
        # One update from zero moments: m = (1 - b1) g and v = (1 - b2) g^2, so v (1 - b1)^2 = (1 - b2) m^2.
        assert float(state["step"]) == 1.0
        m, v = state["exp_avg"].double(), state["exp_avg_sq"].double()
        torch.testing.assert_close(v * (1 - BETA1) ** 2, (1 - BETA2) * m * m, rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("stop_after", [11, 12])
def test_a_run_stopped_around_the_reset_resumes_to_the_straight_weights(straight, tmp_path, stop_after):
    run = tmp_path / "run"
    code, _, err = run_cli(*train_args(run, "--max-steps", str(stop_after), overrides=RESETS))
    assert code == 0, err
    code, _, err = run_cli(*train_args(run, overrides=RESETS))
    assert code == 0, err
    events = events_of(run)
    assert [e.step for e in events if isinstance(e, RunResumed)] == [stop_after]
    if stop_after == 11:  # resumed from the boundary checkpoint, taken before the reset: done again
        assert [e.step for e in events if isinstance(e, OptimizerReset)] == [11, 11, 16]
    assert_bitwise_equal(
        exported_weights(straight[0], tmp_path / "a.safetensors"),
        exported_weights(run, tmp_path / "b.safetensors"),
    )
    assert effective_steps(run) == effective_steps(straight[0])


class Killed(Exception):
    """The process dies: nothing after this point runs, no stop is recorded."""


def test_a_process_killed_right_after_the_reset_resumes_to_the_straight_weights(
    straight, tmp_path, monkeypatch
):
    real_execute = loop.execute_step

    def dies_after_the_reset(parts, state):
        if state.last_optimizer_reset is not None:
            raise Killed
        return real_execute(parts, state)

    run = tmp_path / "run"
    committing = (*RESETS, "logging.report_interval=1")  # the reset is durable when the process dies
    with monkeypatch.context() as patch:
        patch.setattr(loop, "execute_step", dies_after_the_reset)
        with pytest.raises(Killed):
            run_cli(*train_args(run, overrides=committing))
    died = fold(events_of(run))
    assert died.step == 11 and died.last_optimizer_reset is not None and not died.stopped_reason
    code, _, err = run_cli(*train_args(run, overrides=committing))
    assert code == 0, err
    # The records after the boundary checkpoint (the reset among them) were superseded and redone.
    assert [e.step for e in events_of(run) if isinstance(e, OptimizerReset)] == [11, 11, 16]
    assert_bitwise_equal(
        exported_weights(straight[0], tmp_path / "a.safetensors"),
        exported_weights(run, tmp_path / "b.safetensors"),
    )
    assert effective_steps(run) == effective_steps(straight[0])
