"""The metrics projection: the log's numbers as `RUN/metrics.jsonl` and TensorBoard files in `RUN/tb/`.

Both are projections of the event log, never a source of truth. `metrics.jsonl` has one JSON object
per line, `type` first, then the seq of the log record it projects, `step`, `tokens` and the fields:

    {"type": "train", "seq", "step", "tokens", "stage", "loss", "kl", "lr", "beta", "grad_norm", "rows", "skipped"}
    {"type": "validation", "seq", "step", "tokens", "losses": {dataset: loss}}
    {"type": "evaluation", "seq", "step", "tokens", "boundary", "scores": {task: accuracy}, "losses": {task: loss},
     "perplexity": {task: exp(loss)}, "bits_per_byte": {task: bits per byte}}

Nested dicts are written with sorted keys; a non-finite float (a skipped step's NaN loss) is written as
null, since JSON has no NaN. TensorBoard gets the same numbers as scalars against the step:
train/{loss,kl,lr,beta,grad_norm,stage}, validation/<dataset>, eval/<task>/{accuracy,loss,perplexity,bits_per_byte}.
Accuracy is there only for tasks with answers, bits per byte only where the run knew its tokens' byte
lengths (older logs have none), perplexity wherever there is a loss (exp of it, derived here).

Durability. The projection is derived data: its lines are flushed at each group commit of the log (the
engine calls `flush()`), never fsynced, and everything here can be rebuilt from the log at any time
with `rewind export tensorboard RUN` (`rebuild`). So a crash can leave it behind the log, ahead of it
(lines of records a resume then supersedes), or with a torn last line, and a resume repairs that
without reading the whole file: `MetricsProjection.resume` cuts metrics.jsonl back to the records still
in force, reading it backwards from its end, so it costs what was written after the restore point, not
the size of the file; the caller then projects the records the crash kept out. TensorBoard files
cannot be cut, so the resumed writer tells TensorBoard to hide their points from the cut's step on.
Lines reach metrics.jsonl only after TensorBoard has been flushed, so when a process dies (kill -9, not
a power loss, which nothing here guards against) every line on disk has its points on disk, and the
resumed TensorBoard shows exactly what a rebuild would. A projection that cannot be trusted (written by
an older rewind, without seqs, or damaged) is deleted and projected again from the start.

Local filesystem only: TensorBoard's writer and an append-mode JSONL file both want a real file, and a
projection of a run kept on an object store can be rebuilt locally from its log.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, NamedTuple

import msgspec

from rewind.states.events import Evaluated, Event, StepCommitted, Validated
from rewind.stores.fsio import filesystem, open_appending, open_regular
from rewind.stores.runguard import check_writable

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

JSONL_NAME = "metrics.jsonl"
TB_DIR_NAME = "tb"
# Bytes a resume reads per backward step through metrics.jsonl: a few hundred lines of ~200 bytes.
TAIL_BLOCK_BYTES = 64 * 1024
# Lines held in memory before TensorBoard is flushed and they are written (see `flush`).
PENDING_LINE_BYTES = 64 * 1024
# How long a resume waits for the clock to pass the newest event file's second (see `_open_tensorboard`).
_EVENT_FILE_ORDER_WAIT_S = 2.0
_TRAIN_SCALARS = ("loss", "kl", "lr", "beta", "grad_norm", "stage")
_MAX_EXP = 709.78  # math.exp overflows a float past this


class MetricsError(Exception):
    """The metrics projection cannot be written where asked."""


class _LineHead(msgspec.Struct):
    """What a resume reads of a line. Decoding into it still parses the whole line, so a damaged line
    fails here, and so does a line of an older rewind, which had no seq."""

    type: str
    seq: int
    step: int


_LINE_HEAD = msgspec.json.Decoder(_LineHead)


class Cut(NamedTuple):
    """Where a resume truncates metrics.jsonl: the byte offset, the seq of the last line kept (-1 for
    none), and the step from which TensorBoard must hide what earlier writers drew."""

    offset: int
    kept_seq: int
    purge_step: int


def project(event: Event) -> tuple[dict[str, Any], list[tuple[str, float]]] | None:
    """The JSONL record (without its seq) and the TensorBoard (tag, value) scalars for one event;
    None if it has no metrics."""
    head = {"step": event.step, "tokens": event.tokens}
    if isinstance(event, StepCommitted):
        record = {"type": "train", **head, "stage": event.stage, "loss": event.loss, "kl": event.kl}
        record |= {"lr": event.lr, "beta": event.beta, "grad_norm": event.grad_norm}
        record |= {"rows": list(event.rows), "skipped": event.skipped}
        return record, [(f"train/{name}", float(record[name])) for name in _TRAIN_SCALARS]
    if isinstance(event, Validated):
        losses = dict(sorted(event.losses.items()))
        record = {"type": "validation", **head, "losses": losses}
        return record, [(f"validation/{dataset}", loss) for dataset, loss in losses.items()]
    if isinstance(event, Evaluated):
        scores, losses = dict(sorted(event.scores.items())), dict(sorted(event.losses.items()))
        # exp(loss) is derived here rather than logged: a pure function of the event, so a rebuild
        # from the log gives it again, bit for bit.
        perplexities = {task: perplexity(loss) for task, loss in losses.items()}
        bits_per_byte = dict(sorted(event.bits_per_byte.items()))
        record = {
            "type": "evaluation",
            **head,
            "boundary": event.boundary,
            "scores": scores,
            "losses": losses,
            "perplexity": perplexities,
            "bits_per_byte": bits_per_byte,
        }
        scalars = [(f"eval/{task}/accuracy", score) for task, score in scores.items()]
        scalars += [(f"eval/{task}/loss", loss) for task, loss in losses.items()]
        scalars += [(f"eval/{task}/perplexity", value) for task, value in perplexities.items()]
        return record, scalars + [(f"eval/{task}/bits_per_byte", bits) for task, bits in bits_per_byte.items()]
    return None


def perplexity(loss: float) -> float:
    """exp(loss), inf where that overflows a float (NaN stays NaN; written as null like any non-finite)."""
    return math.inf if loss > _MAX_EXP else math.exp(loss)


def complete_lines_backwards(
    handle: BinaryIO, block_bytes: int = TAIL_BLOCK_BYTES
) -> Iterator[tuple[bytes, int]]:
    """(line without its newline, offset just past its newline) for every newline-terminated line of
    `handle`, last line first, reading `block_bytes` at a time from the end, and no further than the
    caller iterates. Bytes after the last newline (a line torn by a crash mid-write) are skipped."""
    position = handle.seek(0, os.SEEK_END)
    buffer = b""  # the bytes at [position, position + len(buffer)), none of them yielded yet
    past_torn_tail = False
    while True:
        if not past_torn_tail:
            # Until the last newline turns up, all that was read is the torn line: drop it, so that a
            # long one (zeros left by a power loss) costs no more than reading it once.
            last_newline = buffer.rfind(b"\n")
            buffer, past_torn_tail = buffer[: last_newline + 1], last_newline >= 0
        if past_torn_tail:
            # `buffer` ends with a newline; each earlier newline starts a line we can hand out. Slicing
            # `buffer` once per block, not once per line, keeps a block's cost linear in its size.
            stop = len(buffer)
            while (newline := buffer.rfind(b"\n", 0, stop - 1)) >= 0:
                yield buffer[newline + 1 : stop - 1], position + stop
                stop = newline + 1
            buffer = buffer[:stop]
            if position == 0 and buffer:  # the file's first line
                yield buffer[:-1], len(buffer)
                return
        if position == 0:
            return
        start = max(0, position - block_bytes)
        handle.seek(start)
        block = handle.read(position - start)
        if len(block) != position - start:
            raise MetricsError(f"{getattr(handle, 'name', 'metrics.jsonl')} shrank while it was read")
        buffer, position = block + buffer, start


def find_cut(
    handle: BinaryIO, through_seq: int, next_step: int, block_bytes: int = TAIL_BLOCK_BYTES
) -> Cut | None:
    """Where a resume cuts a metrics.jsonl, and from which step TensorBoard must hide what earlier
    writers drew. The cut goes right after the last complete line with seq <= `through_seq`, call it L,
    unless a superseded record may share L's step: when the line after L has L's step, or when L is
    the last line (TensorBoard is flushed before the JSONL, so it may hold points of records past the
    file's end). Then the cut moves back to before L's step, so that it falls between steps: TensorBoard
    hides that step on, and the caller draws its records again. A smaller `next_step` moves it back to
    before `next_step`.

    Only the lines after the cut and the last one kept are checked; the earlier ones are trusted, since
    checking them would make every resume cost the whole file. None when a checked line is not a line
    of this format (no seq: an older rewind; not JSON: damage) or the seqs do not rise, which an
    append-only projection of an append-only log never writes."""
    later: _LineHead | None = None  # the line after the one being looked at
    purge_step = None
    for line, end in complete_lines_backwards(handle, block_bytes):
        try:
            head = _LINE_HEAD.decode(line)
        except msgspec.DecodeError:
            return None
        if later is not None and head.seq >= later.seq:
            return None
        if purge_step is None and head.seq <= through_seq:
            purge_step = min(next_step, head.step if later is None else later.step)
        if purge_step is not None and head.step < purge_step:
            return Cut(end, head.seq, purge_step)
        later = head
    return Cut(0, -1, next_step if purge_step is None else purge_step)


class MetricsProjection:
    """Live projection of one run's records. Writes are buffered until `flush()` or `close()`; the
    files are opened on first use, so a projection that never sees a metric leaves no files behind."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        location = filesystem(run_dir)
        if not location.is_local:
            raise MetricsError(f"metrics are written to local directories only, not {location.url}")
        self.run_dir = location.path
        self.jsonl_path = os.path.join(self.run_dir, JSONL_NAME)
        self.tb_dir = os.path.join(self.run_dir, TB_DIR_NAME)
        self.tail_block_bytes = TAIL_BLOCK_BYTES
        self._jsonl = None
        self._tb: SummaryWriter | None = None
        self._pending: list[bytes] = []  # encoded lines not yet written, see `flush`
        self._pending_bytes = 0
        self._purge_step: int | None = None  # set by a resume, for the next TensorBoard writer
        self._encoder = msgspec.json.Encoder()

    def observe(self, seq: int, event: Event) -> None:
        """Project the log record `seq` holding `event`. Records must come in rising seq order."""
        projected = project(event)
        if projected is None:
            return
        record, scalars = projected
        writer = self._open_tensorboard()
        if scalars:
            # One event holding all of the record's values: what `add_scalar` writes once per value
            # (a scalar summary value), at a quarter of the per-step cost.
            from tensorboard.compat.proto.summary_pb2 import Summary

            values = [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars]
            writer._get_file_writer().add_summary(Summary(value=values), event.step)
        # The seq goes right after "type": updating the key that is already there keeps its place.
        line = self._encoder.encode({"type": record["type"], "seq": seq} | record) + b"\n"
        self._pending.append(line)
        self._pending_bytes += len(line)
        if self._pending_bytes >= PENDING_LINE_BYTES:
            self.flush()

    def resume(self, through_seq: int, next_step: int) -> int | None:
        """Make the projection hold only records with seq <= `through_seq` it already holds, and get
        ready to append. Returns the seq of the last record kept (-1 if none): the caller then observes
        the records in (that seq, through_seq], which a crash kept out of the projection or which share
        a step with a later superseded one, then the new ones. Returns None, with both projections
        deleted, when the existing one cannot be trusted for appending: the caller then observes every
        record from seq 0. `next_step` is the first step the resumed run will write."""
        if through_seq < 0:
            # Seqs start at 0: nothing is kept, and looking for a line before the first would read
            # the whole file.
            self._discard()
            return -1
        self.close()
        try:
            # Unbuffered: read only what is asked. A regular file only: a FIFO would block this open forever.
            with _reading(self.jsonl_path) as handle:
                size = handle.seek(0, os.SEEK_END)
                cut = find_cut(handle, through_seq, next_step, self.tail_block_bytes)
        except FileNotFoundError:
            size, cut = 0, Cut(0, -1, next_step)
        # Kept lines without tb/ beside them: someone deleted it, and appending would leave TensorBoard
        # without the kept points.
        if cut is None or (cut.kept_seq >= 0 and not os.path.isdir(self.tb_dir)):
            self._discard()
            return None
        if cut.offset < size:
            os.truncate(self.jsonl_path, cut.offset)
        if cut.kept_seq < 0:
            # Nothing kept: TensorBoard starts over too, rather than drawing twice what the caller
            # projects again.
            shutil.rmtree(self.tb_dir, ignore_errors=True)
        else:
            self._purge_step = cut.purge_step
            # Opened now, not on the next metric, so that the superseded points are hidden even if
            # the resumed run never writes one.
            self._open_tensorboard()
        return cut.kept_seq

    def flush(self) -> None:
        """Write what was observed. TensorBoard first: a line reaches metrics.jsonl only once its points
        are in the event file, so a resume that keeps the line can trust TensorBoard to have them."""
        if self._tb is not None:
            self._tb.flush()  # blocks until the writer thread has written every queued event
        if self._pending:
            if self._jsonl is None:
                os.makedirs(self.run_dir, exist_ok=True)
                # Lives as long as the projection; a regular file only (a FIFO would block this open).
                self._jsonl = os.fdopen(open_appending(self.jsonl_path), "ab")
            self._jsonl.write(b"".join(self._pending))
            self._jsonl.flush()
            self._pending.clear()
            self._pending_bytes = 0

    def close(self) -> None:
        self.flush()
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def rebuild(self, run_dir: str | os.PathLike[str], records: Iterable[tuple[int, Event]]) -> None:
        """Delete both projections and write them again from `records`, (seq, event) pairs that must
        be the effective stream (superseded records removed). Live observing continues after it."""
        if filesystem(run_dir).path != self.run_dir:
            raise MetricsError(f"this projection writes {self.run_dir}, not {os.fspath(run_dir)}")
        self._discard()
        for seq, event in records:
            self.observe(seq, event)
        self.flush()

    def __enter__(self) -> MetricsProjection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _discard(self) -> None:
        # A crash in here loses nothing: the projection is derived data, the next rebuild redoes it.
        self.close()
        self._purge_step = None
        if os.path.exists(self.jsonl_path):
            os.remove(self.jsonl_path)
        shutil.rmtree(self.tb_dir, ignore_errors=True)

    def _open_tensorboard(self) -> SummaryWriter:
        if self._tb is not None:
            return self._tb
        # Imported here: TensorBoard is slow to import, and most `rewind` commands never write metrics.
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(self.run_dir, exist_ok=True)
        if self._purge_step is not None:
            _wait_until_new_event_files_sort_last(self.tb_dir)
        # With purge_step=P, torch's SummaryWriter starts its new event file with Event(step=P,
        # file_version="brain.Event:2") and Event(step=P, session_log=SessionLog(status=START)). When
        # TensorBoard's loader (EventAccumulator, purge_orphaned_data=True by default) reads that START,
        # it drops every point, of every tag, with step >= P that it loaded before, i.e. from the event
        # files whose names sort first. Nothing is deleted from disk, and the points this writer adds
        # after the START are kept. The marker is written once, when the writer opens.
        self._tb = SummaryWriter(log_dir=self.tb_dir, purge_step=self._purge_step)
        self._purge_step = None
        return self._tb


def _wait_until_new_event_files_sort_last(tb_dir: str) -> None:
    """TensorBoard reads a directory's event files in name order, and a name is
    `events.out.tfevents.<unix seconds, 10 digits>.<host>.<pid>.<counter>`: a file opened in the same
    second as an earlier one may sort before it (pid 999 > 1000 as text), and its purge marker would
    then be read before the points it must hide. A resumed process normally starts seconds after the
    dead one; when it does not, wait for the next second, at most a bounded time (a clock far behind
    the one that named the old files cannot be waited out: their points then stay visible)."""
    seconds = []
    for name in os.listdir(tb_dir) if os.path.isdir(tb_dir) else []:
        field = name.split(".")[3:4]
        if name.startswith("events.out.tfevents.") and field and field[0].isdigit():
            seconds.append(int(field[0]))
    deadline = time.monotonic() + _EVENT_FILE_ORDER_WAIT_S
    while seconds and int(time.time()) <= max(seconds) and time.monotonic() < deadline:
        time.sleep(0.05)


def _reading(path: str) -> BinaryIO:
    """The regular file at `path`, unbuffered, for reading (RefusedFile for a FIFO, device or directory)."""
    handle = open(open_regular(path)[0], "rb", buffering=0)  # noqa: SIM115 - the caller closes it
    handle.name = path  # (for the messages: it would be the descriptor's number)
    return handle


def rebuild(run_dir: str | os.PathLike[str], records: Iterable[tuple[int, Event]]) -> None:
    """Rewrite `run_dir`'s metrics.jsonl and tb/ from its effective (seq, event) records, e.g. for tools.
    It takes no lock, so it makes the writer's check itself: nothing leads out of the run (runguard)."""
    check_writable(filesystem(run_dir))
    with MetricsProjection(run_dir) as projection:
        projection.rebuild(run_dir, records)
