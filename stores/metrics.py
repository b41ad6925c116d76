"""The metrics projection: the log's numbers as `RUN/metrics.jsonl` and TensorBoard files in `RUN/tb/`.

Both are projections of the event log, never a source of truth: anything here can be deleted and
rebuilt from the effective events (`rebuild`), which is what a resume does, because events of the
superseded steps were projected live before the process died and must not linger in the plots.

`metrics.jsonl` has one JSON object per line, `type` first, then `step`, `tokens` and the fields:

    {"type": "train", "step", "tokens", "stage", "loss", "kl", "lr", "beta", "grad_norm", "rows", "skipped"}
    {"type": "validation", "step", "tokens", "losses": {dataset: loss}}
    {"type": "evaluation", "step", "tokens", "boundary", "scores": {task: accuracy}, "losses": {task: loss}}

Nested dicts are written with sorted keys; a non-finite float (a skipped step's NaN loss) is written as
null, since JSON has no NaN. TensorBoard gets the same numbers as scalars against the step:
train/{loss,kl,lr,beta,grad_norm,stage}, validation/<dataset>, eval/<task>/accuracy, eval/<task>/loss.

Local filesystem only: TensorBoard's writer and an append-mode JSONL file both want a real file, and a
projection of a run kept on an object store can be rebuilt locally from its log.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from typing import Any

import msgspec

from rewind.states.events import Evaluated, Event, StepCommitted, Validated
from rewind.stores.fsio import filesystem

JSONL_NAME = "metrics.jsonl"
TB_DIR_NAME = "tb"
_TRAIN_SCALARS = ("loss", "kl", "lr", "beta", "grad_norm", "stage")


class MetricsError(Exception):
    """The metrics projection cannot be written where asked."""


def project(event: Event) -> tuple[dict[str, Any], list[tuple[str, float]]] | None:
    """The JSONL record and the TensorBoard (tag, value) scalars for one event; None if it has no metrics."""
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
        record = {
            "type": "evaluation",
            **head,
            "boundary": event.boundary,
            "scores": scores,
            "losses": losses,
        }
        scalars = [(f"eval/{task}/accuracy", score) for task, score in scores.items()]
        return record, scalars + [(f"eval/{task}/loss", loss) for task, loss in losses.items()]
    return None


class MetricsProjection:
    """Live projection of one run's events. Writes are buffered until `flush()` or `close()`; the files
    are opened on first use, so a projection that never sees a metric leaves no files behind."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        location = filesystem(run_dir)
        if not location.is_local:
            raise MetricsError(f"metrics are written to local directories only, not {location.url}")
        self.run_dir = location.path
        self.jsonl_path = os.path.join(self.run_dir, JSONL_NAME)
        self.tb_dir = os.path.join(self.run_dir, TB_DIR_NAME)
        self._jsonl = None
        self._tb = None
        self._encoder = msgspec.json.Encoder()

    def observe(self, event: Event) -> None:
        projected = project(event)
        if projected is None:
            return
        record, scalars = projected
        self._open()
        self._jsonl.write(self._encoder.encode(record) + b"\n")
        for tag, value in scalars:
            self._tb.add_scalar(tag, value, global_step=event.step)

    def flush(self) -> None:
        if self._jsonl is not None:
            self._jsonl.flush()
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._tb.close()
            self._jsonl = self._tb = None

    def rebuild(self, run_dir: str | os.PathLike[str], events: Iterable[Event]) -> None:
        """Delete both projections and write them again from `events`, which must be the effective
        stream (superseded events removed). Live observing continues after it, appending."""
        if filesystem(run_dir).path != self.run_dir:
            raise MetricsError(f"this projection writes {self.run_dir}, not {os.fspath(run_dir)}")
        self.close()
        # A crash in here loses nothing: the projection is derived data, the next rebuild redoes it.
        if os.path.exists(self.jsonl_path):
            os.remove(self.jsonl_path)
        shutil.rmtree(self.tb_dir, ignore_errors=True)
        for event in events:
            self.observe(event)
        self.flush()

    def __enter__(self) -> MetricsProjection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open(self) -> None:
        if self._jsonl is not None:
            return
        # Imported here: TensorBoard is slow to import, and most `rewind` commands never write metrics.
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(self.run_dir, exist_ok=True)
        self._jsonl = open(self.jsonl_path, "ab")  # noqa: SIM115 - lives as long as the projection
        self._tb = SummaryWriter(log_dir=self.tb_dir)


def rebuild(run_dir: str | os.PathLike[str], events: Iterable[Event]) -> None:
    """Rewrite `run_dir`'s metrics.jsonl and tb/ from its effective events, e.g. for `rewind` tools."""
    with MetricsProjection(run_dir) as projection:
        projection.rebuild(run_dir, events)
