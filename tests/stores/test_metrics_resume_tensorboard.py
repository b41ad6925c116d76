"""Resuming the metrics projection as TensorBoard sees it: the resumed writer opens with a purge marker
that hides what the dead process drew from the cut's step on, and resume + catch-up gives the same
metrics.jsonl bytes and the same loaded scalars as a rebuild, wherever a crash stopped the JSONL.

TensorBoard's own loader (EventAccumulator, purge_orphaned_data=True by default) reads the files, so the
tests check what a person sees, not only that a marker was written."""

from __future__ import annotations

import math
import os
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto import event_pb2

from rewind.states.events import CheckpointCommitted, StageEntered, Validated
from rewind.stores.metrics import JSONL_NAME, TB_DIR_NAME, MetricsProjection, rebuild
from tests.stores.test_metrics import bit_patterns, jsonl_records, live, scalars, step_event
from tests.stores.test_metrics_resume import checkpoint, history, seq_of, validation


def backdate_event_files(run_dir, seconds: int = 3600) -> None:
    """As if the dead process had written its event files an hour ago. In one test process the resume
    comes within the same second, and the projection would wait for the next one so that its own event
    file sorts after theirs (TensorBoard reads them in name order; the name starts with the second)."""
    tb_dir = os.path.join(run_dir, TB_DIR_NAME)
    for name in os.listdir(tb_dir):
        fields = name.split(".")
        fields[3] = f"{int(fields[3]) - seconds:010d}"
        os.rename(os.path.join(tb_dir, name), os.path.join(tb_dir, ".".join(fields)))


def resume_and_catch_up(run_dir, dead: list, through_seq: int, next_step: int, continuation: list) -> int:
    """What the engine does: resume, project the records the crash kept out, then the new ones."""
    with MetricsProjection(run_dir) as projection:
        kept = projection.resume(through_seq, next_step)
        assert kept is not None
        for seq, event in dead:
            if kept < seq <= through_seq:
                projection.observe(seq, event)
        for seq, event in continuation:
            projection.observe(seq, event)
    return kept


def event_files(run_dir) -> list[str]:
    tb_dir = os.path.join(run_dir, TB_DIR_NAME)
    return [os.path.join(tb_dir, name) for name in sorted(os.listdir(tb_dir))]


def purge_markers(path: str) -> list[tuple[int, int]]:
    return [(e.step, e.session_log.status) for e in EventFileLoader(path).Load() if e.HasField("session_log")]


def visible(run_dir) -> dict:
    """The scalars TensorBoard shows, as bit patterns; a tag whose points were all purged shows nothing."""
    if not os.path.isdir(os.path.join(run_dir, TB_DIR_NAME)):
        return {}
    return {tag: points for tag, points in bit_patterns(scalars(run_dir)).items() if points}


def jsonl_or_nothing(run_dir) -> bytes:
    path = os.path.join(run_dir, JSONL_NAME)
    if not os.path.exists(path):
        return b""
    with open(path, "rb") as handle:
        return handle.read()


def continuation_from(dead: list, steps: range, loss_offset: float) -> list:
    first_seq = dead[-1][0] + 2  # dead[-1][0] + 1 is the RunResumed record
    return [(first_seq + i, step_event(step, step + loss_offset)) for i, step in enumerate(steps)]


def test_points_from_the_restart_step_on_are_hidden_not_deleted(tmp_path):
    dead = history(10)
    live(tmp_path, dead)
    backdate_event_files(tmp_path)
    (old_file,) = event_files(tmp_path)
    continuation = continuation_from(dead, range(7, 10), loss_offset=100.0)
    kept = resume_and_catch_up(tmp_path, dead, seq_of(dead, CheckpointCommitted, 6), 7, continuation)
    assert kept == seq_of(dead, Validated, 6)
    found = scalars(tmp_path)
    assert found["train/loss"] == [(s, float(s)) for s in range(1, 7)] + [
        (s, 100.0 + s) for s in range(7, 10)
    ]
    assert found["validation/a"] == [(2, 1.0), (4, 2.0), (6, 3.0)]  # steps 8 and 10 were superseded
    # The dead process's file still holds steps 7 to 10; the resumed writer's starts with the marker.
    old = EventAccumulator(old_file)
    old.Reload()
    assert [point.step for point in old.Scalars("train/loss")] == list(range(1, 11))
    assert purge_markers(event_files(tmp_path)[-1]) == [(7, event_pb2.SessionLog.START)]


def test_the_purge_holds_even_if_the_resumed_run_writes_nothing(tmp_path):
    dead = history(5)
    live(tmp_path, dead)
    backdate_event_files(tmp_path)
    with MetricsProjection(tmp_path) as projection:
        projection.resume(seq_of(dead, CheckpointCommitted, 3), next_step=4)
    assert [step for step, _ in scalars(tmp_path)["train/loss"]] == [1, 2, 3]
    assert [line["step"] for line in jsonl_records(tmp_path)] == [1, 2, 2, 3]


def test_two_resumes_in_a_row_show_what_a_rebuild_shows(tmp_path):
    dead = history(9)
    live(tmp_path, dead)
    backdate_event_files(tmp_path, seconds=7200)
    first = continuation_from(dead, range(4, 9), loss_offset=50.0)  # resumed at step 3, ran to step 8
    resume_and_catch_up(tmp_path, dead, seq_of(dead, CheckpointCommitted, 3), 4, first)
    backdate_event_files(tmp_path)
    effective = [record for record in dead if record[0] <= seq_of(dead, CheckpointCommitted, 3)] + first
    # Crashed again, restored to just after step 5 of the first resumed run.
    through_seq = first[1][0]
    second = continuation_from(first, range(6, 8), loss_offset=90.0)
    resume_and_catch_up(tmp_path, effective, through_seq, 6, second)
    rebuild(tmp_path / "rebuilt", [r for r in effective if r[0] <= through_seq] + second)
    assert jsonl_or_nothing(tmp_path) == jsonl_or_nothing(tmp_path / "rebuilt")
    assert visible(tmp_path) == visible(tmp_path / "rebuilt")
    assert [step for step, _ in scalars(tmp_path)["train/loss"]] == list(range(1, 8))


def test_a_resume_in_the_same_second_waits_so_its_event_file_sorts_last(tmp_path):
    dead = history(3)
    live(tmp_path, dead)
    with MetricsProjection(tmp_path) as projection:
        projection.resume(seq_of(dead, CheckpointCommitted, 3), next_step=4)
    files = event_files(tmp_path)
    assert [bool(purge_markers(path)) for path in files] == [False, True]


def test_a_line_reaches_the_jsonl_only_after_its_points_reach_tensorboard(tmp_path):
    projection = MetricsProjection(tmp_path)
    seq = 0
    while not os.path.exists(tmp_path / JSONL_NAME):  # written when the pending lines pass 64 KiB
        seq += 1
        projection.observe(seq, step_event(seq, float(seq)))
    # Read as a resume after a kill -9 here would find them: every line on disk has its points.
    on_disk = [line["step"] for line in jsonl_records(tmp_path)]
    drawn = [step for step, _ in scalars(tmp_path)["train/loss"]]
    assert on_disk and set(on_disk) <= set(drawn)
    projection.close()


LOSSES = st.one_of(st.floats(-4, 4, width=32), st.just(math.nan))


@st.composite
def crashes(draw):
    """A dead process's records, the restore point, the fraction of metrics.jsonl the crash left on disk
    (TensorBoard, flushed first, has it all), and what the resumed run writes."""
    events = [StageEntered(step=0, tokens=0, stage=0)]
    for step in range(1, draw(st.integers(1, 9)) + 1):
        events.append(step_event(step, draw(LOSSES)))
        if draw(st.booleans()):
            events.append(validation(step, draw(LOSSES)))
        if draw(st.booleans()):
            events.append(checkpoint(step))
    dead = list(enumerate(events))
    through_seq = draw(st.integers(0, len(dead) - 1))
    restore_step = events[through_seq].step
    new_events = [validation(restore_step, draw(LOSSES))] if draw(st.booleans()) else []
    for step in range(restore_step + 1, restore_step + 1 + draw(st.integers(0, 3))):
        new_events.append(step_event(step, draw(LOSSES)))
    continuation = [(len(dead) + 1 + i, event) for i, event in enumerate(new_events)]
    jsonl_fraction = draw(st.one_of(st.just(1.0), st.floats(0, 1)))  # often the whole file: a clean stop
    return dead, through_seq, restore_step + 1, jsonl_fraction, continuation


@settings(max_examples=30, deadline=None)
@given(crashes())
def test_resume_then_catch_up_writes_what_a_rebuild_writes(crash):
    dead, through_seq, next_step, jsonl_fraction, continuation = crash
    with tempfile.TemporaryDirectory() as tmp:
        run, rebuilt = os.path.join(tmp, "run"), os.path.join(tmp, "rebuilt")
        live(run, dead)
        jsonl_path = os.path.join(run, JSONL_NAME)
        os.truncate(jsonl_path, int(os.path.getsize(jsonl_path) * jsonl_fraction))  # maybe mid-line
        backdate_event_files(run)
        resume_and_catch_up(run, dead, through_seq, next_step, continuation)
        rebuild(rebuilt, [record for record in dead if record[0] <= through_seq] + continuation)
        assert jsonl_or_nothing(run) == jsonl_or_nothing(rebuilt)
        assert visible(run) == visible(rebuilt)
