"""Resuming the metrics projection in place: metrics.jsonl is cut back, reading only its tail, and what a
resume plus the caller's catch-up appends is what a rebuild from the same effective records writes."""

from __future__ import annotations

import builtins
import io
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.states.events import CheckpointCommitted, StageEntered, StepCommitted, Validated
from rewind.stores import metrics
from rewind.stores.metrics import (
    JSONL_NAME,
    TAIL_BLOCK_BYTES,
    TB_DIR_NAME,
    MetricsProjection,
    find_cut,
    rebuild,
)
from tests.stores.test_metrics import jsonl_bytes, jsonl_records, live, step_event


def checkpoint(step: int) -> CheckpointCommitted:
    return CheckpointCommitted(
        step=step, tokens=step * 64, checkpoint=f"{step:08d}-0123abcd", manifest_sha256="0" * 64
    )


def validation(step: int, loss: float) -> Validated:
    return Validated(step=step, tokens=step * 64, losses={"a": loss})


def history(num_steps: int, *, loss_offset: float = 0.0) -> list:
    """(seq, event): per step a train record, a validation at even steps, a checkpoint at every third."""
    events = [StageEntered(step=0, tokens=0, stage=0)]
    for step in range(1, num_steps + 1):
        events.append(step_event(step, step + loss_offset))
        if step % 2 == 0:
            events.append(validation(step, step / 2 + loss_offset))
        if step % 3 == 0:
            events.append(checkpoint(step))
    return list(enumerate(events))


def seq_of(records: list, kind: type, step: int) -> int:
    return next(seq for seq, event in records if isinstance(event, kind) and event.step == step)


def test_resume_cuts_right_after_through_seq_when_it_ends_a_step(tmp_path):
    dead = history(8)
    live(tmp_path, dead)
    through_seq = seq_of(dead, CheckpointCommitted, 6)  # after step 6's train and validation lines
    with MetricsProjection(tmp_path) as projection:
        kept = projection.resume(through_seq, next_step=7)
    assert kept == seq_of(dead, Validated, 6)
    rebuild(tmp_path / "through", dead[: through_seq + 1])
    assert jsonl_bytes(tmp_path) == jsonl_bytes(tmp_path / "through")
    assert [line["step"] for line in jsonl_records(tmp_path)][-3:] == [5, 6, 6]  # steps 7 and 8 are gone


def test_resume_cuts_back_to_the_start_of_the_step_through_seq_falls_in(tmp_path):
    dead = history(8)
    live(tmp_path, dead)
    # The crash superseded step 4's validation but not its train record: the whole step is cut, so
    # TensorBoard can hide step 4 and the caller draws its train record again.
    through_seq = seq_of(dead, StepCommitted, 4)
    with MetricsProjection(tmp_path) as projection:
        kept = projection.resume(through_seq, next_step=5)
    assert kept == seq_of(dead, CheckpointCommitted, 3) - 1  # step 3's train line
    assert [line["step"] for line in jsonl_records(tmp_path)] == [1, 2, 2, 3]
    # A next_step below the step of through_seq cuts back to it.
    with MetricsProjection(tmp_path) as projection:
        assert projection.resume(through_seq, next_step=2) == seq_of(dead, StepCommitted, 1)
    assert [line["step"] for line in jsonl_records(tmp_path)] == [1]


def test_a_torn_last_line_is_dropped(tmp_path):
    dead = history(4)
    live(tmp_path, dead)
    with open(tmp_path / JSONL_NAME, "ab") as handle:
        handle.write(b'{"type":"train","seq":8,"step":5,"tok')  # a crash in the middle of a write
    with MetricsProjection(tmp_path) as projection:
        kept = projection.resume(through_seq=1000, next_step=5)
    # The last complete line (step 4's validation) is the last one in force, but a later record of
    # step 4 may have reached TensorBoard: step 4 is cut too, and its records are drawn again.
    assert kept == seq_of(dead, CheckpointCommitted, 3) - 1
    rebuild(tmp_path / "through", dead[: kept + 1])
    assert jsonl_bytes(tmp_path) == jsonl_bytes(tmp_path / "through")


def test_a_file_that_is_only_a_torn_line_resumes_empty(tmp_path):
    live(tmp_path, history(1))
    with open(tmp_path / JSONL_NAME, "wb") as handle:
        handle.write(b'{"type":"train","se')
    with MetricsProjection(tmp_path) as projection:
        assert projection.resume(through_seq=1000, next_step=2) == -1
    assert jsonl_bytes(tmp_path) == b""
    assert not os.path.exists(tmp_path / TB_DIR_NAME)  # nothing kept: TensorBoard starts over too


class CountingReader:
    """A file opened for reading that counts the bytes read from it."""

    def __init__(self, raw):
        self.raw, self.name, self.bytes_read = raw, getattr(raw, "name", "in memory"), 0

    def seek(self, *args):
        return self.raw.seek(*args)

    def read(self, size=-1):
        data = self.raw.read(size)
        self.bytes_read += len(data)
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.raw.close()


class NullWriter:
    """A SummaryWriter (and its file writer) that writes nothing."""

    def add_scalar(self, *args, **kwargs):
        pass

    def _get_file_writer(self):
        return self

    flush = close = add_summary = add_scalar


def projection_reads(monkeypatch) -> list[CountingReader]:
    """Every file the metrics module opens for reading from now on, counting what is read from it."""
    readers = []

    def counting_open(path, mode="r", *args, **kwargs):
        handle = builtins.open(path, mode, *args, **kwargs)  # noqa: SIM115 - the caller closes it
        if "r" in mode:
            readers.append(handle := CountingReader(handle))
        return handle

    # `open` is looked up in the module's globals before the builtins: only the projection's opens count.
    monkeypatch.setattr(metrics, "open", counting_open, raising=False)
    return readers


def test_resume_of_a_large_file_reads_only_its_tail(tmp_path, monkeypatch):
    num_lines = 100_000
    with monkeypatch.context() as patch:
        # TensorBoard left out: 600k scalars would take most of a minute and are beside the point here.
        patch.setattr(MetricsProjection, "_open_tensorboard", lambda self: NullWriter())
        with MetricsProjection(tmp_path) as projection:
            for seq in range(num_lines):
                projection.observe(seq, step_event(seq + 1, 1.0))
    os.makedirs(tmp_path / TB_DIR_NAME)
    size = os.path.getsize(tmp_path / JSONL_NAME)
    readers = projection_reads(monkeypatch)
    through_seq = num_lines - 100
    with MetricsProjection(tmp_path) as projection:
        assert projection.resume(through_seq, next_step=through_seq + 2) == through_seq
    cut_bytes = size - os.path.getsize(tmp_path / JSONL_NAME)
    assert size > 15_000_000 and 100 * 150 < cut_bytes < 100 * 250
    (reader,) = readers
    # The 100 lines cut, then at most one more block to find where the last kept line starts.
    assert cut_bytes < reader.bytes_read <= cut_bytes + TAIL_BLOCK_BYTES
    with open(tmp_path / JSONL_NAME, "rb") as handle:
        handle.seek(-1000, os.SEEK_END)
        tail = handle.read()
    assert tail.endswith(b"\n")
    assert json.loads(tail.splitlines()[-1])["seq"] == through_seq


@pytest.mark.parametrize(
    "written",
    [
        # An older rewind: no seq.
        b'{"type":"train","step":1,"tokens":64,"stage":0,"loss":2.5}\n',
        # Damage that is not a torn last line.
        b'{"type":"train","seq":1,"step":1}\nnot json\n',
        b'{"type":"train","seq":1,"step":1}\n\n',
        # Seqs that do not rise: not written by appending a log's records.
        b'{"type":"train","seq":2,"step":1}\n{"type":"train","seq":2,"step":2}\n',
    ],
)
def test_a_projection_that_cannot_be_trusted_is_deleted(tmp_path, written):
    live(tmp_path, history(2))
    (tmp_path / JSONL_NAME).write_bytes(written)
    with MetricsProjection(tmp_path) as projection:
        assert projection.resume(through_seq=1000, next_step=3) is None
    assert os.listdir(tmp_path) == []
    # The caller then projects from seq 0, which is a rebuild.
    live(tmp_path, history(2))
    rebuild(tmp_path / "rebuilt", history(2))
    assert jsonl_bytes(tmp_path) == jsonl_bytes(tmp_path / "rebuilt")


def test_kept_lines_without_tensorboard_files_are_not_trusted(tmp_path):
    live(tmp_path, history(2))
    os.rename(tmp_path / TB_DIR_NAME, tmp_path / "elsewhere")
    with MetricsProjection(tmp_path) as projection:
        assert projection.resume(through_seq=1000, next_step=3) is None
    assert os.listdir(tmp_path) == ["elsewhere"]


def test_resume_without_a_projection_returns_minus_one_and_writes_nothing(tmp_path):
    with MetricsProjection(tmp_path / "run") as projection:
        assert projection.resume(through_seq=7, next_step=3) == -1
    assert not os.path.exists(tmp_path / "run")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / JSONL_NAME).write_bytes(b"")
    with MetricsProjection(tmp_path / "empty") as projection:
        assert projection.resume(through_seq=7, next_step=3) == -1


def test_resume_keeping_nothing_reads_nothing(tmp_path, monkeypatch):
    # What a start does in a directory a dead start left behind: no line can have a seq below 0, and
    # looking for one would read the whole file.
    live(tmp_path, history(3))
    readers = projection_reads(monkeypatch)
    with MetricsProjection(tmp_path) as projection:
        assert projection.resume(through_seq=-1, next_step=0) == -1
    assert readers == [] and os.listdir(tmp_path) == []


@st.composite
def jsonl_files(draw):
    """(file bytes, [(seq, step, line length)]): lines of rising seqs and non-decreasing steps, padded to
    varied lengths so that they straddle blocks, maybe followed by a torn line (any bytes but a newline)."""
    num_lines = draw(st.integers(0, 12))
    seqs = sorted(draw(st.sets(st.integers(0, 60), min_size=num_lines, max_size=num_lines)))
    steps = sorted(draw(st.lists(st.integers(0, 8), min_size=num_lines, max_size=num_lines)))
    lines = []
    for seq, step in zip(seqs, steps, strict=True):
        pad = "x" * draw(st.integers(0, 40))
        lines.append(b'{"type":"train","seq":%d,"step":%d,"pad":"%s"}\n' % (seq, step, pad.encode()))
    torn = draw(st.binary(max_size=50).map(lambda tail: tail.replace(b"\n", b"")))
    table = [(seq, step, len(line)) for seq, step, line in zip(seqs, steps, lines, strict=True)]
    return b"".join(lines) + torn, table


def expected_cut(table, through_seq: int, next_step: int) -> tuple[int, int, int]:
    """find_cut's answer worked out from the whole file."""
    in_force = [i for i, (seq, _, _) in enumerate(table) if seq <= through_seq]
    if not in_force:
        return 0, -1, next_step
    last = in_force[-1]
    purge_step = min(next_step, table[last + 1][1] if last + 1 < len(table) else table[last][1])
    kept = [row for row in table[: last + 1] if row[1] < purge_step]
    return sum(length for _, _, length in kept), kept[-1][0] if kept else -1, purge_step


@settings(max_examples=300, deadline=None)
@given(jsonl_files(), st.integers(-1, 62), st.integers(0, 10), st.integers(1, 64))
def test_find_cut_agrees_with_reading_the_whole_file_and_reads_only_the_tail(
    file, through_seq, next_step, block_bytes
):
    data, table = file
    reader = CountingReader(io.BytesIO(data))
    cut = find_cut(reader, through_seq, next_step, block_bytes)
    assert cut == expected_cut(table, through_seq, next_step)
    # What it read: the torn tail, the lines cut, the last line kept back to its start, one block more.
    longest = max((length for _, _, length in table), default=0)
    assert reader.bytes_read <= len(data) - cut.offset + longest + block_bytes
