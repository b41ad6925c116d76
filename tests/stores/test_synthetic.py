"""The synthetic run generator writes legal logs: they fold, and the seeking readers see in them the
same superseded ranges and effective records as a full read through rewind.states.history."""

from __future__ import annotations

import pytest

from rewind.states.events import CheckpointCommitted, CheckpointDeleted, RunResumed, StepCommitted
from rewind.states.fold import fold
from rewind.states.history import effective, restore_point, superseded_ranges
from rewind.stores.eventlog import EventLog, verify_log
from rewind.stores.runs import read_seq_events
from rewind.stores.synthetic import KEEP_CHECKPOINTS, write_synthetic_run


@pytest.mark.parametrize(
    ("num_steps", "num_resumes", "checkpoint_every", "report_interval"),
    [(300, 4, 40, 7), (50, 3, 100, 5), (6, 5, 2, 1), (120, 0, 25, 10)],
    ids=["checkpointed", "before-any-checkpoint", "crowded", "no-resumes"],
)
def test_a_synthetic_run_folds_and_reads_the_same_seeking_or_not(
    tmp_path, no_syncs, num_steps, num_resumes, checkpoint_every, report_interval
):
    run = tmp_path / "run"
    info = write_synthetic_run(
        run, num_steps, num_resumes, checkpoint_every, report_interval, segment_bytes=900
    )
    records = read_seq_events(run)
    events = [e for _, e in records]
    state = fold(events)  # every record, the superseded ones too
    assert (state.step, state.tokens) == (num_steps, num_steps * state.tokens_per_step)
    assert not state.finished and len(state.resumes) == num_resumes
    assert info["num_records"] == len(records) and info["step"] == num_steps
    assert [c.checkpoint for c in state.live_checkpoints] == info["live_checkpoints"]
    assert len(info["live_checkpoints"]) == min(KEEP_CHECKPOINTS, num_steps // checkpoint_every)
    assert fold(e for _, e in effective(records)).step == num_steps  # the effective stream folds too
    if info["live_checkpoints"]:
        assert restore_point(records).checkpoint == info["last_checkpoint"]

    ranges = superseded_ranges(records)
    assert len(ranges) == num_resumes and ranges == info["superseded"]
    kept = effective(records)
    steps = [e.step for _, e in kept]
    assert steps == sorted(steps)  # along the effective records the step never decreases
    with EventLog.open(run) as log:
        assert len(log.segment_summaries()) > 3
        assert log.superseded_ranges() == ranges
        for low, high in [(0, num_steps), (num_steps // 2, num_steps // 2 + 2), (1, 1), (num_steps, 10**9)]:
            seeking = [(r.seq, r.event) for r in log.records_in_steps(low, high, effective=True)]
            assert seeking == [(s, e) for s, e in kept if low <= e.step <= high]
    assert verify_log(run).ok


def test_resumes_are_spread_evenly_and_supersede_steps_past_the_checkpoint(tmp_path, no_syncs):
    run = tmp_path / "run"
    write_synthetic_run(run, 1000, 3, checkpoint_every=100, report_interval=10)
    records = read_seq_events(run)
    resumes = [(s, e) for s, e in records if isinstance(e, RunResumed)]
    assert [e.step for _, e in resumes] == [200, 500, 700]  # the last checkpoint before 250, 500, 750
    by_seq = dict(records)
    for seq, resume in resumes:
        first, last = resume.superseded_first_seq, resume.superseded_last_seq
        assert last == seq - 1 and last >= first
        assert all(isinstance(by_seq[s], StepCommitted) for s in range(first, last + 1))
        anchor = by_seq[first - 1]  # the checkpoint, or the retention deletion right after it
        assert isinstance(anchor, CheckpointCommitted | CheckpointDeleted) and anchor.step == resume.step
        assert by_seq[seq + 1].step == resume.step + 1  # the run goes on from the checkpoint


def test_the_arguments_are_checked_and_an_existing_log_is_not_appended_to(tmp_path, no_syncs):
    with pytest.raises(ValueError, match="num_steps"):
        write_synthetic_run(tmp_path / "a", 0)
    write_synthetic_run(tmp_path / "b", 5, checkpoint_every=2)
    with pytest.raises(ValueError, match="already holds a log"):
        write_synthetic_run(tmp_path / "b", 5)
