"""A grpo run under attack and at its seams: rollout files lost, cut, swapped or named by a forged record
(every command one line, nothing recorded), a process killed between writing a rollout file and recording
it or just after (the resume ends on the straight run's bits), a fork or a changed config inside a
rollout window, the same config trained twice (the same rollout files), and the stages after a growth.

Runs are tiny (64-token windows, 2 pretraining steps then 4 grpo steps in windows of 2, or the dpo /
sft equivalents) and train in-process with one torch thread, except the killed ones (a subprocess)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from rewind.states.events import RolloutsRecorded, StepCommitted
from rewind.states.history import effective
from rewind.stores.runs import read_seq_events
from tests.conftest import EXAMPLES
from tests.engine.exactness_checks import trained_beside
from tests.engine.test_loop import assert_bitwise_equal, exported_weights, one_line, run_cli
from tests.tools.rundir_forgery import rewrite_log

TINY = (EXAMPLES / "tiny.toml").read_text()
HEAD = TINY[: TINY.index("[[stages]]")].replace("block_size = 32", "block_size = 64")
HEAD = HEAD.replace("overlap = 0.5", "overlap = 0.0")
PRETRAIN = '[[stages]]\ntokens = 1024\ndatasets = [{ name = "grammar", rate = 1.0 }]\n'
MIXTURE = 'datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]'
GRPO_SETTINGS = "grpo = { group_size = 4, max_new_tokens = 8, num_iterations = 2, kl_beta = %s }"


def config_text(strategy: str, settings: str = "", growth: str = "") -> str:
    """2 pretraining steps, then 4 steps of `strategy` (steps 2..5; grpo: windows at steps 2 and 4)."""
    refresh = "refresh_reference = true\n" if strategy in ("dpo", "grpo", "distill") else ""
    stage = f'[[stages]]\nstrategy = "{strategy}"\ntokens = 2048\n{MIXTURE}\n{refresh}{settings}\n'
    return f"{HEAD}\n{PRETRAIN}\n{stage}\n{growth}"


GRPO = config_text("grpo", GRPO_SETTINGS % "0.05")
CHECKPOINTS = ("--set", "logging.checkpoint_interval=3")


def train(config: Path, run: Path, *extra: object) -> tuple[int, str, str]:
    return run_cli("train", config, "--run-dir", run, "--no-progress", *CHECKPOINTS, *extra)


def records(run: Path) -> list[bytes]:
    """The effective StepCommitted and RolloutsRecorded stream, as bytes (floats bit for bit)."""
    kept = (StepCommitted, RolloutsRecorded)
    return [msgspec.msgpack.encode(e) for _, e in effective(read_seq_events(run)) if isinstance(e, kept)]


def rollout_records(run: Path) -> list[RolloutsRecorded]:
    return [e for _, e in effective(read_seq_events(run)) if isinstance(e, RolloutsRecorded)]


def log_bytes(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "events").iterdir())}


@pytest.fixture(scope="module")
def grpo_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "grpo.toml"
    path.write_text(GRPO)
    return path


@pytest.fixture(scope="module")
def straight(grpo_config, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight") / "run"
    code, _, err = train(grpo_config, run)
    assert code == 0, err
    return run


@pytest.fixture(scope="module")
def mid_window(grpo_config, tmp_path_factory) -> Path:
    """The grpo run stopped after step 3: inside the window whose batch was sampled at step 2."""
    run = tmp_path_factory.mktemp("mid") / "run"
    code, _, err = train(grpo_config, run, "--max-steps", 3)
    assert code == 0, err
    assert [r.step for r in rollout_records(run)] == [2]
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


# --- rollout files lost, damaged, swapped; forged records ----------------------------------------------


def _delete(file: Path, other: Path) -> None:
    file.unlink()


def _truncate(file: Path, other: Path) -> None:
    file.write_bytes(file.read_bytes()[:100])


def _swap(file: Path, other: Path) -> None:  # another valid rollout batch's bytes (another hash)
    file.write_bytes(other.read_bytes())


@pytest.mark.parametrize("damage", [_delete, _truncate, _swap], ids=["deleted", "truncated", "swapped"])
def test_a_lost_or_damaged_rollout_file_is_one_line_from_every_command_and_nothing_is_recorded(
    mid_window, straight, grpo_config, tmp_path, damage
):
    run = _copy(mid_window, tmp_path)
    (record,) = rollout_records(run)
    other = next(p for p in (straight / "rollouts").iterdir() if p.name != Path(record.path).name)
    damage(run / record.path, other)
    before = log_bytes(run)
    code, out, _ = run_cli("verify", run)
    assert code == 1 and record.sha256[:12] in out and "verify: 1 problem(s)" in out
    for args in (
        ("resume", run, "--no-progress"),
        ("train", grpo_config, "--run-dir", run, "--no-progress", *CHECKPOINTS),
        ("replay", run),
        ("rollouts", run),
    ):
        code, _, err = run_cli(*args)
        line = one_line(err.replace("\r", "\n").splitlines()[-1])  # (replay's progress bar comes before)
        assert code == 1 and "Traceback" not in err and record.path in line, (args[0], err)
        assert log_bytes(run) == before, args[0]  # nothing recorded (no RunResumed either)


@pytest.mark.parametrize(
    "path",
    ["../../../etc/passwd", "rollouts/../events/00000000.log", "/etc/passwd", "rollouts/x.safetensors"],
)
def test_a_forged_rollout_path_is_refused_by_every_command_in_one_line(mid_window, tmp_path, path):
    run = _copy(mid_window, tmp_path)
    rewrite_log(
        run, lambda _, e: msgspec.structs.replace(e, path=path) if isinstance(e, RolloutsRecorded) else e
    )
    before = log_bytes(run)
    for args in (
        ("verify", run),
        ("resume", run, "--no-progress"),
        ("rollouts", run),
        ("replay", run),
        ("state", run),
        ("log", run),
        ("diff", run, mid_window),
    ):
        code, out, err = run_cli(*args)
        assert code == 1 and "Traceback" not in err, (args[0], err)
        said = out if args[0] == "verify" else err
        assert "is not one rewind writes" in said, (args[0], out, err)
    assert log_bytes(run) == before


def test_a_rollout_file_linked_out_of_the_run_is_refused(mid_window, tmp_path):
    run = _copy(mid_window, tmp_path)
    (record,) = rollout_records(run)
    outside = tmp_path / "outside.safetensors"
    shutil.move(run / record.path, outside)  # the right bytes, but outside the run
    (run / record.path).symlink_to(outside)
    before = log_bytes(run)
    code, out, _ = run_cli("verify", run)
    assert code == 1 and "leads outside the run directory" in out
    code, _, err = run_cli("resume", run, "--no-progress")
    assert code == 1 and "leads outside the run directory" in one_line(err)
    assert log_bytes(run) == before


# --- killed between the rollout file and its record, or just after ---------------------------------------

# A `rewind` process that SIGKILLs itself at the rollout batch of step 4 (the second window): after the
# file is written and before RolloutsRecorded is recorded ("before"), or once the record is committed
# ("after"): what a kill at that moment leaves.
LAUNCHER = """
import os, signal, sys
from rewind.engine.posttrain import grpo_kind
from rewind.engine.run import loop
from rewind.states.events import RolloutsRecorded
moment, target = sys.argv[1], 4
sample, record = grpo_kind.sample_rollouts, loop.record
def sample_then_die(parts, state, stage, keep=True):
    event = sample(parts, state, stage, keep=keep)
    if moment == "before" and state.step == target:
        os.kill(os.getpid(), signal.SIGKILL)
    return event
def record_then_die(run, state, event):
    state = record(run, state, event)
    if moment == "after" and isinstance(event, RolloutsRecorded) and event.step == target:
        run.journal.commit()
        os.kill(os.getpid(), signal.SIGKILL)
    return state
grpo_kind.sample_rollouts, loop.record = sample_then_die, record_then_die
from rewind.tools.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _command(config: Path, run: Path, *launcher_args: str) -> list[str]:
    prefix = ["-c", LAUNCHER, *launcher_args] if launcher_args else ["-m", "rewind.tools.cli"]
    return [
        sys.executable,
        *prefix,
        "train",
        str(config),
        "--run-dir",
        str(run),
        "--no-progress",
        *CHECKPOINTS,
    ]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")


@pytest.mark.parametrize("checkpoint_interval", [2, 3])  # a checkpoint at the window's start, or before it
@pytest.mark.parametrize("moment", ["before", "after"])
def test_a_kill_at_the_rollout_record_resumes_to_the_straight_runs_bits(
    grpo_config, tmp_path, moment, checkpoint_interval
):
    sets = ["--set", f"logging.checkpoint_interval={checkpoint_interval}"]
    straight_run, killed = tmp_path / "straight", tmp_path / "killed"
    with trained_beside([*_command(grpo_config, straight_run), *sets], env=_env()):
        dead = subprocess.run(
            [*_command(grpo_config, killed, moment), *sets],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert dead.returncode == -signal.SIGKILL, dead.stderr
        files = {p.name for p in (killed / "rollouts").iterdir()}
        assert len(files) == 2  # the second window's file is on disk: the kill came after it was written
        recorded = [r.step for _, r in read_seq_events(killed) if isinstance(r, RolloutsRecorded)]
        assert recorded == ([2] if moment == "before" else [2, 4])
        again = subprocess.run(
            [*_command(grpo_config, killed), *sets], env=_env(), capture_output=True, text=True, timeout=120
        )
        assert again.returncode == 0, again.stderr
    assert records(killed) == records(straight_run)
    assert {p.name for p in (killed / "rollouts").iterdir()} == files  # sampled again: the same file
    assert_bitwise_equal(
        exported_weights(straight_run, tmp_path / "a.st"), exported_weights(killed, tmp_path / "b.st")
    )


# --- determinism ------------------------------------------------------------------------------------------


def test_the_same_grpo_config_trained_twice_writes_the_same_rollout_files(grpo_config, straight, tmp_path):
    code, _, err = train(grpo_config, tmp_path / "again")
    assert code == 0, err
    names = sorted(p.name for p in (straight / "rollouts").iterdir())
    assert len(names) == 2 and sorted(p.name for p in (tmp_path / "again" / "rollouts").iterdir()) == names
    assert records(tmp_path / "again") == records(straight)


# --- forks and changed configs inside a rollout window ----------------------------------------------------


def test_an_unchanged_fork_inside_a_rollout_window_goes_on_as_its_parent(straight, tmp_path):
    child = tmp_path / "child"
    # checkpoint 3 is inside the window sampled at step 2
    code, _, err = run_cli("fork", straight, child, "--at-step", 3, "--no-progress")
    assert code == 0, err
    code, out, _ = run_cli("verify", child)
    assert code == 0, out
    parent_tail = [r.path for r in rollout_records(straight) if r.step > 3]
    assert [r.path for r in rollout_records(child)] == parent_tail  # the parent sampled next at step 4
    assert_bitwise_equal(
        exported_weights(straight, tmp_path / "a.st"), exported_weights(child, tmp_path / "b.st")
    )


def test_a_fork_that_turns_the_kl_term_on_mid_window_trains_on_or_refuses_in_one_line(tmp_path):
    config = tmp_path / "grpo.toml"
    config.write_text(GRPO)
    run = tmp_path / "run"
    code, _, err = train(config, run, "--max-steps", 3, "--set", "stages[1].grpo.kl_beta=0")
    assert code == 0, err
    before = log_bytes(run)
    code, _, err = train(config, run, "--fork")  # kl_beta 0 -> 0.05 inside the window sampled at step 2
    assert "Traceback" not in err
    if code != 0:  # refused: one line, and the log as it was
        one_line(err)
        assert log_bytes(run) == before
    else:  # or trained on, the window's batch with the reference log-probs the new config needs
        assert run_cli("verify", run)[0] == 0


def test_a_fork_that_changes_the_temperature_mid_window_never_mixes_two_temperatures(tmp_path):
    config = tmp_path / "grpo.toml"
    config.write_text(GRPO)
    run = tmp_path / "run"
    # lr 1e-30: no weight moves, so the policy stays the reference entered at step 2 (KL exactly 0)
    still = ("--set", "optimization.lr=1e-30")
    code, _, err = train(config, run, "--max-steps", 3, *still)
    assert code == 0, err
    assert all(
        e.metrics["kl"] == 0.0 for _, e in read_seq_events(run) if isinstance(e, StepCommitted) and e.stage
    )
    code, _, err = train(config, run, "--fork", *still, "--set", "stages[1].grpo.temperature=0.5")
    assert code == 0, err
    after = [e for _, e in effective(read_seq_events(run)) if isinstance(e, StepCommitted) and e.step > 3]
    # resampled at the new temperature, or the batch's own temperature kept: either way policy = reference
    assert [e.metrics["kl"] for e in after] == [0.0] * len(after)


def test_a_fork_that_changes_the_window_length_mid_window_keeps_the_held_batch(
    mid_window, grpo_config, tmp_path
):
    run = _copy(mid_window, tmp_path)
    code, _, err = train(grpo_config, run, "--fork", "--set", "stages[1].grpo.num_iterations=3")
    assert code == 0, err
    # windows counted from the stage's entry: 2 (the held batch, 3 updates now) and 5
    assert [r.step for r in rollout_records(run)] == [2, 5]
    assert run_cli("verify", run)[0] == 0


# --- the other strategies at the seams: growth, the trunk cache --------------------------------------------

GROWTH = "[[growth]]\nat_stage = 1\nnum_blocks = 1\n"


@pytest.mark.parametrize(
    ("strategy", "settings"),
    [("sft", "sft = { packing = true }"), ("sft", ""), ("dpo", ""), ("grpo", GRPO_SETTINGS % "0.05")],
    ids=["packed-sft", "sft", "dpo", "grpo"],
)
def test_a_post_training_stage_at_a_growth_trains_the_same_bits_with_or_without_the_trunk_cache(
    tmp_path, strategy, settings
):
    config = tmp_path / "grown.toml"
    config.write_text(config_text(strategy, settings, GROWTH))
    exports = {}
    for cache in ("auto", "off"):
        run = tmp_path / cache
        code, _, err = train(config, run, "--set", f"growth[0].cache={cache}")
        assert code == 0, err
        exports[cache] = exported_weights(run, tmp_path / f"{cache}.st")
        cached = [e for _, e in read_seq_events(run) if type(e).__name__ == "ActivationsCached"]
        # only an unpacked sft stage reads the frozen trunk from the cache (packed rows are not whole rows)
        assert len(cached) == (1 if (cache, strategy, settings) == ("auto", "sft", "") else 0)
        if strategy == "dpo":  # the reference refreshed after the growth: the grown model itself
            first = next(e for _, e in read_seq_events(run) if isinstance(e, StepCommitted) and e.stage == 1)
            assert (
                first.loss == pytest.approx(0.6931471805599453, abs=1e-6) and first.metrics["margin"] == 0.0
            )
    assert_bitwise_equal(exports["auto"], exports["off"])


# --- the commands on a run of each strategy ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "settings"),
    [
        ("sft", "sft = { packing = true }"),
        ("dpo", "dpo = { sft_weight = 0.1 }"),
        ("grpo", GRPO_SETTINGS % "0.05"),
        ("distill", 'distill = { group_size = 2, max_new_tokens = 6, num_iterations = 2 }'),
    ],
)
def test_every_reading_command_works_on_a_run_of_each_strategy(tmp_path, strategy, settings):
    config = tmp_path / "run.toml"
    config.write_text(config_text(strategy, settings))
    run = tmp_path / "run"
    code, _, err = train(config, run)
    assert code == 0, err
    for args in (("log", run), ("state", run), ("timeline", run, "--json"), ("timeline", run, "--plot",
                 tmp_path / "t.png"), ("diff", run, run), ("verify", run), ("replay", run),
                 ("export", run, "--hf", tmp_path / "hf")):  # fmt: skip
        code, out, err = run_cli(*args)
        assert code == 0 and "Traceback" not in err, (args[0], err)
        said = {"verify": "verify: clean", "replay": "replay: reproducible", "diff": "no divergence"}
        assert said.get(args[0], "") in out, (args[0], out)
    assert (tmp_path / "t.png").stat().st_size > 0 and (tmp_path / "hf" / "model.safetensors").exists()
    metrics = [e.metrics for _, e in read_seq_events(run) if isinstance(e, StepCommitted) and e.stage == 1]
    assert all(metrics) if strategy != "sft" else not any(metrics)
    code, _, err = run_cli("rollouts", run, "--json")
    assert (
        (code == 0) if strategy in ("grpo", "distill") else (code == 1 and "no rollout batch on record" in one_line(err))
    )
