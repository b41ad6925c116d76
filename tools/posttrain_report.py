"""The per-stage table a post-training run ends with: what each stage's model does on held-out prompts.

One table per dataset the boundary evaluations measured (rewind.engine.posttrain.posttrain_figures), a row per
boundary (before training, then the end of each stage, named by the config in force): the stage's
strategy, its answer-token accuracy and held-out loss (the response's loss: an sft stage's objective),
the stage's training loss at its end (the loss its strategy optimises: `rewind timeline`'s "task loss
end", a mean over the last tenth of its steps, 1 to 100), pass@1, pass@G and the mean sampled reward, the win rate against the stage's
reference, and after a dpo stage its implicit-reward accuracy and margin on held-out pairs. "-" where a
figure does not apply (no reference yet, not a dpo stage). Read from the effective records alone, so a
resumed run prints what a straight run prints. A run without an evaluation before training (one whose
config leaves training.evaluations empty) has no "(start)" row, and a last line says why and what to set.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence

from rewind.states.config import Config
from rewind.states.events import Evaluated, Event, StepCommitted
from rewind.tools.timeline_scan import loss_window

# accuracy: answer-token; loss: held-out; train: the stage's own loss; win: against the stage's reference
_COLUMNS = ("accuracy", "loss", "train", "pass@1", "pass@G", "reward", "win", "dpo acc", "margin")


def posttrain_tables(
    evaluations: Sequence[Evaluated], config: Config, train_losses: Mapping[int, float | None]
) -> list[str]:
    """Lines of the tables, or [] when no boundary measured post-training figures. `train_losses`: each
    stage's training loss at its end (`end_losses`)."""
    names = list(dict.fromkeys(n for e in evaluations for n in e.posttraining))
    if not names:
        return []
    lines: list[str] = []
    for name in names:
        rows = [e.posttraining.get(name, {}) for e in evaluations]
        groups = sorted({int(k[5:]) for row in rows for k in row if k.startswith("pass@") and k != "pass@1"})
        sampled = (
            f"pass@1 greedy; pass@G and reward over G = {', '.join(map(str, groups))} samples;"
            if groups
            else "no prompts with answers, its pairs only;"
        )
        lines += [""] if lines else []
        lines += [
            f"post-training, {name}'s held-out prompts: {sampled}",
            "  train: the stage's own loss; win: greedy, against the stage's reference (ties count half)",
            f"{'after stage':>12} {'strategy':>8} " + " ".join(f"{c:>8}" for c in _COLUMNS),
        ]
        for e, figures in zip(evaluations, rows, strict=True):
            stage = config.stages[e.boundary] if 0 <= e.boundary < len(config.stages) else None
            label = "(start)" if stage is None else (stage.name or str(e.boundary))
            at_g = next((v for k, v in figures.items() if k.startswith("pass@") and k != "pass@1"), None)
            values = [
                e.scores.get(name), e.losses.get(name), train_losses.get(e.boundary) if stage else None,
                figures.get("pass@1"), at_g, figures.get("reward"), figures.get("win_rate"),
                figures.get("dpo_accuracy"), figures.get("dpo_margin"),
            ]  # fmt: skip
            cells = " ".join(f"{'-':>8}" if v is None else f"{v:>8.3f}" for v in values)
            lines.append(f"{label:>12} {stage.strategy if stage else '-':>8} {cells}")
    return lines + missing_start(evaluations, config, names)


def missing_start(evaluations: Sequence[Evaluated], config: Config, names: list[str]) -> list[str]:
    """The line saying why the tables have no "(start)" row, or [] when they have one. A run evaluates
    before training only when training.evaluations names datasets (rewind.states.mutators.run_started),
    while the stage boundaries are evaluated either way (on the datasets the stages train on)."""
    if any(e.boundary < 0 for e in evaluations):
        return []
    if config.training.evaluations:
        return ['no "(start)" row: this run was started without an evaluation before training']
    evaluated = list(dict.fromkeys(n for e in evaluations for n in e.losses)) or names  # as the boundaries
    return [
        'no "(start)" row: a run evaluates before training only when its config sets training.evaluations '
        f"(evaluations = {json.dumps(evaluated)} under [training] gives the row)"
    ]


def end_losses(events: Sequence[Event]) -> dict[int, float]:
    """Each stage's mean training loss over its last finite steps: a tenth of them, 1 to 100 (the
    window `rewind timeline` takes its "task loss end" over)."""
    losses: dict[int, list[float]] = {}
    for event in events:
        if isinstance(event, StepCommitted) and not event.skipped and math.isfinite(event.loss):
            losses.setdefault(event.stage, []).append(event.loss)
    return {stage: statistics.fmean(values[-loss_window(len(values)) :]) for stage, values in losses.items()}
