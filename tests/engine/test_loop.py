"""The training loop end to end, driven through `rewind train` in-process on a shrunken tiny config.

What a straight run logs and leaves on disk (stages, reference refresh, rows, evaluations, checkpoints
and their retention, metrics, export), what a non-finite loss does (stop / skip), and what Ctrl-C does.
The straight run is trained once per test session (`straight_run`); the modules of tests/tools compare
their stopped-and-resumed runs with it.

Every run here trains with one torch thread: on a shared 2-core machine a second thread makes the tiny
matmuls ten times slower, and all runs compared bit for bit are trained under the same setting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import math
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from rewind.engine.model import layout as layouts
from rewind.engine.model import tensors
from rewind.engine.run import loop
from rewind.engine.step import mixed_step
from rewind.engine.step import step as step_module
from rewind.states.config import Config
from rewind.states.events import (
    CheckpointCommitted,
    CheckpointDeleted,
    Evaluated,
    Event,
    NonFiniteLoss,
    ReferenceRefreshed,
    RunFinished,
    RunResumed,
    RunStarted,
    RunStopped,
    StageEntered,
    StepCommitted,
)
from rewind.states.fold import apply, fold
from rewind.states.history import effective
from rewind.states.plan import step_lr
from rewind.states.schedule import Schedule
from rewind.states.state import State
from rewind.stores.checkpoints import CheckpointStore
from rewind.stores.runs import read_seq_events
from rewind.tools.cli import main
from tests.conftest import EXAMPLES

TINY = EXAMPLES / "tiny.toml"
# 10 + 5 + 5 steps of 256 tokens (stage entries land at steps 0, 11 and 16 with tiny's fades), an
# interval checkpoint every 4 steps, and only the last interval one kept: retention has work to do.
OVERRIDES = (
    "training.tokens=[2560,1280,1280]",
    "logging.checkpoint_interval=4",
    "logging.keep_last_checkpoints=1",
)


# --- helpers shared with tests/tools ----------------------------------------------------------------


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_cli(*args: object) -> tuple[int, str, str]:
    """`rewind ARGS...` in-process, usable outside function-scoped fixtures: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), one_torch_thread():
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse usage errors
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def train_args(run_dir: Path, *extra: str, overrides: tuple[str, ...] = OVERRIDES) -> list[str]:
    sets = [part for override in overrides for part in ("--set", override)]
    return ["train", str(TINY), "--run-dir", str(run_dir), "--no-progress", *sets, *extra]


def straight_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shrunken tiny run trained straight through, once per test session."""
    base = tmp_path_factory.getbasetemp()
    run, done = base / "straight-run", base / "straight-run.done"
    if not done.exists():
        shutil.rmtree(run, ignore_errors=True)  # a previous attempt that failed half way
        code, _, err = run_cli(*train_args(run))
        assert code == 0, err
        done.touch()
    return run


def events_of(run: Path) -> list[Event]:
    return [event for _, event in read_seq_events(run)]


def effective_steps(run: Path) -> list[bytes]:
    """The effective StepCommitted stream as msgpack bytes (floats compared bit for bit, NaN included)."""
    return [
        msgspec.msgpack.encode(e) for _, e in effective(read_seq_events(run)) if isinstance(e, StepCommitted)
    ]


def exported_weights(run: Path, out: Path) -> dict[str, torch.Tensor]:
    code, _, err = run_cli("export", run, "--to", out)
    assert code == 0, err
    return load_file(out)


def assert_bitwise_equal(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert want.keys() == got.keys()
    for name in want:
        assert want[name].dtype == got[name].dtype, name
        assert want[name].shape == got[name].shape, name
        # Raw bytes, not float equality: -0.0 vs 0.0 or a NaN payload would show.
        a, b = (
            want[name].contiguous().reshape(-1).view(torch.uint8),
            got[name].contiguous().reshape(-1).view(torch.uint8),
        )
        assert torch.equal(a, b), name


def config_of(run: Path) -> Config:
    started = events_of(run)[0]
    assert isinstance(started, RunStarted)
    return started.config


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


# --- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    return straight_run(tmp_path_factory)


# --- a straight run ---------------------------------------------------------------------------------


def test_straight_run_folds_to_finished_and_enters_every_stage_once_in_order(straight):
    events = events_of(straight)
    schedule = Schedule(config_of(straight))
    state = fold(events)
    assert state.finished and state.step == schedule.num_steps == 20
    assert isinstance(events[-1], RunFinished)
    entered = [(e.stage, e.step) for e in events if isinstance(e, StageEntered)]
    assert entered == [(i, schedule.entry_steps[i]) for i in range(schedule.num_stages)]
    assert not any(isinstance(e, RunStopped | RunResumed | NonFiniteLoss) for e in events)


def test_step_commits_are_contiguous_and_follow_the_schedule(straight):
    config = config_of(straight)
    schedule = Schedule(config)
    steps = [e for e in events_of(straight) if isinstance(e, StepCommitted)]
    assert [e.step for e in steps] == list(range(1, schedule.num_steps + 1))
    state = fold(events_of(straight)[:1])  # the LR is the run's own: a new run's warmup floor
    assert steps[0].lr == pytest.approx(0.01 * config.optimization.lr)  # step 0 is not spent at LR 0
    for event in steps:
        k = event.step - 1
        assert sum(event.rows) == config.training.batch_size
        assert event.rows == list(schedule.rows(k))
        assert event.tokens == event.step * schedule.tokens_per_step
        assert event.lr == step_lr(state, schedule, k) and event.beta == schedule.beta(k)
        assert event.stage == schedule.primary(k)
        assert not event.skipped and math.isfinite(event.loss)
    # The fades really mixed stages: some step drew rows from two of them.
    assert any(sum(1 for r in e.rows if r) == 2 for e in steps)


def test_reference_refresh_points_at_a_checkpoint_of_the_refresh_step(straight):
    events = events_of(straight)
    refreshes = [e for e in events if isinstance(e, ReferenceRefreshed)]
    schedule = Schedule(config_of(straight))
    assert [e.stage for e in refreshes] == sorted(schedule.reference_update_stages) == [1]
    for refresh in refreshes:
        before = events[: events.index(refresh)]
        held = [
            e for e in before if isinstance(e, CheckpointCommitted) and e.checkpoint == refresh.checkpoint
        ]
        assert len(held) == 1, refresh
        assert held[0].step == refresh.step == schedule.entry_steps[refresh.stage]
        assert (straight / "checkpoints" / refresh.checkpoint / "model.safetensors").is_file()


def test_a_baseline_then_one_evaluation_per_stage_boundary(straight):
    schedule = Schedule(config_of(straight))
    events = events_of(straight)
    evaluations = [e for e in events if isinstance(e, Evaluated)]
    ends = [*schedule.entry_steps[1:], schedule.num_steps]  # stage i ends where stage i + 1 starts
    # The untrained weights first, right after RunStarted, before any update.
    assert events.index(evaluations[0]) == 1 and (evaluations[0].boundary, evaluations[0].step) == (-1, 0)
    assert [(e.boundary, e.step) for e in evaluations[1:]] == list(enumerate(ends))
    for event in evaluations:
        assert set(event.scores) == {"reverse", "sort"} and set(event.losses) == {"reverse", "sort"}
        assert all(0.0 <= s <= 1.0 for s in event.scores.values())


def test_checkpoints_at_interval_boundaries_and_end(straight):
    config = config_of(straight)
    schedule = Schedule(config)
    committed = {e.step: e.reason for e in events_of(straight) if isinstance(e, CheckpointCommitted)}
    boundaries = set(schedule.entry_steps[1:])
    interval = config.logging.checkpoint_interval
    expected = {s: "interval" for s in range(interval, schedule.num_steps, interval)}
    expected |= dict.fromkeys(boundaries, "boundary")
    expected[schedule.num_steps] = "final"
    assert committed == expected


def test_retention_deletes_old_interval_checkpoints_on_record_and_on_disk(straight):
    config = config_of(straight)
    keep = config.logging.keep_last_checkpoints
    events = events_of(straight)
    deleted = [e.checkpoint for e in events if isinstance(e, CheckpointDeleted)]
    reasons = {e.checkpoint: e.reason for e in events if isinstance(e, CheckpointCommitted)}
    assert deleted, "interval checkpoints exceeded keep_last, yet none was deleted"
    assert all(reasons[name] == "interval" for name in deleted)
    for name in deleted:
        assert not (straight / "checkpoints" / name).exists(), name

    state = State()
    for event in [*events, None]:
        if event is None or isinstance(event, StepCommitted):  # retention has run for the last step
            reference = state.reference.checkpoint if state.reference else None
            unprotected = [
                c
                for c in state.live_checkpoints
                if c.reason not in ("boundary", "final") and c.checkpoint != reference
            ]
            assert len(unprotected) <= keep, (state.step, unprotected)
        if event is not None:
            state = apply(state, event)
    live = sorted(c.checkpoint for c in state.live_checkpoints)
    assert CheckpointStore(str(straight)).names_on_disk() == live  # nothing more, nothing less


def test_metrics_have_one_train_line_per_step(straight):
    lines = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if line["type"] == "train"]
    steps = [e for e in events_of(straight) if isinstance(e, StepCommitted)]
    assert [line["step"] for line in train] == [e.step for e in steps]
    assert [line["loss"] for line in train] == [e.loss for e in steps]
    assert [line["boundary"] for line in lines if line["type"] == "evaluation"] == [-1, 0, 1, 2]


def test_export_writes_the_final_checkpoints_model(straight, tmp_path):
    final = fold(events_of(straight)).last_checkpoint
    assert final is not None and final.reason == "final"
    code, out, err = run_cli("export", straight, "--to", tmp_path / "out" / "model.safetensors")
    assert code == 0, err
    assert final.checkpoint in out
    stored = CheckpointStore(str(straight)).load(final.checkpoint, final.files)["model"]
    assert_bitwise_equal(stored, load_file(tmp_path / "out" / "model.safetensors"))


def test_export_tensorboard_rebuilds_metrics_identically(straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    before = (run / "metrics.jsonl").read_bytes()
    (run / "metrics.jsonl").unlink()
    shutil.rmtree(run / "tb")
    code, out, err = run_cli("export", "tensorboard", run)
    assert code == 0, err
    assert "metrics.jsonl" in out
    assert (run / "metrics.jsonl").read_bytes() == before
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tb").iterdir())


# --- non-finite loss --------------------------------------------------------------------------------


def poison_step(monkeypatch: pytest.MonkeyPatch, bad_step: int) -> dict:
    """Make the step with index `bad_step` see a NaN loss; returns what the model and optimizer held
    just before and just after that step (filled in when it runs)."""
    seen: dict = {}
    real_train_step, real_losses = mixed_step.train_step, step_module.fused_losses

    def nan_losses(*args, **kwargs):
        losses = real_losses(*args, **kwargs)
        return dataclasses.replace(losses, ce=torch.full_like(losses.ce, math.nan))

    def held(model, optimizer):
        names = layouts.parameter_names(model)
        return tensors.model_tensors(model), tensors.optimizer_tensors(optimizer, names)[0]

    def train_step(model, optimizer, *args, step, **kwargs):
        if step != bad_step:
            return real_train_step(model, optimizer, *args, step=step, **kwargs)
        seen["before"] = held(model, optimizer)
        with monkeypatch.context() as patch:
            patch.setattr(step_module, "fused_losses", nan_losses)
            result = real_train_step(model, optimizer, *args, step=step, **kwargs)
        seen["after"] = held(model, optimizer)
        return result

    monkeypatch.setattr(mixed_step, "train_step", train_step)
    return seen


def test_nonfinite_loss_stops_at_the_last_good_checkpoint(tmp_path, monkeypatch):
    seen = poison_step(monkeypatch, bad_step=9)
    run = tmp_path / "run"
    code, _, err = run_cli(*train_args(run))
    assert code == 1
    assert "after" in seen
    line = one_line(err)
    assert "Traceback" not in err
    assert "non-finite loss" in line and "last good checkpoint" in line
    events = events_of(run)
    state = fold(events)
    assert not state.finished and state.step == 9
    last = state.last_checkpoint
    assert last is not None and last.step == 8 and last.checkpoint in line
    nonfinite = [e for e in events if isinstance(e, NonFiniteLoss)]
    assert len(nonfinite) == 1 and nonfinite[0].action == "stop" and nonfinite[0].step == 9
    assert math.isnan(nonfinite[0].loss)
    assert isinstance(events[-1], RunStopped) and events[-1].reason == "non-finite loss"
    assert max(e.step for e in events if isinstance(e, StepCommitted)) == 9  # the bad step never committed


def test_nonfinite_loss_with_skip_commits_a_skipped_step_without_an_update(tmp_path, monkeypatch):
    seen = poison_step(monkeypatch, bad_step=9)
    run = tmp_path / "run"
    code, _, err = run_cli(*train_args(run, overrides=(*OVERRIDES, 'training.on_nonfinite="skip"')))
    assert code == 0, err
    events = events_of(run)
    state = fold(events)
    assert state.finished and state.num_skipped_steps == 1
    nonfinite = [e for e in events if isinstance(e, NonFiniteLoss)]
    assert [(e.step, e.action) for e in nonfinite] == [(9, "skip")]
    steps = {e.step: e for e in events if isinstance(e, StepCommitted)}
    assert sorted(steps) == list(range(1, 21))
    assert steps[10].skipped and math.isnan(steps[10].loss)
    assert not any(e.skipped for s, e in steps.items() if s != 10)
    assert events.index(nonfinite[0]) == events.index(steps[10]) - 1
    # No update: weights and every optimizer moment are what they were before the step.
    (model_before, optimizer_before), (model_after, optimizer_after) = seen["before"], seen["after"]
    assert_bitwise_equal(model_before, model_after)
    assert_bitwise_equal(optimizer_before, optimizer_after)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = [m for m in metrics if m["type"] == "train" and m["step"] == 10]
    assert skipped == [{**skipped[0], "loss": None, "skipped": True}]


# --- Ctrl-C -----------------------------------------------------------------------------------------


def interrupt_before(monkeypatch: pytest.MonkeyPatch, step_index: int, times: int = 1) -> None:
    """Deliver SIGINT `times` times just as the step with index `step_index` is about to run (once)."""
    real = loop.run_one_step
    fired = []

    def run_one_step(run, state):
        if state.step == step_index and not fired:
            fired.append(True)
            for _ in range(times):
                signal.raise_signal(signal.SIGINT)
        return real(run, state)

    monkeypatch.setattr(loop, "run_one_step", run_one_step)


def test_ctrl_c_finishes_the_step_checkpoints_stops_and_resumes_exactly(straight, tmp_path, monkeypatch):
    interrupt_before(monkeypatch, step_index=5)
    run = tmp_path / "run"
    code, _, err = run_cli(*train_args(run))
    assert code == 130
    assert "Traceback" not in err and "resume" in one_line(err)
    events = events_of(run)
    stopped = events[-1]
    assert isinstance(stopped, RunStopped) and "Ctrl-C" in stopped.reason
    assert stopped.step == 6  # the step in flight (index 5) was finished and committed
    checkpoint = fold(events).last_checkpoint
    assert checkpoint is not None and checkpoint.reason == "stop" and checkpoint.step == 6
    assert (run / "checkpoints" / checkpoint.checkpoint).is_dir()

    code, _, err = run_cli(*train_args(run))
    assert code == 0, err
    events = events_of(run)
    resumed = [e for e in events if isinstance(e, RunResumed)]
    assert [(e.step, e.checkpoint) for e in resumed] == [(6, checkpoint.checkpoint)]
    assert fold(events).finished
    assert_bitwise_equal(
        exported_weights(straight, tmp_path / "a.safetensors"),
        exported_weights(run, tmp_path / "b.safetensors"),
    )
    assert effective_steps(run) == effective_steps(straight)
    # The same state, the same name: the checkpoints written after the resume are named as the straight
    # run's (a name once embedded the log position, and with it the KL reference's name).
    names = [[c.checkpoint for c in fold(events_of(r)).live_checkpoints] for r in (straight, run)]
    assert names[0] == names[1]


# --- which quantity, and how many skipped -----------------------------------------------------------

SHORT = (*OVERRIDES[1:], "training.tokens=[1280,512,512]", 'training.on_nonfinite="skip"')  # 5 + 2 + 2 steps


def poison_steps(monkeypatch: pytest.MonkeyPatch, bad_steps: set[int], quantity: str = "loss") -> None:
    """Make `quantity` non-finite in the steps with the given indices (the others run as they are)."""
    real_train_step, real_losses, real_clip = (
        mixed_step.train_step,
        step_module.fused_losses,
        torch.nn.utils.clip_grad_norm_,
    )

    def nan_losses(*args, **kwargs):
        losses = real_losses(*args, **kwargs)
        field = {"loss": "ce", "kl": "kl"}[quantity]
        return dataclasses.replace(losses, **{field: torch.full_like(getattr(losses, field), math.nan)})

    def nan_norm(*args, **kwargs):
        real_clip(*args, **kwargs)
        return torch.tensor(math.inf)

    def train_step(model, optimizer, *args, step, **kwargs):
        if step not in bad_steps:
            return real_train_step(model, optimizer, *args, step=step, **kwargs)
        with monkeypatch.context() as patch:
            if quantity == "grad_norm":
                patch.setattr(torch.nn.utils, "clip_grad_norm_", nan_norm)
            else:
                patch.setattr(step_module, "fused_losses", nan_losses)
            return real_train_step(model, optimizer, *args, step=step, **kwargs)

    monkeypatch.setattr(mixed_step, "train_step", train_step)


@pytest.mark.parametrize("quantity", ["loss", "kl", "grad_norm"])
def test_a_non_finite_step_names_the_quantity_that_was_not_finite(tmp_path, monkeypatch, quantity):
    poison_steps(monkeypatch, {6}, quantity)  # index 6 is in stage 1, where the KL term is on
    run = tmp_path / "run"
    code, _, err = run_cli(*train_args(run, "--max-steps", "7", overrides=SHORT))
    assert code == 0, err
    events = events_of(run)
    (nonfinite,) = [e for e in events if isinstance(e, NonFiniteLoss)]
    assert (nonfinite.step, nonfinite.action, nonfinite.quantity) == (6, "skip", quantity)
    assert math.isnan(nonfinite.loss) == (quantity == "loss")
    assert fold(events).num_skipped_steps == 1


def test_a_run_that_skips_most_of_its_updates_fails_with_one_line(tmp_path, monkeypatch):
    poison_steps(monkeypatch, set(range(2, 9)))  # 7 of 9 updates
    run = tmp_path / "run"
    code, _, err = run_cli(*train_args(run, overrides=SHORT))
    assert code == 1
    line = one_line(err)
    assert "7 of 9 updates (78%) were skipped" in line and "more than half" in line
    state = fold(events_of(run))
    assert state.finished and state.num_skipped_steps == 7  # on record all the same


def test_a_run_that_skips_some_updates_finishes_with_a_warning(tmp_path, monkeypatch):
    from rewind.engine.run.session import open_run
    from rewind.states.config_reading import loads_config

    poison_steps(monkeypatch, {1, 4})  # 2 of 9: more than 10%, not more than half
    config = loads_config(TINY.read_text(), overrides=list(SHORT))
    run, state, how = open_run(config, str(tmp_path / "run"), metrics=False)
    try:
        outcome = loop.drive(run, state)
    finally:
        run.journal.close()
    assert how == "started" and outcome.status == "finished" and outcome.num_skipped_updates == 2
    assert outcome.message.startswith("2 of 9 updates (22%) were skipped") and "half" not in outcome.message
    # From the command line: exit 0, and the warning on stderr, not a silent success.
    code, out, err = run_cli(*train_args(tmp_path / "cli", overrides=SHORT))
    assert code == 0 and "answer-token accuracy" in out
    assert one_line(err) == f"rewind: warning: {outcome.message}"


@pytest.mark.parametrize(
    ("skipped", "steps", "failed", "warned"),
    [
        (0, 20, False, False),
        (2, 20, False, False),
        (3, 20, False, True),
        (10, 20, False, True),
        (11, 20, True, True),
        (0, 0, False, False),
    ],
)
def test_the_skipped_share_rule(skipped, steps, failed, warned):
    verdict_failed, warning = loop.skipped_verdict(State(step=steps, num_skipped_steps=skipped))
    assert (verdict_failed, bool(warning)) == (failed, warned)
    if warned:
        assert warning.startswith(f"{skipped} of {steps} updates")
