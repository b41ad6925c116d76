"""`rewind diff`: a resumed run equals the straight one, a run resumed under another seed diverges at the
step after the change, forks are aligned at their fork step, and bad input ends as one line."""

from __future__ import annotations

import itertools
import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest

from rewind.states.compare import first_difference
from rewind.states.config import Config
from rewind.states.config_identity import config_hash
from rewind.states.diffing import diff_streams
from rewind.states.diffreport import CONTENT_TYPES
from rewind.states.events import (
    CheckpointCommitted,
    ConfigChanged,
    Event,
    ForkOrigin,
    RunStarted,
    StageEntered,
    StepCommitted,
)
from rewind.states.fold import fold
from rewind.states.history import anchor_end, effective
from rewind.stores.eventlog import EventLog
from rewind.stores.runs import iter_effective, read_seq_events
from tests.engine.test_loop import OVERRIDES, events_of, one_line, run_cli, train_args
from tests.states import diff_reference
from tests.states.test_diffing import resumed_event

replace = msgspec.structs.replace
CONTENT = CONTENT_TYPES  # what diff compares, one list (a new transition joins it once)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """The tiny run stopped cleanly after step 6 (a stop checkpoint at 6). Copy before resuming it."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    code, _, err = run_cli(*train_args(run, "--max-steps", "6"))
    assert code == 0, err
    return run


def resumed_copy(stopped: Path, dest: Path, *extra: str, overrides: tuple[str, ...] = OVERRIDES) -> Path:
    shutil.copytree(stopped, dest)
    code, _, err = run_cli(*train_args(dest, *extra, overrides=overrides))
    assert code == 0, err
    return dest


@pytest.fixture(scope="module")
def resumed(stopped, tmp_path_factory) -> Path:
    return resumed_copy(stopped, tmp_path_factory.mktemp("resumed") / "run")


@pytest.fixture(scope="module")
def perturbed(stopped, tmp_path_factory) -> Path:
    """Stopped after step 6, then resumed under run.seed=99: the data order changes from step 7 on."""
    dest = tmp_path_factory.mktemp("perturbed") / "run"
    return resumed_copy(stopped, dest, "--fork", overrides=(*OVERRIDES, "run.seed=99"))


def diff_json(*args: object) -> tuple[int, dict]:
    code, out, err = run_cli("diff", *args, "--json")
    assert not err
    return code, json.loads(out)


def write_fork(
    parent: Path,
    child: Path,
    at_step: int,
    change: Callable[[Event], Event] | None = None,
    config: Config | None = None,
) -> str:
    """The log `rewind fork` writes: RunStarted naming the parent, RunResumed restoring the parent's
    state as of its checkpoint at `at_step`, ConfigChanged when the child has a `config` of its own,
    then the parent's content after it (through `change`)."""
    records = effective(read_seq_events(parent))
    cut = next(
        i for i, (_, e) in enumerate(records) if isinstance(e, CheckpointCommitted) and e.step == at_step
    )
    end = anchor_end(records, cut)
    checkpoint = records[cut][1].checkpoint
    restored = fold(e for _, e in records[:end])
    started = records[0][1]
    assert isinstance(started, RunStarted)
    origin = ForkOrigin(run=str(parent), step=at_step, checkpoint=checkpoint, config_hash=started.config_hash)
    config = config or started.config
    with EventLog.open(child, "w") as log:
        log.append(
            RunStarted(step=0, tokens=0, config=config, config_hash=config_hash(config), parent=origin)
        )
        log.append(
            resumed_event(
                restored,
                fork=True,
                step=at_step,
                tokens=restored.tokens,
                checkpoint=checkpoint,
                superseded_first_seq=1,
                superseded_last_seq=0,
                config_hash=started.config_hash,
            )
        )
        if config != started.config:
            hashes = {"config_hash": config_hash(config), "previous_hash": started.config_hash}
            log.append(ConfigChanged(step=at_step, tokens=restored.tokens, config=config, **hashes))
        for _, event in records[end:]:
            if isinstance(event, CONTENT):
                log.append(change(event) if change else event)
        log.commit()
    return checkpoint


def scaled_loss_at(step: int, factor: float) -> Callable[[Event], Event]:
    def change(event: Event) -> Event:
        if isinstance(event, StepCommitted) and event.step == step:
            return replace(event, loss=event.loss * factor)
        return event

    return change


# --- straight, resumed, stopped, perturbed ------------------------------------------------------------


def test_a_stopped_and_resumed_run_does_not_diverge_from_the_straight_one(straight, resumed):
    code, out, err = run_cli("diff", straight, resumed)
    assert code == 0, out + err
    assert not err
    assert "no divergence" in out and "bit for bit" in out
    assert "first divergence" not in out and "after the divergence" not in out
    assert "config in force at the end: the same" in out
    code, report = diff_json(straight, resumed)
    assert code == 0
    assert report["divergence"] is None and report["config_differences"] == []
    assert report["config_changes"] == {"a": [], "b": []}
    assert report["relation"] == {"child": "", "parent_a": None, "parent_b": None}
    assert report["runs"]["a"]["num_compared"] == report["runs"]["b"]["num_compared"] > 20


def test_a_run_resumed_under_another_seed_diverges_at_the_step_after_the_change(straight, perturbed):
    code, report = diff_json(straight, perturbed)
    assert code == 1
    found = report["divergence"]
    assert found["kind"] == "event" and found["step"] == 7
    assert found["a"]["type"] == found["b"]["type"] == "StepCommitted"
    assert found["a"]["step"] == found["b"]["step"] == 7
    # The field is whichever one truly differs first between the two logged step-7 events.
    step_7 = []
    for run, side in ((straight, "a"), (perturbed, "b")):
        ((seq, event),) = [
            (s, e) for s, e in effective(read_seq_events(run)) if isinstance(e, StepCommitted) and e.step == 7
        ]
        assert found[side]["seq"] == seq
        step_7.append(event)
    truly = first_difference(*step_7)
    assert truly is not None
    assert (found["field"], found["value_a"], found["value_b"]) == (truly.field, truly.a, truly.b)
    # Every content event before it agrees: it is the first divergence.
    before = [
        [e for s, e in effective(read_seq_events(run)) if isinstance(e, CONTENT) and s < found[side]["seq"]]
        for run, side in ((straight, "a"), (perturbed, "b"))
    ]
    assert len(before[0]) == len(before[1]) > 6
    assert all(first_difference(a, b) is None for a, b in zip(*before, strict=True))
    assert report["config_differences"] == ["run.seed: 7 -> 99"]
    assert report["config_changes"]["a"] == []
    ((change,),) = [report["config_changes"]["b"]]
    assert change["step"] == 6 and change["changes"] == ["run.seed: 7 -> 99"]
    metrics = report["metrics"]
    assert metrics["from_step"] == 7 and metrics["num_steps_both"] == 14
    deltas = {m["name"]: m for m in metrics["scalars"]}
    assert deltas["loss"]["max_abs_delta"] > 0 and deltas["grad_norm"]["max_abs_delta"] > 0
    assert deltas["loss"]["num_steps_different"] > 0 and deltas["loss"]["at_step"] >= 7
    assert deltas["lr"]["max_abs_delta"] == 0  # the schedule did not change, only the data order
    assert [e["boundary"] for e in metrics["evaluations"]] == [0, 1, 2]


def test_the_readable_report_of_the_perturbed_run(straight, perturbed):
    code, out, err = run_cli("diff", straight, perturbed)
    assert code == 1 and not err
    _, report = diff_json(straight, perturbed)
    found = report["divergence"]
    lines = out.splitlines()
    assert lines[0].startswith(f"A  {straight}") and lines[1].startswith(f"B  {perturbed}")
    where = f"  at step 7: StepCommitted, field {found['field']}"
    headings = ["relation", "config in force at the end: 1 difference(s), A -> B", "config changed mid-run"]
    order = [lines.index(h) for h in headings]
    order.append(next(i for i, line in enumerate(lines) if line.startswith("first divergence")))
    order.append(lines.index(where))
    after = next(
        i for i, line in enumerate(lines) if line.startswith("after the divergence (steps 7..20: 14 in both")
    )
    order.append(after)
    assert order == sorted(order)
    # The change is shown with the seq the engine logged it at (13 in rewind 0.1's layout).
    ((change_seq, _),) = [(s, e) for s, e in read_seq_events(perturbed) if isinstance(e, ConfigChanged)]
    assert (
        "  run.seed: 7 -> 99" in lines and f"  B from step 6 (seq {change_seq}): run.seed: 7 -> 99" in lines
    )
    value_line = next(line for line in lines[order[-2] :] if line.split()[:1] == [found["field"]])
    assert value_line.split()[1:] == [repr(found["value_a"]), repr(found["value_b"])]  # full precision
    loss_line = next(line for line in lines[after:] if line.split()[:1] == ["loss"])
    assert float(loss_line.split()[1]) > 0 and loss_line.split()[2] != "-"


def test_diff_plot_overlays_both_runs_in_one_picture(straight, perturbed, tmp_path):
    from tests.tools.test_timeline_cmd import assert_png

    out = tmp_path / "plots" / "a_vs_b.png"
    code, stdout, err = run_cli("diff", straight, perturbed, "--plot", out)
    assert code == 1 and not err  # they diverge; the picture is drawn all the same
    assert stdout.splitlines()[-1] == f"plot written to {out}"
    assert_png(out)
    code, report = diff_json(straight, perturbed, "--plot", tmp_path / "again.png")
    assert code == 1 and report["plot"] == str(tmp_path / "again.png")
    assert_png(tmp_path / "again.png")


def test_diff_plot_marks_the_fork_names_both_runs_and_draws_b_minus_a(straight, tmp_path, monkeypatch):
    """Read from the Figure's artists: the fork point on every panel, each run by its own name (a fork
    shares its parent's run name: their directories tell them apart), and B - A of the loss, exactly
    zero but at the one step the fork changed."""
    from rewind.tools import timeline_compare
    from rewind.tools.plots import pyplot
    from rewind.tools.timeline_cmd import read_timeline

    child = tmp_path / "child"
    write_fork(straight, child, 8, change=scaled_loss_at(14, 1.5))
    drawn = []
    monkeypatch.setattr(timeline_compare, "plot_comparison", lambda *args, **kwargs: drawn.append(kwargs))
    assert run_cli("diff", straight, child, "--plot", tmp_path / "d.png")[0] == 1
    assert drawn == [{"child": "b"}]  # diff tells the plot which run forked from which
    a, b = (read_timeline(str(run), with_plot=True) for run in (straight, child))
    assert a.config.run.name == b.config.run.name
    fig = timeline_compare.comparison_figure(a, b, child="b")
    try:
        panels = {ax.get_label(): ax for ax in fig.axes if ax.get_label()}
        assert list(panels) == ["loss", "difference", "accuracy", "lr", "kl", "mixture"]
        tps = a.schedule.tokens_per_step
        for ax in panels.values():
            (fork,) = [line for line in ax.get_lines() if line.get_gid() == "fork"]
            assert list(fork.get_xdata()) == [8 * tps, 8 * tps]
        legend = [text.get_text() for text in panels["loss"].get_legend().get_texts()]
        assert f"child forked from {straight.name} at step 8" in legend
        assert f"A: {straight.name}" in legend and "B: child" in legend
        assert (
            panels["loss"].get_title().splitlines()[0] == f"{straight.name} (A, solid) vs child (B, dashed)"
        )
        losses = {e.step: e.loss for e in events_of(straight) if isinstance(e, StepCommitted)}
        (raw,) = [line for line in panels["difference"].get_lines() if line.get_label() == "B - A per step"]
        assert list(raw.get_xdata()) == [k * tps for k in range(9, 21)]  # the steps both runs logged
        assert list(raw.get_ydata()) == [
            losses[14] * 1.5 - losses[14] if k == 14 else 0.0 for k in range(9, 21)
        ]
        smoothed = [line for line in panels["difference"].get_lines() if line.get_gid() == "difference"]
        assert sorted(x for line in smoothed for x in line.get_xdata()) == [k * tps for k in range(9, 21)]
    finally:
        pyplot().close(fig)
    same = timeline_compare.run_names({"a": a, "b": a})
    assert same["a"] != same["b"]  # one run twice is still two names


def test_diff_plot_weighs_a_grpo_stages_kl_by_its_kl_beta_and_leaves_dpo_steps_blank():
    """examples/posttrain.toml's steps as its log reads (every beta 0 by rule): the dotted weight x KL line is
    grpo.kl_beta 0.02 x the KL in the grpo stage, as the loss weighs it, not beta x KL = 0; a dpo step,
    which computes no KL, is blank in both lines."""
    from rewind.tools import timeline_compare
    from rewind.tools.plots import pyplot
    from tests.tools.test_timeline_plot import POSTTRAIN, no_text, written_timeline

    a = written_timeline(POSTTRAIN, lambda k, stage: 1.0, no_text, kl_of=lambda k, stage: 0.25 * stage)
    b = written_timeline(POSTTRAIN, lambda k, stage: 1.0, no_text, kl_of=lambda k, stage: 0.5 * stage)
    fig = timeline_compare.comparison_figure(a, b)
    try:
        (loss_panel,) = [ax for ax in fig.axes if ax.get_label() == "loss"]
        said = "task loss, smoothed\neach stage's own:\ncross-entropy (no KL), DPO, GRPO policy + KL"
        assert loss_panel.get_ylabel() == said  # a grpo stage's loss has its KL term in
        (kl_panel,) = [ax for ax in fig.axes if ax.get_label() == "kl"]
        lines = {line.get_label(): line for line in kl_panel.get_lines()}
        schedule, tps = a.schedule, a.schedule.tokens_per_step
        dpo, grpo = schedule.entry_steps[2], schedule.entry_steps[3]
        for side, kl in (("A", 0.75), ("B", 1.5)):
            steps = [int(x) // tps - 1 for x in lines[f"KL ({side})"].get_xdata()]
            assert steps == list(range(schedule.num_steps))
            raw = np.asarray(lines[f"KL ({side})"].get_ydata())
            weighted = np.asarray(lines[f"weight x KL ({side})"].get_ydata())
            assert np.all(np.isnan(raw[dpo:grpo])) and np.all(np.isnan(weighted[dpo:grpo]))  # blank, not 0
            assert raw[grpo:] == pytest.approx(kl) and weighted[grpo:] == pytest.approx(0.02 * kl)
            assert not weighted[:dpo].any()  # pretrain and sft: beta 0
    finally:
        pyplot().close(fig)


def test_a_stopped_run_ends_early(straight, stopped):
    code, out, err = run_cli("diff", straight, stopped)
    assert code == 1 and not err
    assert "run B ends at step 6 (not finished); run A goes on to step 20 (finished)" in out
    assert "A's next event: StepCommitted at step 7" in out
    assert "no step logged by both runs from here on" in out
    code, report = diff_json(stopped, straight)
    found = report["divergence"]
    assert (found["kind"], found["ended"], found["a"], found["step"]) == ("ends", "a", None, 7)
    assert found["b"]["type"] == "StepCommitted" and found["b"]["step"] == 7
    assert report["runs"]["a"]["finished"] is False and report["runs"]["a"]["last_step"] == 6
    assert report["metrics"]["num_steps_only_b"] == 14 and report["metrics"]["num_steps_both"] == 0


# --- forks ----------------------------------------------------------------------------------------------


def test_a_fork_that_repeats_its_parent(straight, tmp_path, monkeypatch):
    child = tmp_path / "child"
    checkpoint = write_fork(straight, child, 11)
    code, out, err = run_cli("diff", straight, child)
    assert code == 0, out + err
    assert f"  B is a fork of A at step 11 (checkpoint {checkpoint})" in out.splitlines()
    assert "content events from step 11" in out
    code, report = diff_json(child, straight)
    assert code == 0
    assert report["relation"]["child"] == "a" and report["relation"]["parent_a"]["checkpoint"] == checkpoint
    assert report["compared_from_step"] == 11 and report["runs"]["a"]["start_step"] == 11
    # The parent is recognised by where it resolves, however it is spelled.
    monkeypatch.chdir(straight.parent)
    code, out, _ = run_cli("diff", f"./{straight.name}/", child)
    assert code == 0 and "B is a fork of A at step 11" in out


def test_a_fork_under_a_changed_config(straight, tmp_path):
    child = tmp_path / "child"
    config = read_seq_events(straight)[0][1].config
    write_fork(straight, child, 11, config=replace(config, run=replace(config.run, seed=99)))
    code, out, err = run_cli("diff", straight, child)
    assert code == 0, out + err  # the hand-made child repeats the parent's events
    lines = out.splitlines()
    assert "  run.seed: 7 -> 99" in lines
    assert "  B from step 11 (seq 2): run.seed: 7 -> 99" in lines  # against the parent's config
    _, report = diff_json(straight, child)
    ((change,),) = [report["config_changes"]["b"]]
    assert change["previous_known"] and change["previous_hash"] == read_seq_events(straight)[0][1].config_hash


def test_a_fork_with_one_perturbed_step(straight, tmp_path):
    child = tmp_path / "child"
    write_fork(straight, child, 8, change=scaled_loss_at(14, 1.5))
    code, report = diff_json(straight, child)
    assert code == 1
    found = report["divergence"]
    assert (found["kind"], found["step"], found["field"]) == ("event", 14, "loss")
    assert found["value_b"] == found["value_a"] * 1.5
    ((child_seq, _),) = [
        (s, e) for s, e in read_seq_events(child) if isinstance(e, StepCommitted) and e.step == 14
    ]
    assert found["b"]["seq"] == child_seq
    deltas = {m["name"]: m for m in report["metrics"]["scalars"]}
    assert deltas["loss"]["num_steps_different"] == 1 and deltas["loss"]["at_step"] == 14
    assert deltas["grad_norm"]["max_abs_delta"] == 0


def test_rtol_tolerates_a_tiny_relative_difference(straight, tmp_path):
    child = tmp_path / "child"
    write_fork(straight, child, 12, change=scaled_loss_at(15, 1 + 1e-12))
    assert run_cli("diff", straight, child)[0] == 1
    code, out, err = run_cli("diff", straight, child, "--rtol", "1e-9")
    assert code == 0, out + err
    assert "within rtol 1e-09" in out


def test_a_fork_of_another_run_names_its_parent(resumed, straight, tmp_path):
    child = tmp_path / "child"
    write_fork(straight, child, 16)
    code, out, err = run_cli("diff", resumed, child)
    assert code == 0, out + err  # the resumed run equals the straight one, so it equals the fork too
    lines = out.splitlines()
    assert "  neither run is a fork of the other" in lines
    assert any(line.startswith(f"  B is a fork of {straight} at step 16") for line in lines)


def test_a_live_run_is_read_while_its_writer_holds_the_log(straight, tmp_path):
    child = tmp_path / "child"
    write_fork(straight, child, 11)
    with EventLog.open(child, "w") as log:  # a writer holds the lock, as a training process would
        code, out, err = run_cli("diff", straight, child)
        assert log.num_committed > 2
    assert code == 0, out + err


# --- streamed ------------------------------------------------------------------------------------------


def test_the_streamed_diff_is_the_list_based_one_on_real_and_golden_runs(
    straight, resumed, perturbed, stopped
):
    """The report `rewind diff` streams from two logs is the one the list-based diff (kept as the
    oracle) computes from the same logs read whole, for every pair of these runs."""
    golden = Path(__file__).parent / "golden" / "runs"
    runs = [
        straight,
        resumed,
        perturbed,
        stopped,
        *(golden / name for name in ("straight", "crashed", "perturbed")),
    ]
    for a, b in itertools.product(runs, repeat=2):
        for rtol in (0.0, 1e-5):
            streamed = diff_streams(iter_effective(a), iter_effective(b), rtol=rtol)
            listed = diff_reference.diff_runs(read_seq_events(a), read_seq_events(b), rtol=rtol)
            assert msgspec.msgpack.encode(streamed) == msgspec.msgpack.encode(listed), (a, b, rtol)


# --- bad input ------------------------------------------------------------------------------------------


def test_the_same_run_twice_does_not_diverge(straight):
    code, out, err = run_cli("diff", straight, straight)
    assert code == 0 and not err and "no divergence" in out


@pytest.mark.parametrize("which", ["a", "b"])
def test_a_missing_run(straight, tmp_path, which):
    missing = tmp_path / "nothing"
    args = (missing, straight) if which == "a" else (straight, missing)
    code, out, err = run_cli("diff", *args)
    assert code == 2 and not out
    line = one_line(err)
    assert str(missing) in line and "no run here" in line and "Traceback" not in err


@pytest.mark.parametrize("rtol", ["-1e-6", "nan", "inf", "abc"])
def test_a_bad_rtol_is_a_usage_error(straight, rtol):
    code, out, err = run_cli("diff", straight, straight, "--rtol", rtol)
    assert code == 2 and not out
    assert "--rtol" in one_line(err) and "Traceback" not in err


def test_a_log_that_does_not_start_with_run_started(straight, tmp_path):
    odd = tmp_path / "odd"
    with EventLog.open(odd, "w") as log:
        log.append(StageEntered(step=0, tokens=0, stage=0))
        log.commit()
    code, out, err = run_cli("diff", straight, odd)
    assert code == 1 and not out
    assert "RunStarted" in one_line(err)


def test_nans_that_differ_only_in_their_payload_are_shown_with_their_bits(straight, tmp_path):
    def nan_loss_at_14(payload: int) -> Callable[[Event], Event]:
        nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0000 | payload))[0]
        return lambda e: replace(e, loss=nan) if isinstance(e, StepCommitted) and e.step == 14 else e

    write_fork(straight, tmp_path / "one", 12, change=nan_loss_at_14(1))
    write_fork(straight, tmp_path / "two", 12, change=nan_loss_at_14(2))
    assert run_cli("diff", tmp_path / "one", tmp_path / "one")[0] == 0  # the same NaN is equal
    code, out, err = run_cli("diff", tmp_path / "one", tmp_path / "two")
    assert code == 1 and not err
    line = next(line for line in out.splitlines() if line.split()[:1] == ["loss"])
    assert line.split()[1:] == ["nan", "(bits", "7ff8000000000001)", "nan", "(bits", "7ff8000000000002)"]
    _, report = diff_json(tmp_path / "one", tmp_path / "two")
    assert report["divergence"]["step"] == 14 and report["divergence"]["value_a"] is None  # NaN: null in strict JSON
