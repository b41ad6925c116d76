"""Where tools write, and what they are given to write to: plots and exports land exactly where asked,
whole, or the command fails up front with one line (exit 2) having written nothing; a run's own files are
never a target; paths that would split a run between two places and negative step limits are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_loop import OVERRIDES, TINY, events_of, one_line, run_cli, train_args
from tests.tools.rundir_forgery import tree_state
from tests.tools.test_timeline_cmd import assert_png


@pytest.mark.parametrize("command", ["timeline", "diff"])
@pytest.mark.parametrize("target", ["/dev/full", "DIRECTORY", "RUN/events/plot.png", "RUN/checkpoints/p.png", ""])
def test_a_plot_target_that_is_not_a_file_to_write_is_refused_before_anything(straight, tmp_path, command, target):
    target = target.replace("DIRECTORY", str(tmp_path)).replace("RUN", str(straight))
    before = tree_state(straight)
    args = [command, straight, straight] if command == "diff" else [command, straight]
    code, out, err = run_cli(*args, "--plot", target)
    assert code == 2 and out == "" and one_line(err).startswith("rewind: --plot ")
    assert tree_state(straight) == before and list(tmp_path.iterdir()) == []


def test_a_plot_is_written_exactly_where_asked(straight, tmp_path):
    out = tmp_path / "picture"  # no .png: matplotlib alone would have written picture.png
    code, _, err = run_cli("timeline", straight, "--plot", out)
    assert code == 0, err
    assert_png(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["picture"]  # no temp file left either


def test_export_never_writes_over_a_runs_own_files(straight, tmp_path):
    log = Path(straight) / "events" / "00000000.log"
    before = log.read_bytes()
    code, _, err = run_cli("export", straight, "--to", log)
    assert code == 2 and "inside the run directory" in one_line(err)
    assert log.read_bytes() == before


@pytest.mark.parametrize("run_dir", ["::", "a::b", "simplecache::", "simplecache::relative/path"])
def test_a_run_dir_that_fsspec_would_read_as_a_chain_is_refused(tmp_path, monkeypatch, run_dir):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli("train", TINY, "--run-dir", run_dir, "--no-progress")
    assert code == 2 and "'::' chains fsspec URLs" in one_line(err)
    assert list(tmp_path.iterdir()) == []


def test_a_negative_step_limit_is_a_usage_error_and_creates_nothing(tmp_path):
    run = tmp_path / "run"
    code, _, err = run_cli(*train_args(run, "--max-steps", "-1"))
    assert code == 2 and "--max-steps: must be >= 0, got -1" in one_line(err)
    assert not run.exists()


def test_optimizer_resets_show_in_state_and_timeline(tmp_path):
    run = tmp_path / "run"
    sets = ("optimization.reset_optimizer_stages=[1]", "optimization.reset_restarts_lr=true")
    code, _, err = run_cli(*train_args(run, "--max-steps", "12", overrides=(*OVERRIDES, *sets)))
    assert code == 0, err
    (reset,) = [e for e in events_of(run) if type(e).__name__ == "OptimizerReset"]
    code, out, _ = run_cli("state", run)
    assert code == 0
    assert f"optimizer reset    stage 1 at step {reset.step:,} (the LR restarted there)" in out
    code, out, _ = run_cli("timeline", run)
    assert code == 0 and "optimizer reset for stage 1: moments cleared, the LR restarts its warmup" in out
