"""`rewind diff A B --plot OUT.png`: two runs overlaid in the timeline's panels, so that a KL run and a
no-KL run (or a fork and its parent) are compared in one picture rather than by flipping between two.

Run A is drawn solid, run B dashed, each in its own colour where a panel has one curve per run (loss,
learning rate, KL) and in the task's colour where it has one per task (accuracy, mixture), so a task
reads in the same colour in both runs and the line style says which run. The stage context (boundaries,
fades, refreshes) is A's; where B's boundaries differ they are drawn too, dotted. Both timelines are
read with their bounded series (`tools.timeline_scan`), so two million-step runs plot in seconds.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from matplotlib.ticker import FuncFormatter

from rewind.states.events import Evaluated, ReferenceRefreshed
from rewind.tools.outfile import write_file_atomically
from rewind.tools.plots import _pyplot, dataset_styles, draw_stage_context, format_tokens
from rewind.tools.timeline_plot import LEGEND, StepColumns
from rewind.tools.timeline_scan import Timeline

RUN_COLOURS = {"a": "#1F4E9C", "b": "#D95F02"}
RUN_LINES = {"a": "-", "b": "--"}


def _label(side: str, timeline: Timeline) -> str:
    return f"{side.upper()}: {timeline.config.run.name} ({timeline.run_dir})"


def _task_styles(runs: dict[str, Timeline]) -> dict[str, tuple[str, str]]:
    """Colours by task, taken from A's stages (B's extra tasks after them), as the timeline does."""
    names: list[str] = []
    for timeline in runs.values():
        config = timeline.config
        names += [s.name for mixture in config.training.datasets for s in mixture]
        names += [*config.training.evaluations, *(n for e in timeline.evaluations for n in e.scores)]
    mixtures = [{s.name: s.rate for s in mixture} for mixture in runs["a"].config.training.datasets]
    return dataset_styles(names, mixtures)


def _draw_losses(ax, side: str, timeline: Timeline, steps: StepColumns) -> None:
    if steps.num_steps:
        ax.plot(
            steps.tokens,
            steps.smooth,
            color=RUN_COLOURS[side],
            linestyle=RUN_LINES[side],
            linewidth=1.8,
            label=_label(side, timeline),
        )


def _draw_accuracy(ax, side: str, timeline: Timeline, styles: dict) -> None:
    evaluations = timeline.effective_of(Evaluated)
    for task in sorted({t for e in evaluations for t in e.scores}):
        points = [(e.tokens, e.scores[task]) for e in evaluations if task in e.scores]
        colour, marker = styles.get(task, ("0.4", "o"))
        fill = colour if side == "a" else "white"
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            color=colour,
            linestyle=RUN_LINES[side],
            marker=marker,
            markerfacecolor=fill,
            markersize=5,
            linewidth=1.2,
            label=f"{task} ({side.upper()})",
        )


def _draw_lr(ax, side: str, steps: StepColumns) -> None:
    if steps.num_steps:
        ax.plot(
            steps.start,
            steps.lr,
            color=RUN_COLOURS[side],
            linestyle=RUN_LINES[side],
            linewidth=1.3,
            label=f"learning rate ({side.upper()})",
        )


def _draw_kl(ax, side: str, steps: StepColumns) -> None:
    if steps.num_steps:
        colour, line = RUN_COLOURS[side], RUN_LINES[side]
        ax.plot(
            steps.tokens, steps.kl, color=colour, linestyle=line, linewidth=1.5, label=f"KL ({side.upper()})"
        )
        ax.plot(
            steps.tokens,
            steps.kl * steps.beta,
            color=colour,
            linestyle=":",
            linewidth=1.0,
            label=f"beta x KL ({side.upper()})",
        )


def _draw_mixture(ax, side: str, steps: StepColumns, styles: dict) -> None:
    """Each dataset's share of the batch as a line: stacked areas of two runs cannot be overlaid."""
    if not steps.num_steps:
        return
    x = np.append(steps.start, steps.last_tokens)
    for i, name in enumerate(steps.dataset_names):
        share = np.append(steps.datasets[:, i], steps.datasets[-1, i])
        ax.step(
            x,
            share,
            where="post",
            color=styles.get(name, ("0.4", "o"))[0],
            linestyle=RUN_LINES[side],
            linewidth=1.2,
            label=f"{name} ({side.upper()})",
        )


def plot_comparison(a: Timeline, b: Timeline, out: str | Path) -> Path:
    """Draw two Timelines read `with_plot` into `out`: A solid, B dashed, in the timeline's panels."""
    runs = {"a": a, "b": b}
    if any(t.steps is None for t in runs.values()):
        raise ValueError("both timelines must be read with_plot: they carry the series to draw")
    plt = _pyplot()
    styles = _task_styles(runs)
    columns = {side: StepColumns(t.steps, t.schedule.tokens_per_step) for side, t in runs.items()}
    panels = {"height_ratios": [2.4, 1.5, 1.0, 1.0, 1.2], "hspace": 0.08}
    fig, axes = plt.subplots(5, 1, figsize=(12, 12.5), sharex=True, gridspec_kw=panels)
    ax_loss, ax_eval, ax_lr, ax_kl, ax_mix = axes
    for side, timeline in runs.items():
        steps = columns[side]
        _draw_losses(ax_loss, side, timeline, steps)
        _draw_accuracy(ax_eval, side, timeline, styles)
        _draw_lr(ax_lr, side, steps)
        _draw_kl(ax_kl, side, steps)
        _draw_mixture(ax_mix, side, steps, styles)
    refreshes = a.effective_of(ReferenceRefreshed)
    b_boundaries = [x for x in b.schedule.boundaries[:-1] if x not in set(a.schedule.boundaries[:-1])]
    for i, ax in enumerate(axes):
        draw_stage_context(ax, a.schedule, refreshes, label=i == 0)
        for j, x in enumerate(b_boundaries):
            ax.axvline(
                x,
                color="0.35",
                linestyle=":",
                linewidth=0.8,
                label="B's stage boundary" if i == 0 and j == 0 else None,
            )
        ax.grid(axis="y", color="0.92", linewidth=0.8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(**LEGEND)
    ax_loss.set_ylabel("task loss, smoothed\ncross-entropy, without KL")
    ax_eval.set_ylabel("answer-token accuracy\n(start, stage ends)")
    ax_eval.set_ylim(bottom=0)
    ax_lr.set_ylabel("learning rate")
    ax_lr.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.2g}"))
    ax_kl.set_ylabel("KL to reference\nper token")
    ax_kl.set_ylim(bottom=0)
    ax_mix.set_ylabel("realised data\nmixture")
    ax_mix.set_ylim(0, 1)
    total = max(t.schedule.num_steps * t.schedule.tokens_per_step for t in runs.values())
    ax_mix.set_xlim(0, total * 1.005)
    ax_mix.set_xlabel("training tokens")
    ax_mix.xaxis.set_major_formatter(FuncFormatter(format_tokens))
    ax_loss.set_title(f"A (solid) vs B (dashed)\n{_label('a', a)}\n{_label('b', b)}", fontsize=10)
    path = Path(out)
    image = io.BytesIO()  # the PNG whole, then written whole: exactly `out`, never `out`.png beside it
    fig.savefig(image, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    write_file_atomically(path, image.getvalue())
    return path
