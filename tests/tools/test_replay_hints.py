"""Hints for runs computed where bits are not promised: `rewind replay` says so at a bitwise mismatch
when the replayed window was computed on CUDA or by several processes, and `rewind diff` when floats
differ bitwise between runs that recorded different devices or numbers of processes; both point to
--rtol and docs/distributed.md. Logs are the tiny run's, with where they computed rewritten by the
stores' own writer (rundir_forgery)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from rewind.engine.step import mixed_step
from rewind.states.events import RunResumed, RunStarted, StepCommitted
from tests.engine.test_loop import events_of, run_cli, train_args
from tests.tools.rundir_forgery import rewrite_log

H100 = "cuda:NVIDIA H100 80GB HBM3"
ADVICE = "--rtol 1e-5 (fp32; bf16 runs need ~1e-2), see docs/distributed.md"


def computed_on(source: Path, dest: Path, device: str = "", world_size: int = 0, *, resumed: bool = False) -> Path:
    """A copy of `source` whose RunStarted (or, `resumed`, every RunResumed) records `device` and
    `world_size`."""
    shutil.copytree(source, dest)
    kind = RunResumed if resumed else RunStarted

    def change(seq, event):
        if isinstance(event, kind):
            return msgspec.structs.replace(event, device=device, world_size=world_size)
        return event

    rewrite_log(dest, change)
    return dest


def nudge_after(monkeypatch: pytest.MonkeyPatch, step_index: int) -> None:
    """The replay's weights off by 1e-3 after step index `step_index`: a bitwise mismatch at the next step."""
    real = mixed_step.train_step

    def train_step(model, optimizer, *args, step, **kwargs):
        result = real(model, optimizer, *args, step=step, **kwargs)
        if step == step_index:
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.view(-1)[0] += 1e-3
        return result

    monkeypatch.setattr(mixed_step, "train_step", train_step)


def replay(*args: object) -> tuple[int, str, dict]:
    code, out, err = run_cli("replay", *args, "--no-progress")
    assert "Traceback" not in err
    _, as_json, _ = run_cli("replay", *args, "--no-progress", "--json")
    return code, out, json.loads(as_json)


# --- replay ------------------------------------------------------------------------------------------------


def test_a_mismatch_in_a_window_computed_on_cuda_suggests_a_tolerance(straight, tmp_path, monkeypatch):
    run = computed_on(straight, tmp_path / "run", H100)
    nudge_after(monkeypatch, 1)
    code, out, report = replay(run)
    assert code == 1
    lines = out.strip().splitlines()
    assert lines[-1] == "replay: not reproducible at step 3"  # the verdict stays last
    assert lines[-2] == (
        f"  hint: the replayed window was computed on {H100}, where bits are promised only within a tolerance, "
        f"not bit for bit: compare with {ADVICE}"
    )
    assert report["computed_on"] == [{"device": H100, "world_size": 1}]
    assert report["hint"] == lines[-2].removeprefix("  hint: ")


def test_several_processes_on_the_cpu_get_the_hint_too(straight, tmp_path, monkeypatch):
    run = computed_on(straight, tmp_path / "run", "cpu", 4)
    nudge_after(monkeypatch, 1)
    code, out, report = replay(run)
    assert code == 1
    assert "hint: the replayed window was computed on cpu in 4 processes," in out
    assert report["computed_on"] == [{"device": "cpu", "world_size": 4}]


def test_a_cpu_run_in_one_process_gets_no_hint(straight, monkeypatch):
    nudge_after(monkeypatch, 1)
    code, out, report = replay(straight)
    assert code == 1 and "hint:" not in out
    assert report["hint"] is None and report["computed_on"] == [{"device": "cpu", "world_size": 1}]


def test_no_hint_once_a_tolerance_is_given(straight, tmp_path, monkeypatch):
    run = computed_on(straight, tmp_path / "run", H100)
    nudge_after(monkeypatch, 1)
    code, out, report = replay(run, "--rtol", "1e-5")
    assert code == 1  # a 1e-3 nudge is outside any sensible tolerance
    assert "hint:" not in out and report["hint"] is None


def test_a_resume_on_cuda_counts_for_the_steps_after_it(tmp_path, monkeypatch):
    stopped = tmp_path / "stopped"
    assert run_cli(*train_args(stopped, "--max-steps", "7"))[0] == 0
    assert run_cli(*train_args(stopped))[0] == 0
    run = computed_on(stopped, tmp_path / "run", H100, 2, resumed=True)
    (resume,) = [e for e in events_of(run) if isinstance(e, RunResumed)]
    assert (resume.step, resume.device, resume.world_size) == (7, H100, 2)
    with monkeypatch.context() as patch:  # before the resume: computed on the CPU alone, no hint
        nudge_after(patch, 1)
        code, out, report = replay(run)
    assert code == 1 and report["mismatch"]["step"] == 3 and report["hint"] is None
    nudge_after(monkeypatch, 12)
    code, out, report = replay(run)
    assert code == 1 and report["mismatch"]["step"] == 14
    assert report["computed_on"] == [{"device": "cpu", "world_size": 1}, {"device": H100, "world_size": 2}]
    assert f"hint: the replayed window was computed on cpu, then {H100} in 2 processes," in out


# --- diff --------------------------------------------------------------------------------------------------


def perturbed_loss(source: Path, dest: Path, device: str = "") -> Path:
    """A copy of `source` with step 5's loss off in its last bits, as another device would compute it."""
    shutil.copytree(source, dest)

    def change(seq, event):
        if isinstance(event, StepCommitted) and event.step == 5:
            return msgspec.structs.replace(event, loss=event.loss * (1 + 1e-7))
        if isinstance(event, RunStarted) and device:
            return msgspec.structs.replace(event, device=device)
        return event

    rewrite_log(dest, change)
    return dest


def test_diff_of_runs_on_different_devices_suggests_a_tolerance(straight, tmp_path):
    other = perturbed_loss(straight, tmp_path / "other", H100)
    code, out, err = run_cli("diff", straight, other)
    assert code == 1, err
    assert out.strip().splitlines()[-1] == (
        f"hint: A computed on cpu, B on {H100}: floats computed on different devices or by different numbers "
        f"of processes agree within a tolerance, not bit for bit; compare with {ADVICE}"
    )
    code, out, _ = run_cli("diff", straight, other, "--json")
    report = json.loads(out)
    assert code == 1 and report["hint"].startswith("A computed on cpu, B on cuda:")
    assert report["computed_on"] == {"a": [{"device": "cpu", "world_size": 1}], "b": [{"device": H100, "world_size": 1}]}
    code, out, _ = run_cli("diff", straight, other, "--rtol", "1e-5")
    assert code == 0 and "hint:" not in out


def test_diff_on_the_same_device_gets_no_hint(straight, tmp_path):
    other = perturbed_loss(straight, tmp_path / "other")
    code, out, _ = run_cli("diff", straight, other)
    assert code == 1 and "hint:" not in out
    code, out, _ = run_cli("diff", straight, other, "--json")
    assert json.loads(out)["hint"] is None


def test_diff_of_differences_that_are_not_floats_gets_no_hint(straight, tmp_path):
    """Rows or cursors that differ are no rounding: another device does not explain them."""
    other = tmp_path / "other"
    shutil.copytree(straight, other)

    def change(seq, event):
        if isinstance(event, StepCommitted) and event.step == 5:
            return msgspec.structs.replace(event, skipped=True)
        if isinstance(event, RunStarted):
            return msgspec.structs.replace(event, device=H100)
        return event

    rewrite_log(other, change)
    code, out, _ = run_cli("diff", straight, other)
    assert code == 1 and "field skipped" in out and "hint:" not in out
