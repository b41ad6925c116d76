"""The [compute] options' refusals (one line, exit 2, nothing written) and where a run records that it
computed (RunStarted / RunResumed .device and .world_size), with the runs and helpers of
tests/engine/test_compute.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
import pytest
import torch
import torch.distributed as dist

from rewind.states.events import Event, RunResumed, RunStarted
from rewind.states.fold import fold
from rewind.stores.eventlog import EventLog
from tests.engine.test_compute import (  # noqa: F401 (_adopted_device_restored: the autouse fixture)
    CUDA_MESSAGE,
    SHORT,
    _adopted_device_restored,
    cli,
    sets,
    train_in_process,
)
from tests.engine.test_loop import TINY, events_of, one_line, run_cli, train_args

# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_asking_for_cuda_without_it_is_one_line_and_writes_nothing(tmp_path, precision):
    run = tmp_path / "run"
    overrides = (*SHORT, 'compute.device="cuda"', f'compute.precision="{precision}"')
    code, out, err = run_cli(*train_args(run, overrides=overrides))
    assert (code, out) == (2, "")
    assert one_line(err) == CUDA_MESSAGE
    assert not run.exists()
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("field", "value"),
    [("precision", '"fp8"'), ("loss_kernel", '"liger"'), ("device", '"gpu"'), ("compile", '"yes"')],
)
def test_a_bad_compute_value_is_a_config_error_naming_the_field(tmp_path, field, value):
    run = tmp_path / "run"
    code, out, err = run_cli(*train_args(run, overrides=(*SHORT, f"compute.{field}={value}")))
    assert (code, out) == (2, "")
    line = one_line(err)
    assert line.startswith("rewind: ") and f"compute.{field}" in line and "Traceback" not in err
    assert not run.exists()


def test_the_triton_kernel_without_its_interpreter_is_refused_at_start(tmp_path):
    run = tmp_path / "run"
    done = cli(
        tmp_path, "train", TINY, "--run-dir", run, "--no-progress", *sets(('compute.loss_kernel="triton"',)),
        env={"TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert one_line(done.stderr) == (
        'rewind: compute.loss_kernel = "triton": on the CPU it runs in Triton\'s interpreter, and triton was '
        "loaded without it: set TRITON_INTERPRET=1"
    )
    assert not run.exists()


# --- where a run computed, on record ----------------------------------------------------------------


def test_a_plain_run_and_its_resume_record_the_cpu_and_one_process(tmp_path):
    run = tmp_path / "run"
    train_in_process(run, SHORT, "--max-steps", "3")
    train_in_process(run, SHORT)
    events = events_of(run)
    started, resumed = events[0], [e for e in events if isinstance(e, RunResumed)]
    assert isinstance(started, RunStarted) and (started.device, started.world_size) == ("cpu", 1)
    assert [(e.device, e.world_size) for e in resumed] == [("cpu", 1)]
    state = fold(events)
    assert state.finished and (state.device, state.world_size) == ("cpu", 1)


def _recorded_on_cuda(run: Path) -> list[Event]:
    """`run` stopped after 2 steps, its log rewritten as if RunStarted had been on a GPU."""
    train_in_process(run, SHORT, "--max-steps", "2")
    events = events_of(run)
    events[0] = msgspec.structs.replace(events[0], device="cuda:NVIDIA H100 80GB HBM3")
    shutil.rmtree(run / "events")
    shutil.rmtree(run / "snapshots", ignore_errors=True)  # folds of the old log
    with EventLog.open(str(run), "w") as log:
        for event in events:
            log.append(event)
        log.commit()
    return events


@pytest.mark.skipif(torch.cuda.is_available(), reason="resumes a CUDA run where there is no CUDA")
def test_a_run_recorded_on_cuda_resumes_there_or_is_forked_onto_the_cpu(tmp_path):
    run = tmp_path / "run"
    before = _recorded_on_cuda(run)
    # compute.device = "auto" goes on where the run computed: not here, in one line, nothing appended.
    code, _, err = run_cli(*train_args(run, overrides=SHORT))
    assert code == 2 and one_line(err) == CUDA_MESSAGE
    assert events_of(run) == before
    # Forked in place onto the CPU it goes on, on record.
    code, _, err = run_cli(*train_args(run, "--fork", overrides=(*SHORT, 'compute.device="cpu"')))
    assert code == 0, err
    events = events_of(run)
    assert [(e.device, e.world_size) for e in events if isinstance(e, RunResumed)] == [("cpu", 1)]
    state = fold(events)
    assert state.finished and (state.device, state.world_size) == ("cpu", 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="resumes a CUDA run where there is no CUDA")
def test_a_new_run_in_the_same_process_does_not_inherit_a_resumes_device(tmp_path):
    _recorded_on_cuda(tmp_path / "cuda-run")
    code, _, _ = run_cli(*train_args(tmp_path / "cuda-run", overrides=SHORT))
    assert code == 2  # refused: it computed on CUDA
    code, _, err = run_cli(*train_args(tmp_path / "fresh", overrides=SHORT))
    assert code == 0, err
    assert events_of(tmp_path / "fresh")[0].device == "cpu"


def test_a_run_of_an_older_release_recorded_no_device_and_goes_on_on_the_cpu(monkeypatch):
    """Before schema 6 nothing was recorded, and every run computed on the CPU: under compute.device =
    "auto" a resume, replay or sample of one stays there even where CUDA is available; a new run
    chooses for itself again."""
    from rewind.engine.model import placement
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    placement.adopt_device("")
    assert placement.resolve_device("auto") == torch.device("cpu")
    placement.forget_adopted_device()
    assert placement.resolve_device("auto") == torch.device("cuda", 0)
