"""The product's promise: kill a run at any moment, resume it, and get the same weights, bit for bit.

A run is trained straight through once; the same run is trained again in processes SIGKILLed at
moments drawn over the whole run (mid-step, mid-commit, mid-checkpoint, and once with committed steps
past the last checkpoint) and resumed each time. The final weights and the effective StepCommitted
stream must be bitwise identical, every resume must restart from the last checkpoint committed before
its kill and supersede exactly what came after it, and every superseded step must come out the same
when recomputed. The harness is tests/engine/exactness.py; test_breakages.py proves it catches three
deliberate engine bugs.
"""

from __future__ import annotations

import pytest

from rewind.states.events import (
    CheckpointCommitted,
    FadeEnded,
    FadeStarted,
    ReferenceRefreshed,
    RunResumed,
    RunStarted,
    StepCommitted,
)
from rewind.states.fold import fold
from rewind.stores.checkpoints import CheckpointStore
from rewind.stores.runs import read_seq_events
from tests.engine.exactness import (
    CI_SCHEDULE,
    NUM_STEPS,
    REPORT_INTERVAL,
    kill_schedule,
    shared_killed,
    shared_straight,
    train_killed,
)
from tests.engine.exactness_checks import check, committed, superseded_seqs


def test_the_run_has_what_a_resume_must_restore(tmp_path_factory):
    _, straight = shared_straight(tmp_path_factory)
    events = [e for _, e in read_seq_events(straight.run_dir)]
    config = events[0].config
    assert isinstance(events[0], RunStarted)
    assert config.architecture.dropout > 0
    assert 0 < config.training.per_device_batch_size < config.training.batch_size  # micro-batches
    assert sum(isinstance(e, StepCommitted) for e in events) == NUM_STEPS
    assert {e.boundary for e in events if isinstance(e, FadeStarted)} == {0, 1}
    assert {e.boundary for e in events if isinstance(e, FadeEnded)} == {0, 1}
    assert [e.stage for e in events if isinstance(e, ReferenceRefreshed)] == [1, 2]
    assert any(e.beta > 0 and e.kl > 0 for e in events if isinstance(e, StepCommitted))
    # Some checkpoints fall between group commits: killed there, committed steps outlive the checkpoint.
    assert any(e.step % REPORT_INTERVAL for e in events if isinstance(e, CheckpointCommitted))


def test_kill_schedule_covers_the_whole_run():
    for seed in range(20):
        schedule = kill_schedule(seed, 4)
        steps = [kill.step for kill in schedule]
        assert steps == sorted(steps)
        assert steps[0] <= NUM_STEPS // 4 and steps[-1] > 3 * NUM_STEPS // 4  # early and late
        assert [kill.mode for kill in schedule].count("past-checkpoint") == 1
    assert len({tuple(kill_schedule(seed, 4)) for seed in range(20)}) > 1  # and random


def test_sigkill_over_the_whole_run_then_resume_gives_identical_weights(tmp_path_factory):
    killed, problems = shared_killed(tmp_path_factory)
    assert problems == {}
    assert killed.num_kills >= len(CI_SCHEDULE) - 1, "the run was not actually interrupted"
    records = read_seq_events(killed.run_dir)
    # Every RunResumed in the log was checked against the log its process found.
    resumed = [seq for seq, e in records if isinstance(e, RunResumed)]
    assert resumed == [appended[0][0] for _, appended in killed.resumes if appended]
    assert len(resumed) >= len(CI_SCHEDULE) - 1
    # Resumes restored real checkpoints, and at least one superseded committed steps.
    assert all(e.checkpoint for _, e in records if isinstance(e, RunResumed))
    assert any(e.superseded_last_seq >= e.superseded_first_seq for _, e in records if isinstance(e, RunResumed))
    # Every resume removed the debris of the process it replaced: no checkpoint directory is unnamed.
    live = fold(e for _, e in records).live_checkpoints
    assert CheckpointStore(str(killed.run_dir)).orphans(c.checkpoint for c in live) == []
    # The same state, the same names: the checkpoints the resumed processes wrote (the final one, the KL
    # references) are named as the straight run's, though they were written at other log positions.
    _, straight = shared_straight(tmp_path_factory)
    want = fold(e for _, e in read_seq_events(straight.run_dir)).live_checkpoints
    named = [[(c.checkpoint, c.manifest_sha256) for c in checkpoints] for checkpoints in (want, live)]
    assert named[0] == named[1]


@pytest.mark.slow
def test_many_kills_then_replay_is_reproducible(tmp_path_factory):
    server, straight = shared_straight(tmp_path_factory)
    run_dir = tmp_path_factory.mktemp("exact") / "many-kills"
    schedule = kill_schedule(7, 8)
    killed = train_killed(server, run_dir, schedule, straight.seconds_per_step, seed=7)
    assert check(server, straight, killed) == {}
    assert killed.num_kills >= len(schedule) - 1
    assert superseded_seqs(committed(run_dir))
    # And the whole run, crashes and superseded records included, replays bit for bit.
    code, output = server.run("rewind", ["replay", str(run_dir), "--no-progress"])
    assert code == 0, output
    assert output.strip().endswith("replay: reproducible")
