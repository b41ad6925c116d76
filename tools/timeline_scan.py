"""One pass over a run's log for `rewind timeline`: everything the summary, the markers and the plot
show, gathered record by record, so that a million-step log is never held.

Each record arrives once, in seq order, with whether a resume superseded it. The curves and the
stage table count the effective records (what still counts after resumes); resumes, stops and
non-finite losses come from the raw log, because they are what happened to the run. What is kept:
- per stage, running figures of its steps and losses (the first and last LOSS_WINDOW_MAX finite
  losses, for the means at its start and end);
- the events that become markers, and the few others the picture needs (evaluations, reference
  refreshes, stack appends, configs): a handful per stage, resume or stop;
- checkpoint steps (listed in full by `--json`), non-finite losses (one marker line each) and the
  steps resumes recomputed (listed per resume);
- with `with_plot`, the bounded buckets of `timeline_buckets`.
The fold of the log (the final state) is computed over the same pass by the caller; `finish` takes it.
"""

from __future__ import annotations

import math
from collections import Counter, deque

from rewind.states.events import (
    CheckpointCommitted,
    ConfigChanged,
    Evaluated,
    Event,
    FadeEnded,
    FadeStarted,
    ForkOrigin,
    NonFiniteLoss,
    OptimizerReset,
    ReferenceRefreshed,
    RunResumed,
    RunStarted,
    RunStopped,
    StackAppended,
    StageEntered,
    StepCommitted,
    Validated,
)
from rewind.tools.timeline_buckets import PointSampler, StepBuckets

# Stage start/end losses are means over this fraction of the stage's steps (1 to LOSS_WINDOW_MAX), so one
# noisy step does not decide them.
LOSS_WINDOW_FRACTION = 0.1
LOSS_WINDOW_MAX = 100


def loss_window(num_finite: int) -> int:
    """How many of a stage's first (last) finite losses its start (end) loss is the mean of."""
    return min(LOSS_WINDOW_MAX, max(1, round(num_finite * LOSS_WINDOW_FRACTION)))

CONTROL_MARKERS = (StageEntered, FadeStarted, FadeEnded, ReferenceRefreshed, OptimizerReset, StackAppended, ConfigChanged)
RAW_MARKERS = (RunResumed, RunStopped, NonFiniteLoss)


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


class StageSteps:
    """The effective steps whose primary stage is one stage, summed up as they come."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.first: StepCommitted | None = None
        self.last: StepCommitted | None = None
        self.num_finite = 0
        self.loss_min: float | None = None
        self.kl_sum = 0.0  # the finite KL terms of the steps that had one (beta > 0)
        self.num_kl = 0
        # The finite KL the steps logged with a beta of 0: a grpo stage's estimate, weighed by its own
        # grpo.kl_beta (rewind.tools.kl_terms), which the mean above leaves out.
        self.own_kl_sum = 0.0
        self.num_own_kl = 0
        # The window is a fraction of the stage's length, known only at its end, and at most
        # LOSS_WINDOW_MAX: keeping that many finite losses from each end is enough.
        self.head: list[float] = []
        self.tail: deque[float] = deque(maxlen=LOSS_WINDOW_MAX)

    def add(self, e: StepCommitted) -> None:
        self.num_steps += 1
        if self.first is None:
            self.first = e
        self.last = e
        if math.isfinite(e.loss):
            self.num_finite += 1
            if len(self.head) < LOSS_WINDOW_MAX:
                self.head.append(e.loss)
            self.tail.append(e.loss)
            if self.loss_min is None or e.loss < self.loss_min:
                self.loss_min = e.loss
        if e.beta > 0 and math.isfinite(e.kl):
            self.kl_sum += e.kl
            self.num_kl += 1
        elif e.beta == 0 and math.isfinite(e.kl):
            self.own_kl_sum += e.kl
            self.num_own_kl += 1

    def losses(self) -> dict:
        window = loss_window(self.num_finite)
        tail = list(self.tail)
        return {
            "loss_start": _mean(self.head[:window]),
            "loss_end": _mean(tail[-window:]) if tail else None,
            "loss_min": self.loss_min,
            "kl_mean": self.kl_sum / self.num_kl if self.num_kl else None,
        }


class Timeline:
    """What `rewind timeline` shows about one run. Feed every record with `add`, then `finish`."""

    def __init__(self, run_dir: str, *, with_plot: bool = False):
        self.run_dir = run_dir
        self.with_plot = with_plot
        self.state = self.config = self.schedule = None  # set by finish()
        self.config_record: RunStarted | ConfigChanged | None = None  # the last effective one
        self.configs: dict = {}  # config_hash -> config, of every RunStarted / ConfigChanged
        self.stages: dict[int, StageSteps] = {}
        self.last_step: StepCommitted | None = None
        self.validated: dict[int, dict[str, float]] = {}  # stage -> the last validation loss per dataset
        self.evaluations: list[Evaluated] = []  # effective, in order: one per boundary
        self.control: list[tuple[int, Event]] = []  # effective CONTROL_MARKERS
        self.raw_markers: list[tuple[int, Event]] = []  # RAW_MARKERS, superseded or not
        # (seq, step) of every superseded StepCommitted: what resumes recomputed, listed per resume by
        # `--json`. As many as the steps lost to crashes, which checkpoints keep few.
        self.redone: list[tuple[int, int]] = []
        self.checkpoint_steps: list[int] = []
        self.checkpoint_tokens: list[int] = []
        self.checkpoint_reasons: Counter = Counter()
        self.num_resumes = 0
        # A fork's origin (its RunStarted's parent) and the tokens its log goes on from (its first
        # RunResumed's, 0 for a fork at step 0): where it parts from its parent.
        self.parent: ForkOrigin | None = None
        self.fork_tokens: int | None = None
        # The plot's bounded series (with_plot only).
        self.steps = StepBuckets() if with_plot else None
        self.superseded_points = PointSampler()
        self.validation_points: dict[str, PointSampler] = {}
        # Post-training steps' own figures (StepCommitted.metrics: a dpo step's margin, a grpo step's
        # reward, ...), by name.
        self.metric_points: dict[str, PointSampler] = {}

    def add(self, seq: int, event: Event, superseded: bool) -> None:
        if isinstance(event, RAW_MARKERS):
            self.raw_markers.append((seq, event))
            self.num_resumes += isinstance(event, RunResumed)
        if isinstance(event, RunStarted | ConfigChanged):
            self.configs[event.config_hash] = event.config
        if isinstance(event, RunStarted) and event.parent is not None:
            self.parent, self.fork_tokens = event.parent, 0 if event.parent.step == 0 else None
        elif isinstance(event, RunResumed) and self.parent is not None and self.fork_tokens is None:
            self.fork_tokens = event.tokens
        if superseded:
            if isinstance(event, StepCommitted):
                self.redone.append((seq, event.step))
                if self.with_plot:
                    self.superseded_points.add(event.tokens, event.loss)
            return
        match event:
            case StepCommitted():
                self._add_step(event)
            case Validated():
                # A validation follows the step it measured (the fold checks it): that step is the
                # last one committed, if any (a fork's log may validate its fork step, not its own).
                last = self.last_step
                stage = last.stage if last is not None and last.step == event.step else 0
                self.validated.setdefault(stage, {}).update(event.losses)
                if self.with_plot:
                    for name, loss in event.losses.items():
                        self.validation_points.setdefault(name, PointSampler()).add(event.tokens, loss)
            case Evaluated():
                self.evaluations.append(event)
            case CheckpointCommitted():
                self.checkpoint_steps.append(event.step)
                self.checkpoint_tokens.append(event.tokens)
                self.checkpoint_reasons[event.reason] += 1
            case RunStarted() | ConfigChanged():
                self.config_record = event
        if isinstance(event, CONTROL_MARKERS):
            self.control.append((seq, event))

    def _add_step(self, e: StepCommitted) -> None:
        stage = self.stages.get(e.stage)
        if stage is None:
            stage = self.stages[e.stage] = StageSteps()
        stage.add(e)
        self.last_step = e
        if self.steps is not None:
            self.steps.add(e)
            for name, value in e.metrics.items():
                self.metric_points.setdefault(name, PointSampler()).add(e.tokens, value)

    def finish(self, state) -> Timeline:
        """The pass is over: `state` is the fold of the whole log."""
        from rewind.states.schedule import Schedule

        if self.config_record is None:
            raise ValueError("the log has no effective RunStarted")
        self.state = state
        self.config = self.config_record.config
        self.schedule = Schedule(self.config, state.features)  # the run's own behaviours (LR warmup)
        return self

    # --- what the summary and the plot read -------------------------------------------------------

    def effective_of(self, kind: type) -> list:
        """The kept effective events of one marker type (or Evaluated), in log order."""
        if kind is Evaluated:
            return list(self.evaluations)
        return [e for _, e in self.control if isinstance(e, kind)]

    def raw_of(self, kind: type) -> list:
        return [e for _, e in self.raw_markers if isinstance(e, kind)]

    def stage_steps(self, stage: int) -> StageSteps:
        return self.stages.get(stage) or StageSteps()
