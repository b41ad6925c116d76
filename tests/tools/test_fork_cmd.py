"""`rewind fork`: a new run from a run's checkpoint at or before a step, under an unchanged or changed
config. An unchanged fork must end bit for bit where its parent ended; a changed one must say what
changed; the parent is never written to; a fork resumes exactly like any run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rewind.states.events import ConfigChanged, RunResumed, RunStarted, StepCommitted
from rewind.states.fold import fold
from rewind.states.history import config_in_force, effective
from rewind.states.schedule import Schedule
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import (
    OVERRIDES,
    assert_bitwise_equal,
    effective_steps,
    events_of,
    exported_weights,
    one_line,
    run_cli,
    train_args,
)
from tests.tools.test_train_cmd import segment_bytes

# The straight run's checkpoints: 4 and 8 (interval, deleted by retention), 11 (boundary, and the
# reference of stage 1), 12 (interval, deleted), 16 (boundary), 20 (final).
BOUNDARY_STEP = 11


def fork_args(parent: Path, child: Path, at_step: int, *extra: str) -> list[str]:
    return ["fork", str(parent), str(child), "--at-step", str(at_step), "--no-progress", *extra]


@pytest.fixture(scope="module")
def unchanged_fork(straight, tmp_path_factory) -> tuple[Path, tuple[int, str, str]]:
    child = tmp_path_factory.mktemp("fork") / "child"
    return child, run_cli(*fork_args(straight, child, 13))


def test_an_unchanged_fork_ends_bit_for_bit_where_its_parent_ended(unchanged_fork, straight, tmp_path):
    child, (code, out, err) = unchanged_fork
    assert code == 0, err
    assert "run finished" in out
    # 12 was deleted by retention, so the fork starts at the boundary checkpoint of step 11, and says so.
    assert f"(step {BOUNDARY_STEP})" in err and "no intact checkpoint at step 13" in err
    assert_bitwise_equal(
        exported_weights(straight, tmp_path / "parent.safetensors"),
        exported_weights(child, tmp_path / "child.safetensors"),
    )
    parent_steps = [s for s, e in zip(effective_steps(straight), _steps(straight), strict=True) if e > BOUNDARY_STEP]
    assert effective_steps(child) == parent_steps


def _steps(run: Path) -> list[int]:
    return [e.step for _, e in effective(read_seq_events(run)) if isinstance(e, StepCommitted)]


def test_the_fork_records_its_parent_and_starts_from_the_parents_state(unchanged_fork, straight):
    child, _ = unchanged_fork
    events = events_of(child)
    started, resumed = events[0], events[1]
    assert isinstance(started, RunStarted) and isinstance(resumed, RunResumed)
    parent_state = fold(events_of(straight))
    assert started.parent is not None
    assert started.parent.run == str(straight.resolve())
    assert started.parent.step == BOUNDARY_STEP == resumed.step
    assert started.parent.checkpoint == resumed.checkpoint
    assert started.parent.config_hash == parent_state.config_hash == started.config_hash
    assert not any(isinstance(e, ConfigChanged) for e in events)  # nothing changed, nothing to record
    # The parent's state at the fork travels as a seed (the child's log cannot derive it), holding the
    # checkpoints the child copied and nothing of the parent's own history of resumes.
    parent_events = [e for _, e in read_seq_events(straight)]
    at_fork = next(e for e in parent_events if isinstance(e, StepCommitted) and e.step == resumed.step)
    assert resumed.seed is not None and resumed.seed.cursors == at_fork.cursors
    assert {c.checkpoint for c in resumed.seed.live_checkpoints} == {resumed.checkpoint}
    child_state = fold(events)
    assert child_state.parent_run == str(straight.resolve()) and len(child_state.resumes) == 1
    assert fold(events).parent_run == str(straight.resolve())
    code, out, err = run_cli("verify", child)
    assert code == 0, out + err


def test_forking_never_writes_to_the_parent(straight, tmp_path):
    before = segment_bytes(straight)
    checkpoints = sorted(p.name for p in (straight / "checkpoints").iterdir())
    code, _, err = run_cli(*fork_args(straight, tmp_path / "child", 16, "--max-steps", "1"))
    assert code == 0, err
    assert segment_bytes(straight) == before
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == checkpoints


def test_a_changed_fork_records_the_change_and_trains_under_it(straight, tmp_path):
    child = tmp_path / "child"
    code, _, err = run_cli(*fork_args(straight, child, 16, "--set", "optimization.lr=1e-3"))
    assert code == 0, err
    assert "optimization.lr: 0.003 -> 0.001" in err
    records = read_seq_events(child)
    events = [e for _, e in records]
    assert [type(e).__name__ for e in events[:3]] == ["RunStarted", "RunResumed", "ConfigChanged"]
    assert events[0].config.optimization.lr == 1e-3 and events[2].config == events[0].config
    assert config_in_force(records).optimization.lr == 1e-3
    schedule = Schedule(events[0].config)
    later = [e for e in events if isinstance(e, StepCommitted)]
    assert [e.step for e in later] == list(range(17, 21))
    assert all(e.lr == schedule.lr(e.step - 1) for e in later)
    assert fold(events).finished


def test_a_fork_stopped_and_resumed_matches_the_fork_run_straight(straight, tmp_path):
    change = ("--set", "run.seed=99")
    straight_fork, stopped_fork = tmp_path / "straight-fork", tmp_path / "stopped-fork"
    assert run_cli(*fork_args(straight, straight_fork, BOUNDARY_STEP, *change))[0] == 0
    code, _, err = run_cli(*fork_args(straight, stopped_fork, BOUNDARY_STEP, *change, "--max-steps", "3"))
    assert code == 0, err
    code, _, err = run_cli("resume", stopped_fork, "--no-progress")
    assert code == 0, err
    assert_bitwise_equal(
        exported_weights(straight_fork, tmp_path / "a.safetensors"),
        exported_weights(stopped_fork, tmp_path / "b.safetensors"),
    )
    assert effective_steps(stopped_fork) == effective_steps(straight_fork)
    assert effective_steps(straight_fork) != effective_steps(straight)[BOUNDARY_STEP:]  # the seed mattered


def test_a_fork_of_a_fork_starts_from_the_checkpoint_the_first_fork_copied(unchanged_fork, straight, tmp_path):
    child, _ = unchanged_fork
    grandchild = tmp_path / "grandchild"
    code, _, err = run_cli(*fork_args(child, grandchild, 12))
    assert code == 0, err
    resumed = events_of(grandchild)[1]
    assert isinstance(resumed, RunResumed) and resumed.step == BOUNDARY_STEP
    assert effective_steps(grandchild) == effective_steps(child)


def test_forking_at_step_zero_or_before_any_checkpoint_starts_a_fresh_run_with_a_parent(straight, tmp_path):
    child = tmp_path / "child"
    code, _, err = run_cli(*fork_args(straight, child, 2, "--max-steps", "2"))
    assert code == 0, err
    events = events_of(child)
    assert events[0].parent is not None and events[0].parent.step == 0 and events[0].parent.checkpoint == ""
    assert not any(isinstance(e, RunResumed) for e in events)
    assert effective_steps(child) == effective_steps(straight)[:2]


def test_an_in_place_fork_survives_a_crash_before_its_first_checkpoint(straight, tmp_path):
    """The config change belongs to the resume it follows: a process that dies before writing a new
    checkpoint must not silently bring the old config back."""
    run = tmp_path / "run"
    assert run_cli(*train_args(run, "--max-steps", "6"))[0] == 0
    changed = (*OVERRIDES, "optimization.lr=1e-3")
    code, _, err = run_cli(*train_args(run, "--fork", "--max-steps", "0", overrides=changed))
    assert code == 0, err
    code, _, err = run_cli("resume", run, "--no-progress")
    assert code == 0, err
    records = read_seq_events(run)
    assert config_in_force(records).optimization.lr == 1e-3
    schedule = Schedule(config_in_force(records))
    later = [e for _, e in effective(records) if isinstance(e, StepCommitted) and e.step > 6]
    assert [e.step for e in later] == list(range(7, 21))
    assert all(e.lr == schedule.lr(e.step - 1) for e in later)


# --- bad input --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "at_step, extra, needles",
    [
        (-1, (), ("--at-step -1",)),
        (21, (), ("--at-step 21", "reached step 20")),
        (12, ("--set", "training.batch_size=16"), ("tokens per step",)),
        (12, ("--set", "optimization.nope=1"), ("optimization.nope",)),
        (12, ("--config", "/nonexistent/x.toml"), ("no such config file",)),
    ],
)
def test_bad_forks_exit_2_with_one_line_and_create_nothing(straight, tmp_path, at_step, extra, needles):
    child = tmp_path / "child"
    code, _, err = run_cli(*fork_args(straight, child, at_step, *extra))
    assert code == 2, err
    assert "Traceback" not in err
    line = one_line(err)
    assert all(needle in line for needle in needles), line
    assert not child.exists()


def test_fork_into_an_existing_run_is_refused(straight, tmp_path):
    child = tmp_path / "child"
    shutil.copytree(straight, child)
    before = segment_bytes(child)
    code, _, err = run_cli(*fork_args(straight, child, 12))
    assert code == 2 and "already holds a run" in one_line(err)
    assert segment_bytes(child) == before


def test_fork_of_a_directory_without_a_run(tmp_path):
    code, _, err = run_cli(*fork_args(tmp_path / "nothing", tmp_path / "child", 3))
    assert code == 2 and "no run here" in one_line(err)


# --- found in review ----------------------------------------------------------------------------------


def test_a_fork_after_an_in_place_config_change_starts_under_the_changed_config(tmp_path):
    parent, child = tmp_path / "parent", tmp_path / "child"
    keep = (*OVERRIDES[:-1], "logging.keep_last_checkpoints=3")
    assert run_cli(*train_args(parent, "--max-steps", "6", overrides=keep))[0] == 0
    changed = (*keep, "optimization.lr=1e-3")
    assert run_cli(*train_args(parent, "--fork", "--max-steps", "2", overrides=changed))[0] == 0
    code, _, err = run_cli(*fork_args(parent, child, 7, "--max-steps", "2"))  # anchored on the resume at 6
    assert code == 0, err
    events = events_of(child)
    assert events[0].config.optimization.lr == 1e-3
    assert not any(isinstance(e, ConfigChanged) for e in events)  # nothing changed: nothing recorded
    assert events[0].parent.config_hash == events[0].config_hash
    parent_steps = dict(zip(_steps(parent), effective_steps(parent), strict=True))
    child_steps = dict(zip(_steps(child), effective_steps(child), strict=True))
    assert child_steps and all(child_steps[s] == parent_steps[s] for s in child_steps)


def test_a_finished_run_forked_into_a_longer_one_evaluates_its_new_end(straight, tmp_path):
    child = tmp_path / "child"
    code, out, err = run_cli(*fork_args(straight, child, 20, "--set", "training.tokens=[2560,1280,2560]"))
    assert code == 0, err
    evaluated = [e for e in events_of(child) if type(e).__name__ == "Evaluated"]
    # Its new end only: no baseline of the weights it inherits (its parent evaluated them; a fork that
    # evaluated them again would differ from its parent at its very first record).
    assert [(e.step, e.boundary) for e in evaluated] == [(25, 2)]
    assert "answer-token accuracy" in out


@pytest.fixture(scope="module")
def stopped_at_7(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("stopped") / "run"
    assert run_cli(*train_args(run, "--max-steps", "7"))[0] == 0
    return run


@pytest.mark.parametrize("change", ["architecture.d_model=64", "architecture.num_layers=3", 'architecture.norm="layernorm"'])
def test_a_change_of_weight_shapes_is_refused_before_anything_is_written(straight, stopped_at_7, tmp_path, change):
    child = tmp_path / "child"
    code, _, err = run_cli(*fork_args(straight, child, 16, "--set", change))
    assert code == 2 and "cannot change when continuing from a checkpoint" in one_line(err)
    assert not child.exists()
    before = segment_bytes(stopped_at_7)
    code, _, err = run_cli(*train_args(stopped_at_7, "--fork", overrides=(*OVERRIDES, change)))
    assert code == 2 and "cannot change when continuing from a checkpoint" in one_line(err)
    assert segment_bytes(stopped_at_7) == before


def test_dropout_may_change_in_a_fork(straight, tmp_path):
    code, _, err = run_cli(*fork_args(straight, tmp_path / "child", 16, "--set", "architecture.dropout=0.1"))
    assert code == 0, err


def test_a_fork_cannot_be_forked_before_its_own_fork_point(unchanged_fork, tmp_path):
    child, _ = unchanged_fork
    code, _, err = run_cli(*fork_args(child, tmp_path / "grandchild", 3))
    assert code == 2
    assert "is a fork of" in one_line(err) and "fork its parent instead" in err
    assert not (tmp_path / "grandchild").exists()


def test_a_fork_with_a_config_elsewhere_finds_the_reward_module_beside_it(tmp_path, monkeypatch, request):
    """`rewind fork --config FILE` looks for a grpo stage's reward module beside FILE first, as `rewind train
    FILE` does, not only in the working directory: a fork run from elsewhere finds it and scores with it."""
    import hashlib

    from rewind.states.events import RolloutsRecorded
    from tests.engine.test_rewards import MODULE, grpo_config, unique

    name = unique(request, "forked")
    (tmp_path / "sub").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "parent.toml").write_text(grpo_config("exact_match"))
    parent = tmp_path / "parent"
    code, _, err = run_cli("train", tmp_path / "parent.toml", "--run-dir", parent, "--max-steps=1")
    assert code == 0, err
    source = tmp_path / "sub" / f"{name}.py"
    source.write_text(MODULE)
    (tmp_path / "sub" / "post.toml").write_text(grpo_config(f"{name}:by_length"))
    monkeypatch.chdir(tmp_path / "elsewhere")
    elsewhere = ["--config", "../sub/post.toml", "--max-steps=4"]
    code, _, err = run_cli(*fork_args(parent, Path("child"), 0, *elsewhere))
    assert code == 0, err
    child = tmp_path / "elsewhere" / "child"
    records = [e for _, e in read_seq_events(child) if isinstance(e, RolloutsRecorded)]
    identity = "sha256:" + hashlib.sha256(source.read_bytes()).hexdigest() + ";version=1.0"
    assert records and all(r.reward_code == {f"{name}:by_length": identity} for r in records)
