"""Synthetic run logs: a legal log of any length, written in seconds, for benchmarks and tests.

`write_synthetic_run` writes what a one-stage run of `num_steps` steps would log -- RunStarted,
StageEntered, a StepCommitted per step, a checkpoint every `checkpoint_every` steps with retention
deletions keeping the last three, and `num_resumes` crashes spread evenly, each followed by a
RunResumed from the last checkpoint -- through EventLog's public append/commit, so the log has real
segments and index files. Nothing else: no checkpoints on disk (their events name checkpoints that do
not exist, so `rewind verify` reports them missing), no metrics.

A crash here is what the engine's own crash leaves: the dead process committed some steps past its
last checkpoint, and the next process supersedes them. The restore point ("anchor") is the last
checkpoint's record and the retention deletions right after it, or the RunResumed that last restarted
from that checkpoint, or RunStarted alone before any checkpoint; superseding starts right after it.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Any

from rewind.states.config_identity import config_hash
from rewind.states.config_reading import loads_config
from rewind.states.events import (
    CheckpointCommitted,
    CheckpointDeleted,
    RunResumed,
    RunStarted,
    StageEntered,
    StepCommitted,
)
from rewind.states.fold import fold
from rewind.stores.eventlog import DEFAULT_SEGMENT_BYTES, EventLog

BATCH_SIZE = 8
BLOCK_SIZE = 64
DATASET = "grammar"
KEEP_CHECKPOINTS = 3

_CONFIG_TOML = """
[run]
name = "synthetic"
[architecture]
block_size = {block_size}
[training]
batch_size = {batch_size}
tokens = [{tokens}]
datasets = [[{{ name = "{dataset}", rate = 1.0 }}]]
[logging]
report_interval = {report_interval}
checkpoint_interval = {checkpoint_every}
keep_last_checkpoints = {keep}
"""

# Until RunResumed lost its copy of the restored state, it had to carry one (computed by folding).
_RESUME_CARRIES_STATE = "restored" in RunResumed.__struct_fields__


@dataclass(frozen=True)
class _Anchor:
    checkpoint: str  # "" = the run's start
    step: int
    last_seq: int  # the anchor's last record: superseding starts right after it


class _SyntheticRun:
    def __init__(self, log: EventLog, num_steps: int, checkpoint_every: int, report_interval: int):
        self.log = log
        self.num_steps = num_steps
        self.checkpoint_every = checkpoint_every
        self.report_interval = report_interval
        self.config = loads_config(
            _CONFIG_TOML.format(
                block_size=BLOCK_SIZE,
                batch_size=BATCH_SIZE,
                tokens=num_steps * BATCH_SIZE * BLOCK_SIZE,
                dataset=DATASET,
                report_interval=report_interval,
                checkpoint_every=checkpoint_every,
                keep=KEEP_CHECKPOINTS,
            ),
            "synthetic",
        )
        self.tokens_per_step = self.config.tokens_per_step
        self.step = 0
        self.live: list[str] = []
        self.anchor = _Anchor("", 0, 0)
        self.superseded: list[tuple[int, int]] = []
        # Only for a RunResumed that carries its restored state: the fold so far, and at the anchor.
        self._folded: Any = None
        self._unfolded: list = []
        self._anchor_state: Any = None

    def append(self, event: Any) -> int:
        if _RESUME_CARRIES_STATE:
            self._unfolded.append(event)
        return self.log.append(event)

    def start(self) -> None:
        self.append(RunStarted(step=0, tokens=0, config=self.config, config_hash=config_hash(self.config)))
        self._mark_anchor("", 0, 0)
        self.append(StageEntered(step=0, tokens=0, stage=0))
        self.log.commit()

    def run_to(self, last_step: int) -> None:
        """Steps up to `last_step`, committing every `report_interval` steps and at checkpoints."""
        tps, append = self.tokens_per_step, self.log.append  # plain appends: the hot loop
        track = _RESUME_CARRIES_STATE
        for step in range(self.step + 1, last_step + 1):
            event = StepCommitted(
                step=step,
                tokens=step * tps,
                stage=0,
                lr=3e-4 * min(1.0, step / 1000),
                beta=0.0,
                loss=2.5 / (1 + step / 1000) + 1e-6 * (step % 89),
                rows=[BATCH_SIZE],
                cursors={DATASET: step * BATCH_SIZE},
            )
            append(event)
            if track:
                self._unfolded.append(event)
            if step % self.checkpoint_every == 0:
                self.step = step
                self._checkpoint()
            elif step % self.report_interval == 0:
                self.log.commit()
        self.step = last_step
        self.log.commit()

    def _checkpoint(self) -> None:
        step, tokens = self.step, self.step * self.tokens_per_step
        name = f"{step:08d}-{hashlib.sha256(str(step).encode()).hexdigest()[:8]}"
        seq = self.append(
            CheckpointCommitted(
                step=step,
                tokens=tokens,
                checkpoint=name,
                manifest_sha256=hashlib.sha256(name.encode()).hexdigest(),
                files={},
            )
        )
        self.live.append(name)
        while len(self.live) > KEEP_CHECKPOINTS:  # retention, right after the new checkpoint
            seq = self.append(CheckpointDeleted(step=step, tokens=tokens, checkpoint=self.live.pop(0)))
        self.log.commit()
        self._mark_anchor(name, step, seq)

    def crash_and_resume(self) -> None:
        """The process dies (its steps since the anchor are in the log); the next one resumes."""
        if self.log.next_seq - 1 == self.anchor.last_seq:  # nothing past the anchor: do some steps
            self.run_to(min(self.num_steps, self.step + max(1, self.checkpoint_every // 2)))
        anchor = self.anchor
        first, last = anchor.last_seq + 1, self.log.next_seq - 1
        fields: dict[str, Any] = {}
        if "config_hash" in RunResumed.__struct_fields__:
            fields["config_hash"] = config_hash(self.config)
        if _RESUME_CARRIES_STATE:
            self._fold()
            fields["restored"] = self._anchor_state
        resumed = RunResumed(
            step=anchor.step,
            tokens=anchor.step * self.tokens_per_step,
            checkpoint=anchor.checkpoint,
            superseded_first_seq=first,
            superseded_last_seq=last,
            **fields,
        )
        seq = self.append(resumed)
        self.superseded.append((first, last))
        self._mark_anchor(anchor.checkpoint, anchor.step, seq)
        self.step = anchor.step
        if not anchor.checkpoint:  # restarted from scratch: the stage is entered again
            self.append(StageEntered(step=0, tokens=0, stage=0))
        self.log.commit()

    def _mark_anchor(self, checkpoint: str, step: int, last_seq: int) -> None:
        self.anchor = _Anchor(checkpoint, step, last_seq)
        if _RESUME_CARRIES_STATE:
            self._fold()
            self._anchor_state = self._folded

    def _fold(self) -> None:
        self._folded = fold(self._unfolded, self._folded)
        self._unfolded = []


def write_synthetic_run(
    run_dir: str | os.PathLike[str],
    num_steps: int,
    num_resumes: int = 0,
    checkpoint_every: int = 1000,
    report_interval: int = 100,
    *,
    segment_bytes: int = DEFAULT_SEGMENT_BYTES,
) -> dict:
    """Write a legal synthetic log of `num_steps` steps into the new run directory `run_dir` and
    return what a benchmark needs to know about it (records, superseded ranges, the last step, the
    live checkpoints, seconds taken). The run is left unfinished, as a crash would: resumable."""
    if num_steps < 1 or num_resumes < 0 or checkpoint_every < 1 or report_interval < 1:
        raise ValueError("num_steps, checkpoint_every and report_interval must be >= 1, num_resumes >= 0")
    started = time.perf_counter()
    with EventLog.open(run_dir, "w", segment_bytes=segment_bytes) as log:
        if log.next_seq:
            raise ValueError(f"{run_dir} already holds a log")
        run = _SyntheticRun(log, num_steps, checkpoint_every, report_interval)
        run.start()
        for k in range(num_resumes):
            run.run_to(max(run.step, (k + 1) * num_steps // (num_resumes + 1)))
            run.crash_and_resume()
        run.run_to(num_steps)
        num_records = log.next_seq
    return {
        "num_steps": num_steps,
        "num_records": num_records,
        "num_resumes": num_resumes,
        "superseded": run.superseded,
        "step": run.step,
        "last_checkpoint": run.live[-1] if run.live else "",
        "live_checkpoints": list(run.live),
        "seconds": time.perf_counter() - started,
    }
