"""`rewind diff A B --plot OUT.png`: two runs overlaid in the timeline's panels, so that a KL run and a
no-KL run (or a fork and its parent) are compared in one picture rather than by flipping between two.

Run A is drawn solid, run B dashed, each in its own colour where a panel has one curve per run (loss,
learning rate, KL) and in the task's colour where it has one per task (accuracy, mixture), so a task
reads in the same colour in both runs and the line style says which run. Each run is named by its run
name (by its directory where the two share one, as a fork and its parent do). Under the loss, B - A of
it at the tokens both runs trained. A fork's point of departure is marked on every panel. The stage
context (boundaries, fades, refreshes) is A's; where B's boundaries differ they are drawn too, dotted.
Both timelines are read with their bounded series (`tools.timeline_scan`), so two million-step runs
plot in seconds.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from matplotlib.ticker import FuncFormatter

from rewind.states.events import Evaluated, ReferenceRefreshed, StackAppended
from rewind.tools.drawable import Undrawn, drawable_steps
from rewind.tools.kl_terms import RunKl
from rewind.tools.outfile import write_file_atomically
from rewind.tools.plots import dataset_styles, draw_stage_context, format_tokens, pyplot
from rewind.tools.timeline_buckets import StepColumns, runs_of
from rewind.tools.timeline_plot import LEGEND, KlWeights, evaluation_points
from rewind.tools.timeline_scan import Timeline

RUN_COLOURS = {"a": "#1F4E9C", "b": "#D95F02"}
RUN_LINES = {"a": "-", "b": "--"}
FORK = {"color": "#111111", "linestyle": (0, (6, 2, 1, 2)), "linewidth": 1.5}


def run_names(runs: dict[str, Timeline]) -> dict[str, str]:
    """What each run is called in the picture: its run name; where both share one (a fork keeps its
    parent's), its directory's name, then its path; the same run twice is A and B."""
    for name_of in (lambda t: t.config.run.name, lambda t: Path(t.run_dir).name, lambda t: str(t.run_dir)):
        names = {side: name_of(timeline) for side, timeline in runs.items()}
        if names["a"] != names["b"]:
            return names
    return {side: f"{names[side]} ({side.upper()})" for side in runs}


def fork_points(runs: dict[str, Timeline], names: dict[str, str], child: str) -> list[tuple[int, str]]:
    """(tokens, what) where a run's log parts from its parent: the other run when `child` names it."""
    points = []
    for side, timeline in runs.items():
        origin = timeline.parent
        if origin is None or timeline.fork_tokens is None:
            continue
        parent = names["b" if side == "a" else "a"] if side == child else origin.run
        points.append((timeline.fork_tokens, f"{names[side]} forked from {parent} at step {origin.step:,}"))
    return points


def loss_difference(a: StepColumns, b: StepColumns) -> dict[str, np.ndarray]:
    """B - A of the task loss at the tokens where both runs have a step (a bucket's first, in a long
    run): per step ("raw") and smoothed, with each point's pair of segments (a piece per pair is drawn,
    so no line crosses a jump in either run)."""
    tokens, ia, ib = np.intersect1d(a.tokens, b.tokens, assume_unique=True, return_indices=True)
    return {
        "tokens": tokens,
        "raw": b.loss[ib] - a.loss[ia],
        "smooth": b.smooth[ib] - a.smooth[ia],
        "piece": np.cumsum(
            (np.diff(a.segment[ia], prepend=a.segment[ia][:1]) != 0)
            | (np.diff(b.segment[ib], prepend=b.segment[ib][:1]) != 0)
        ),
    }


def _task_styles(runs: dict[str, Timeline]) -> dict[str, tuple[str, str]]:
    """Colours by task, taken from A's stages (B's extra tasks after them), as the timeline does."""
    names: list[str] = []
    for timeline in runs.values():
        config = timeline.config
        names += [s.name for stage in config.stages for s in stage.datasets]
        names += [*config.training.evaluations, *(n for e in timeline.evaluations for n in e.scores)]
    mixtures = [{s.name: s.rate for s in stage.datasets} for stage in runs["a"].config.stages]
    return dataset_styles(names, mixtures)


def _draw_losses(ax, side: str, name: str, steps: StepColumns) -> None:
    for i, (_, a, b) in enumerate(runs_of(steps.segment)):  # a piece per segment, as in the timeline
        ax.plot(
            steps.tokens[a:b],
            steps.smooth[a:b],
            color=RUN_COLOURS[side],
            linestyle=RUN_LINES[side],
            linewidth=1.8,
            label=f"{side.upper()}: {name}" if i == 0 else None,
            gid=f"loss {side}",
        )


def _draw_difference(ax, a: StepColumns, b: StepColumns) -> None:
    ax.axhline(0.0, color="0.5", linewidth=0.8)
    ax.set_ylabel("task loss\nB - A")
    delta = loss_difference(a, b)
    if len(delta["tokens"]) == 0:
        ax.text(
            0.5,
            0.5,
            "no step at the same tokens in both runs",
            transform=ax.transAxes,
            ha="center",
            color="0.4",
        )
        return
    if not (a.reduced or b.reduced):  # single steps: the per-step difference is exact
        ax.plot(delta["tokens"], delta["raw"], color="0.3", alpha=0.35, linewidth=0.8, label="B - A per step")
    for i, (_, start, end) in enumerate(runs_of(delta["piece"])):
        ax.plot(
            delta["tokens"][start:end],
            delta["smooth"][start:end],
            color="black",
            linewidth=1.6,
            label="B - A smoothed" if i == 0 else None,
            gid="difference",
        )


def _draw_accuracy(ax, side: str, name: str, timeline: Timeline, styles: dict, undrawn: Undrawn) -> None:
    """Points where each task was measured (start, stage ends): A filled, B a larger ring, so an equal
    score shows both."""
    points = evaluation_points(timeline.effective_of(Evaluated), "scores")
    for task in sorted(points):
        colour, marker = styles.get(task, ("0.4", "o"))
        ax.plot(
            *undrawn.points(points[task], "accuracy"),
            color=colour,
            linestyle="none",
            marker=marker,
            markerfacecolor=colour if side == "a" else "none",
            markersize=6 if side == "a" else 10,
            clip_on=False,  # the one before training stands on the left edge
            zorder=3,
            label=f"{task} ({name})",
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


def _draw_kl(ax, side: str, timeline: Timeline, steps: StepColumns) -> None:
    """The run's KL and the part its penalty adds to the objective: beta x KL, a grpo stage's
    grpo.kl_beta x its estimate (rewind.tools.kl_terms); blank over dpo steps, which compute no KL."""
    if steps.num_steps:
        colour, line = RUN_COLOURS[side], RUN_LINES[side]
        weights = KlWeights(timeline.config.stages)
        kl = np.where(weights.is_dpo[steps.stage], np.nan, steps.kl)
        ax.plot(steps.tokens, kl, color=colour, linestyle=line, linewidth=1.5, label=f"KL ({side.upper()})")
        weight = "weight" if any(weights.grpo) else "beta"  # the weight: beta, or grpo.kl_beta in grpo stages
        ax.plot(
            steps.tokens,
            kl * weights.of(steps.stage, steps.beta),
            color=colour,
            linestyle=":",
            linewidth=1.0,
            label=f"{weight} x KL ({side.upper()})",
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


def comparison_figure(a: Timeline, b: Timeline, child: str = ""):
    """Two Timelines read `with_plot`, A solid, B dashed, as a matplotlib Figure whose panels are
    labelled (Axes.get_label): loss, difference, accuracy, lr, kl, mixture. `child`: "a" or "b" where
    that run is a fork of the other (as `rewind diff` found), "" otherwise."""
    runs = {"a": a, "b": b}
    if any(t.steps is None for t in runs.values()):
        raise ValueError("both timelines must be read with_plot: they carry the series to draw")
    plt = pyplot()
    styles = _task_styles(runs)
    names = run_names(runs)
    columns, undrawn = {}, Undrawn()  # a figure no axis holds (1e308, infinite) is left out, as in timeline
    for side, t in runs.items():
        cuts = [e.tokens for e in [*t.effective_of(StackAppended), *t.effective_of(ReferenceRefreshed)]]
        columns[side] = drawable_steps(t.steps, t.schedule.tokens_per_step, cuts, undrawn)
    heights = {"loss": 2.4, "difference": 1.1, "accuracy": 1.5, "lr": 1.0, "kl": 1.0, "mixture": 1.2}
    panels = {"height_ratios": list(heights.values()), "hspace": 0.08}
    fig, axes = plt.subplots(len(heights), 1, figsize=(12, 14.5), sharex=True, gridspec_kw=panels)
    for name, ax in zip(heights, axes, strict=True):
        ax.set_label(name)
    ax_loss, ax_delta, ax_eval, ax_lr, ax_kl, ax_mix = axes
    for side, timeline in runs.items():
        steps = columns[side]
        _draw_losses(ax_loss, side, names[side], steps)
        _draw_accuracy(ax_eval, side, names[side], timeline, styles, undrawn)
        _draw_lr(ax_lr, side, steps)
        _draw_kl(ax_kl, side, timeline, steps)
        _draw_mixture(ax_mix, side, steps, styles)
    _draw_difference(ax_delta, columns["a"], columns["b"])
    refreshes = a.effective_of(ReferenceRefreshed)
    b_boundaries = [x for x in b.schedule.boundaries[:-1] if x not in set(a.schedule.boundaries[:-1])]
    forks = fork_points(runs, names, child)
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
        for x, what in forks:
            ax.axvline(x, **FORK, label=what if i == 0 else None, gid="fork")
        ax.grid(axis="y", color="0.92", linewidth=0.8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(**LEGEND)
    stages = [*a.config.stages, *b.config.stages]
    ax_loss.set_ylabel(f"task loss, smoothed\n{RunKl(stages).loss_meaning()}")
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
    title = [f"{names['a']} (A, solid) vs {names['b']} (B, dashed)"]
    title += [f"{side.upper()}: {t.run_dir}" for side, t in runs.items() if str(t.run_dir) != names[side]]
    ax_loss.set_title("\n".join(title), fontsize=10)
    undrawn.note(fig)
    return fig


def plot_comparison(a: Timeline, b: Timeline, out: str | Path, child: str = "") -> Path:
    """Draw `comparison_figure` into exactly `out` (a PNG whatever its name ends in), written whole."""
    fig = comparison_figure(a, b, child)
    path = Path(out)
    image = io.BytesIO()  # the PNG whole, then written whole: exactly `out`, never `out`.png beside it
    fig.savefig(image, format="png", dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    write_file_atomically(path, image.getvalue())
    return path
