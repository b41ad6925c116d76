"""The one writer of a run's log, and the one statement of when its records become durable.

Only a returned `EventLog.commit()` is a promise, so *when* to commit decides what a crash can lose.
The rule, enforced here and nowhere else:

- A run's opening records (RunStarted; RunResumed and a ConfigChanged that goes with it) are committed
  before any tensor is computed: a process that dies later resumes from them.
- Every record before a checkpoint is committed before its files are written, and the checkpoint names
  the last of them (`log_seq`): a checkpoint on disk then proves how far the log reached, so a log that
  ends before that lost acknowledged records (rewind.stores.orphans), while a checkpoint no record names
  at the log's end is only what a crash between writing it and recording it leaves.
- A CheckpointCommitted is committed on the spot: a checkpoint exists for rewind only once its record is
  durable, and only then may retention delete older files.
- CheckpointDeleted records are committed before their files are removed, so a crash can leave an
  unnamed directory (an orphan) but never a named checkpoint without files.
- RunStopped and RunFinished are committed at once: the process is about to exit.
- Everything else (steps and their duties) is group-committed when the loop reaches a step boundary
  that is a multiple of `report_interval`: a crash loses at most those steps, which a resume recomputes
  bit for bit from the last checkpoint anyway, and fsync stays off the per-step path.

Every record also goes to the metrics projection (derived data, flushed at each group commit).
"""

from __future__ import annotations

from rewind.states.events import (
    CheckpointCommitted,
    CheckpointDeleted,
    ConfigChanged,
    Event,
    RunFinished,
    RunResumed,
    RunStarted,
    RunStopped,
)
from rewind.states.fold import apply
from rewind.states.state import State
from rewind.stores.eventlog import EventLog
from rewind.stores.metrics import MetricsProjection

_COMMIT_AT_ONCE = (RunStarted, RunResumed, ConfigChanged, CheckpointCommitted, CheckpointDeleted, RunStopped, RunFinished)


class Journal:
    """Appends events to the log (and the metrics projection), applying each to the state."""

    def __init__(self, log: EventLog, metrics: MetricsProjection | None, report_interval: int):
        self.log = log
        self.metrics = metrics
        self.report_interval = report_interval
        self.last_event: Event | None = None  # the record appended last (a checkpoint's snapshot names it)

    def record(self, state: State, event: Event) -> State:
        """Apply `event` (an illegal one raises before anything is written), append it, and commit it
        now if the rule above says so. Returns the new state."""
        new_state = apply(state, event)
        seq = self.log.append(event)
        self.last_event = event
        if self.metrics is not None:
            self.metrics.observe(seq, event)
        if isinstance(event, _COMMIT_AT_ONCE):
            self.commit()
        return new_state

    def at_step_boundary(self, state: State) -> None:
        """The loop is about to run the step with index state.step, every duty of the last one done."""
        if state.step % self.report_interval == 0:
            self.commit()

    def commit(self) -> None:
        self.log.commit()
        if self.metrics is not None:
            self.metrics.flush()

    def durable_seq(self) -> int:
        """The last record the log holds durably (what a checkpoint names, see above)."""
        return self.log.num_committed - 1

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.log.close()


class FollowerJournal:
    """The journal of a sharded run's ranks other than 0: each event is applied as rank 0 records it, and
    nothing is written (rank 0 is the log's one writer). Every rank computes the same events (states/ is
    pure and what a step measures is summed over the ranks first), so their states stay equal."""

    metrics = None
    report_interval = 1
    last_event = None

    def record(self, state: State, event: Event) -> State:
        return apply(state, event)

    def at_step_boundary(self, state: State) -> None:
        pass

    def commit(self) -> None:
        pass

    def durable_seq(self) -> int:
        return -1  # only the writer's checkpoints record it

    def close(self) -> None:
        pass
