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
    """Lines of the table, or [] when the model never grew. `events`: a run's effective records (a
    fork's included: its stacks come from the state its parent handed it)."""
    from rewind.states.fold import apply
    from rewind.states.state import State

    state, rows, losses = State(), {}, {}
    growths = {e.stack: e for e in events if isinstance(e, StackAppended)}
    cached = {e.version for e in events if isinstance(e, ActivationsCached)}
    for event in events:
        state = apply(state, event)
        if isinstance(event, StepCommitted) and not event.skipped:
            losses.setdefault(event.stage, []).append(event.loss)
            rows.setdefault(event.stage, {})["layout"] = state.layout
        if isinstance(event, Evaluated) and event.boundary >= 0:
            rows.setdefault(event.boundary, {})["scores"] = event.scores
    if state.layout is None:
        return []
    tasks = next((list(r["scores"]) for r in rows.values() if "scores" in r), [])
    header = f"{'stage':>5} {'stacks':>6}  {'trained (trunk under it)':<34} {'loss':>7} " + " ".join(f"{t:>8}" for t in tasks)
    lines = ["per stack: the stack each stage trained, its loss, and every task's accuracy at the stage's end", header]
    for stage in sorted(rows):
        layout = rows[stage].get("layout")
        stacks = 1 if layout is None else len(layout.stacks)
        trained = _trained(layout, growths, cached)
        tail = losses.get(stage, [])[-max(1, len(losses.get(stage, [])) // 10) :]
        loss = sum(tail) / len(tail) if tail else math.nan
        scores = rows[stage].get("scores", {})
        cells = " ".join(f"{scores.get(t, math.nan):>8.3f}" for t in tasks)
        lines.append(f"{stage:>5} {stacks:>6}  {trained:<34} {loss:>7.4f} {cells}")
    return lines


def _trained(layout, growths: dict[int, StackAppended], cached: set[int]) -> str:
    """'stack 2 (append, lora)': the newest stack and how it joined."""
    if layout is None:
        return "stack 0 (initial, all train)"
    newest = max(s.stack for s in layout.stacks)
    growth = growths.get(newest)
    if growth is None:  # joined in a parent run, before this fork
        return f"stack {newest} (joined before the fork)"
    trunk = growth.trunk + (", cached" if layout.version in cached else "")
    return f"stack {newest} ({growth.position}, {trunk})"
