"""`rewind timeline`: the header, the per-stage table and the markers of straight, resumed, stopped and
forked runs (JSON and text), the plot (a real PNG, also for runs with resumes and for long runs), a live
run read while another process trains it, and bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from rewind.states.events import (
    CheckpointCommitted,
    Evaluated,
    FadeEnded,
    FadeStarted,
    ReferenceRefreshed,
    RunResumed,
    RunStarted,
    RunStopped,
    StageEntered,
    StepCommitted,
    Validated,
)
from rewind.states.fold import fold
from rewind.states.history import effective
from rewind.states.schedule import Schedule
from rewind.stores.eventlog import EventLog
from rewind.stores.runs import LogNotFoundError, read_seq_events
from rewind.tools.timeline_buckets import StepColumns, bucket_edges, bucket_mean, rolling_mean
from rewind.tools.timeline_cmd import read_timeline, stage_rows
from rewind.tools.timeline_plot import plot_timeline
from rewind.tools.timeline_scan import LOSS_WINDOW_FRACTION, LOSS_WINDOW_MAX, Timeline
from tests.engine.test_loop import TINY, config_of, events_of, one_line, run_cli
from tests.tools.test_state_cmd import FORK_LR, forked_run, stopped_run, superseded_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def superseded(tmp_path_factory) -> Path:
    return superseded_run(tmp_path_factory)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    return stopped_run(tmp_path_factory)


@pytest.fixture(scope="module")
def forked(tmp_path_factory) -> Path:
    return forked_run(tmp_path_factory)


def timeline_json(run: Path) -> dict:
    code, out, err = run_cli("timeline", run, "--json")
    assert code == 0, err
    return json.loads(out)


def kinds_at(summary: dict, kind: str) -> list[tuple[int, int]]:
    return [(m["step"], m["tokens"]) for m in summary["markers"] if m["kind"] == kind]


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert 30_000 < len(data) < 3_000_000  # a real four-panel figure, not an empty canvas


# --- the summary ----------------------------------------------------------------------------------------


def test_header_fields_match_the_fold(straight):
    summary = timeline_json(straight)
    state = fold(events_of(straight))
    schedule = Schedule(config_of(straight))
    assert summary["run"] == config_of(straight).run.name
    assert (summary["step"], summary["num_steps"], summary["tokens"]) == (
        state.step,
        schedule.num_steps,
        state.tokens,
    )
    assert summary["total_tokens"] == schedule.num_steps * schedule.tokens_per_step
    assert summary["status"] == "finished" and summary["num_resumes"] == 0


def test_stage_rows_summarise_the_steps_of_each_primary_stage(straight):
    summary = timeline_json(straight)
    events = events_of(straight)
    steps = [e for e in events if isinstance(e, StepCommitted)]
    scores = {e.boundary: e.scores for e in events if isinstance(e, Evaluated)}
    schedule = Schedule(config_of(straight))
    assert [row["stage"] for row in summary["stages"]] == list(range(schedule.num_stages))
    for row in summary["stages"]:
        mine = [e for e in steps if e.stage == row["stage"]]
        losses = [e.loss for e in mine]
        window = min(LOSS_WINDOW_MAX, max(1, round(len(losses) * LOSS_WINDOW_FRACTION)))
        assert (row["first_step"], row["last_step"], row["num_steps"]) == (
            mine[0].step,
            mine[-1].step,
            len(mine),
        )
        assert (
            row["tokens_start"] == schedule.tokens_of(mine[0].step - 1)
            and row["tokens_end"] == mine[-1].tokens
        )
        assert row["loss_min"] == min(losses)
        assert row["loss_start"] == pytest.approx(sum(losses[:window]) / window)
        assert row["loss_end"] == pytest.approx(sum(losses[-window:]) / window)
        assert row["evaluation"] == scores[row["stage"]]
    assert sum(row["num_steps"] for row in summary["stages"]) == schedule.num_steps


def test_markers_are_the_control_events_in_token_order(straight):
    summary = timeline_json(straight)
    events = events_of(straight)

    def at(kind) -> list[tuple[int, int]]:
        return [(e.step, e.tokens) for e in events if isinstance(e, kind)]

    assert kinds_at(summary, "stage_entered") == at(StageEntered)
    assert kinds_at(summary, "fade_started") == at(FadeStarted)
    assert kinds_at(summary, "fade_ended") == at(FadeEnded)
    assert kinds_at(summary, "reference_refreshed") == at(ReferenceRefreshed)
    tokens = [m["tokens"] for m in summary["markers"]]
    assert tokens == sorted(tokens)
    checkpoints = [e for e in events if isinstance(e, CheckpointCommitted)]
    assert summary["checkpoints"]["steps"] == [c.step for c in checkpoints]
    assert summary["checkpoints"]["live"] == [c.checkpoint for c in fold(events).live_checkpoints]


def test_text_has_a_header_a_row_per_stage_and_a_line_per_marker(straight):
    code, out, err = run_cli("timeline", straight)
    assert code == 0, err
    summary = timeline_json(straight)
    lines = out.splitlines()
    assert lines[0].startswith(summary["run"])
    assert "status   finished" in out and f"steps    {summary['step']} of {summary['num_steps']}" in out
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["stage", "tokens", "steps"])
    rows = [line.split() for line in lines[header + 1 : header + 1 + len(summary["stages"])]]
    for cells, stage in zip(rows, summary["stages"], strict=True):
        assert cells[:3] == [
            str(stage["stage"]),
            f"{stage['tokens_start']:,}..{stage['tokens_end']:,}",
            f"{stage['first_step']}..{stage['last_step']}",
        ]
        assert cells[5] == f"{stage['loss_min']:.3f}"
    for marker in summary["markers"]:
        assert sum(line.endswith(marker["text"]) for line in lines) == 1
    (checkpoint_line,) = [line for line in lines if line.startswith("checkpoints:")]
    assert f"{summary['checkpoints']['num_written']} written" in checkpoint_line


def test_a_resume_shows_its_superseded_records_and_the_table_counts_effective_steps(superseded):
    summary = timeline_json(superseded)
    records = read_seq_events(superseded)
    (resume,) = [e for _, e in records if isinstance(e, RunResumed)]
    (marker,) = [m for m in summary["markers"] if m["kind"] == "resumed"]
    first, last = resume.superseded_first_seq, resume.superseded_last_seq
    assert marker["superseded"] == [first, last] and marker["step"] == resume.step == 4
    assert marker["superseded_steps"] == [
        e.step for s, e in records if first <= s <= last and isinstance(e, StepCommitted)
    ]
    assert marker["superseded_steps"] == [5, 6]
    assert summary["num_resumes"] == 1
    kept = [e for _, e in effective(records) if isinstance(e, StepCommitted)]
    assert sum(row["num_steps"] for row in summary["stages"]) == len(kept) == 20  # not the 22 raw ones
    code, out, err = run_cli("timeline", superseded)
    assert code == 0, err
    assert (
        f"resumed from {resume.checkpoint} at step 4; records {first}..{last} superseded (steps 5..6" in out
    )


def test_a_stopped_run_shows_the_stop_and_the_stages_not_reached(stopped):
    summary = timeline_json(stopped)
    (stop,) = [e for e in events_of(stopped) if isinstance(e, RunStopped)]
    assert summary["status"] == f"stopped: {stop.reason}" and summary["step"] == 6
    assert [(m["step"], m["reason"]) for m in summary["markers"] if m["kind"] == "stopped"] == [
        (6, stop.reason)
    ]
    reached = [row["num_steps"] > 0 for row in summary["stages"]]
    assert reached == [True, False, False]
    assert summary["stages"][1]["loss_start"] is None and summary["stages"][1]["first_step"] is None
    code, out, err = run_cli("timeline", stopped)
    assert code == 0, err
    assert out.count("not reached") == 4  # tokens and steps of stages 1 and 2


def test_a_fork_shows_the_config_change_and_the_stop_it_resumed_from(forked):
    summary = timeline_json(forked)
    kinds = [m["kind"] for m in summary["markers"] if m["step"] == 6]
    assert kinds.index("stopped") < kinds.index("resumed") < kinds.index("config_changed")
    (change,) = [m for m in summary["markers"] if m["kind"] == "config_changed"]
    assert change["changes"] == [f"optimization.lr: {config_of(forked).optimization.lr!r} -> {FORK_LR!r}"]
    assert summary["status"] == "finished" and summary["num_resumes"] == 1


# --- the plot -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["straight", "superseded", "stopped"])
def test_plot_writes_a_png_into_a_new_directory(which, request, tmp_path):
    run = request.getfixturevalue(which)
    out = tmp_path / "plots" / "deep" / "timeline.png"
    code, stdout, err = run_cli("timeline", run, "--plot", out)
    assert code == 0, err
    assert stdout.splitlines()[-1] == f"plot written to {out}"
    assert_png(out)


def test_plot_with_json_keeps_stdout_one_json_document(superseded, tmp_path):
    out = tmp_path / "t.png"
    code, stdout, err = run_cli("timeline", superseded, "--json", "--plot", out)
    assert code == 0, err
    assert json.loads(stdout)["plot"] == str(out)
    assert_png(out)


def test_the_mixture_shows_the_split_inside_a_stage_and_the_kl_term_is_drawn(straight):
    """tiny.toml's last stage trains sort and reverse half and half: the per-dataset mixture shows it
    (per-stage shares would show one solid block); the KL term is there wherever beta > 0."""
    timeline = read_timeline(str(straight), with_plot=True)
    steps = StepColumns(timeline.steps, timeline.schedule.tokens_per_step)
    last = dict(zip(steps.dataset_names, steps.datasets[-1], strict=True))
    assert last == {"grammar": 0.0, "reverse": 0.5, "sort": 0.5}
    first = dict(zip(steps.dataset_names, steps.datasets[0], strict=True))
    assert first["grammar"] == 1.0
    # One bucket per step in a run this short: the KL term of each step, zero where beta is (no reference
    # forward runs) and positive where it is not, but for the step right after a refresh (policy =
    # reference).
    kl, beta = np.array(timeline.steps.kl_sum), np.array(timeline.steps.beta)
    assert timeline.steps.width == 1 and np.all(kl[beta == 0] == 0)
    assert np.count_nonzero(kl[beta > 0] == 0) <= 2 and np.all(kl[beta > 0] >= 0)
    assert np.nanmax(steps.kl) > 0
    rows = stage_rows(timeline)
    assert [r["beta"] for r in rows] == [0.0, 0.2, 0.2]
    assert rows[0]["kl_mean"] is None and rows[1]["kl_mean"] > 0 and rows[2]["kl_mean"] > 0
    code, out, err = run_cli("timeline", straight)
    assert code == 0, err
    assert "KL to reference" in out and "mean KL" in out and "task loss" in out


@pytest.fixture(scope="module")
def posttrained(tmp_path_factory) -> Path:
    from tests.tools.small_posttrain import train_small_posttrain

    return train_small_posttrain(tmp_path_factory.mktemp("posttrained") / "run")


def test_the_kl_columns_show_a_grpo_stages_kl_penalty_and_a_dpo_stages_loss(posttrained):
    """examples/posttrain.toml made small: every beta is 0 (the rule in dpo and grpo stages), but the grpo
    stage's loss carries grpo.kl_beta 0.02 x its KL estimate. The table shows that weight and the mean of the
    KL its steps logged, and says the dpo stage adds none, instead of leaving the KL columns out."""
    from rewind.tools.kl_terms import kl_term

    config = config_of(posttrained)
    grpo = [e.kl for e in events_of(posttrained) if isinstance(e, StepCommitted) and e.stage == 3]
    assert grpo and all(math.isfinite(kl) for kl in grpo) and any(kl != 0 for kl in grpo)
    rows = stage_rows(read_timeline(str(posttrained)))
    assert [r["beta"] for r in rows] == [0.0] * 4
    assert [r.get("kl") for r in rows] == [None, None, *(kl_term(s)._asdict() for s in config.stages[2:])]
    assert rows[3]["kl"] == {"setting": "grpo.kl_beta", "value": 0.02, "penalty": 0.02}
    assert [r["kl_mean"] for r in rows[:3]] == [None] * 3
    assert rows[3]["kl_mean"] == pytest.approx(sum(grpo) / len(grpo))
    code, out, err = run_cli("timeline", posttrained)
    assert code == 0, err
    lines = out.splitlines()
    (header,) = [line for line in lines if line.startswith("stage ")]
    assert header.split()[6:9] == ["weight", "mean", "KL"]
    assert "KL to reference" in lines[lines.index(header) - 1]
    table = {line.split()[0]: line for line in lines[lines.index(header) + 1 :][:4]}
    assert table["2"].split()[6:9] == ["none", "(dpo)", "-"]
    assert table["3"].split()[6:9] == ["grpo.kl_beta", "0.02", f"{sum(grpo) / len(grpo):.3f}"]
    assert table["0"].split()[6:8] == ["0", "-"]


def test_bucket_helpers_reduce_long_series_exactly():
    values = np.arange(10_000, dtype=np.float64)
    values[17] = math.nan  # a skipped step
    edges = bucket_edges(len(values), max_points=100)
    assert len(edges) == 100 and edges[0] == 0 and np.all(np.diff(edges) == 100)
    means = bucket_mean(values, edges)
    assert means[1] == np.mean(values[100:200]) and means[0] == np.nanmean(values[:100])
    assert np.array_equal(bucket_edges(5, max_points=100), np.arange(5))
    smooth = rolling_mean(values[:50], window=5)
    assert smooth[30] == np.mean(values[28:33]) and smooth[0] == np.mean(values[:3])
    assert smooth[17] == np.nanmean(values[15:20])


def test_a_long_run_plots_from_buckets(straight, tmp_path):
    """50,000 synthetic steps, more than the plot has points: the min/max envelope path, NaN losses included."""
    started = read_seq_events(straight)[0][1]
    assert isinstance(started, RunStarted)
    budgets = (5_000_000, 4_000_000, 3_800_000)
    stages = [msgspec.structs.replace(s, tokens=t) for s, t in zip(started.config.stages, budgets, strict=True)]
    config = msgspec.structs.replace(started.config, stages=stages)
    schedule = Schedule(config)
    tps = schedule.tokens_per_step
    records = [(0, RunStarted(step=0, tokens=0, config=config, config_hash="h"))]
    for k in range(schedule.num_steps):
        plan = schedule.step_plan(k)
        loss = math.nan if k % 9_999 == 7 else 3.0 + math.exp(-k / 5_000)
        step = StepCommitted(
            step=k + 1,
            tokens=(k + 1) * tps,
            stage=plan.stage,
            lr=plan.lr,
            beta=plan.beta,
            loss=loss,
            rows=list(plan.rows),
        )
        records.append((len(records), step))
        if (k + 1) % 1_000 == 0:
            records.append(
                (len(records), Validated(step=k + 1, tokens=(k + 1) * tps, losses={"grammar": 3.0}))
            )
    state = msgspec.structs.replace(
        fold([records[0][1]]), step=schedule.num_steps, tokens=schedule.num_steps * tps, finished=True
    )
    started_at = time.perf_counter()
    timeline = Timeline("synthetic", with_plot=True)
    for seq, event in records:
        timeline.add(seq, event, superseded=False)
    path = plot_timeline(timeline.finish(state), tmp_path / "long.png")
    assert time.perf_counter() - started_at < 60  # seconds; drawn point by point it would take minutes
    assert_png(path)


# --- a live run ---------------------------------------------------------------------------------------


def test_state_and_timeline_of_a_run_another_process_is_training(tmp_path):
    run = tmp_path / "live"
    command = [
        sys.executable,
        "-m",
        "rewind.tools.cli",
        "train",
        str(TINY),
        "--run-dir",
        str(run),
        "--no-progress",
        "--set",
        "training.tokens=[512000,256000,256000]",
        "--set",
        "logging.report_interval=1",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 120
        num_steps = 0
        while num_steps < 3:
            assert process.poll() is None, process.stderr.read().decode()
            assert time.monotonic() < deadline, "the live run committed no steps in time"
            time.sleep(0.1)
            try:
                num_steps = sum(isinstance(e, StepCommitted) for _, e in read_seq_events(run))
            except LogNotFoundError:
                continue
        code, out, err = run_cli("state", run, "--json")
        assert code == 0, err
        shown = json.loads(out)
        assert 3 <= shown["step"] < shown["num_steps"] == 4000 and shown["status"] == "not finished"
        assert shown["next_step"]["step"] == shown["step"]
        code, out, err = run_cli("timeline", run, "--plot", tmp_path / "live.png")
        assert code == 0, err
        assert "status   not finished" in out and "not reached" in out
        assert_png(tmp_path / "live.png")
        assert process.poll() is None  # it really was read while being written
    finally:
        process.kill()
        process.wait()
        process.stderr.close()


# --- bad input ----------------------------------------------------------------------------------------


def test_timeline_of_a_missing_run(tmp_path):
    code, out, err = run_cli("timeline", tmp_path / "nothing", "--plot", tmp_path / "x.png")
    assert code == 2 and not out
    assert "no run here" in one_line(err)
    assert not (tmp_path / "x.png").exists()


def test_timeline_of_an_empty_log(tmp_path):
    with EventLog.open(tmp_path, "w"):
        pass
    code, out, err = run_cli("timeline", tmp_path)
    assert code == 1 and not out
    assert "empty" in one_line(err)
