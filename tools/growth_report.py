"""The per-stack table a grown run ends with: what each stage trained and what the model scored then.

One row per stage: the number of stacks the model had, the stack that stage trained (the newest) and
what the stacks under it had become (its growth's trunk choice), the mean training loss over the
stage's last steps (a tenth of them, at least one), and the answer accuracy of every evaluation task
at the stage's end. Read from the effective records alone, so a resumed run prints what a straight
run prints.
"""

from __future__ import annotations

import math

from rewind.states.events import ActivationsCached, Evaluated, Event, StackAppended, StepCommitted


def growth_table(events: list[Event]) -> list[str]:
    """Lines of the table, or [] when the run never grew."""
    grown = [e for e in events if isinstance(e, StackAppended)]
    if not grown:
        return []
    cached = {e.version for e in events if isinstance(e, ActivationsCached)}
    evaluations = {e.boundary: e for e in events if isinstance(e, Evaluated) and e.boundary >= 0}
    losses: dict[int, list[float]] = {}
    for e in events:
        if isinstance(e, StepCommitted) and not e.skipped:
            losses.setdefault(e.stage, []).append(e.loss)
    tasks = next((list(e.scores) for e in evaluations.values()), [])
    header = f"{'stage':>5} {'stacks':>6}  {'trained (trunk under it)':<34} {'loss':>7} " + " ".join(f"{t:>8}" for t in tasks)
    lines = ["per stack: the stack each stage trained, its loss, and every task's accuracy at the stage's end", header]
    for stage in sorted(set(losses) | set(evaluations)):
        joined = [e for e in grown if _stage_of(e, events) <= stage]
        if joined:
            last = joined[-1]
            version = len(joined)
            trunk = last.trunk + (", cached" if version in cached else "")
            trained = f"stack {last.stack} ({last.position}, {trunk})"
        else:
            trained = "stack 0 (initial, all train)"
        tail = losses.get(stage, [])[-max(1, len(losses.get(stage, [])) // 10) :]
        loss = sum(tail) / len(tail) if tail else math.nan
        scores = evaluations.get(stage)
        cells = " ".join(f"{scores.scores.get(t, math.nan) if scores else math.nan:>8.3f}" for t in tasks)
        lines.append(f"{stage:>5} {1 + len(joined):>6}  {trained:<34} {loss:>7.4f} {cells}")
    return lines


def _stage_of(growth: StackAppended, events: list[Event]) -> int:
    """The stage a growth trained in: that of the first step after it."""
    for e in events:
        if isinstance(e, StepCommitted) and e.step > growth.step:
            return e.stage
    return 1 << 30
