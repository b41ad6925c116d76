"""`rewind timeline --plot`: the one picture of a run. Four panels over training tokens:

(a) training loss: raw per-step loss faint, a smoothed line bold in the colour of each step's primary
    stage, validation losses per dataset, and the steps a resume superseded in faint grey;
(b) boundary evaluation scores per task (where forgetting shows);
(c) learning rate (left axis) and KL weight beta (right axis), as trained, then as planned;
(d) the realised data mixture per stage (StepCommitted rows / batch) as a stacked area.

Every panel carries the stage context (boundaries, fade windows, reference refreshes) and the run's
markers (stack appends, resumes, checkpoints, non-finite losses). Long runs are reduced to at most
MAX_POINTS buckets per curve with numpy (min/max envelopes for the raw loss), so a million steps plot
in seconds.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, ScalarFormatter

from rewind.states.events import (
    CheckpointCommitted,
    Evaluated,
    NonFiniteLoss,
    ReferenceRefreshed,
    RunResumed,
    RunStopped,
    StackAppended,
    StepCommitted,
    Validated,
)
from rewind.tools.plots import (
    MAX_POINTS,
    _pyplot,
    dataset_styles,
    draw_stage_context,
    format_tokens,
    stage_colour,
)
from rewind.tools.state_cmd import status_text
from rewind.tools.timeline_cmd import History

RESUME_COLOUR = "#222222"
BETA_COLOUR = "#C00000"
# Hollow rings: after an exact resume the recomputed loss lies right under them.
SUPERSEDED = {"linestyle": "none", "marker": "o", "markersize": 6, "markerfacecolor": "none", "color": "0.6"}
PLANNED = {"linestyle": "--", "linewidth": 0.9, "alpha": 0.5}  # the part of the run not trained yet
MAX_RESUME_LABELS = 8  # more resumes than this get lines only: their labels would pile up
# Right of the panels, past the KL axis of panel (c), at the same place for every panel.
LEGEND = {"loc": "upper left", "bbox_to_anchor": (1.085, 1.0), "fontsize": 8, "frameon": False}
# A loss panel whose values span more than this ratio gets a log axis, so validation losses of tasks not
# trained yet do not squash the training curve.
LOG_SCALE_RATIO = 2.5


def bucket_edges(num_points: int, max_points: int = MAX_POINTS) -> np.ndarray:
    """Start indices of at most max_points contiguous buckets covering range(num_points)."""
    num_buckets = min(num_points, max_points)
    return np.unique(np.linspace(0, num_points, num_buckets + 1).astype(np.int64)[:-1])


def bucket_mean(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Mean of the finite values of each bucket (NaN where a bucket has none). values: (n,) or (n, k)."""
    finite = np.isfinite(values)
    sums = np.add.reduceat(np.where(finite, values, 0.0), edges, axis=0)
    counts = np.add.reduceat(finite.astype(np.float64), edges, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums / counts


def rolling_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average over the finite values (skipped steps carry NaN losses)."""
    finite = np.isfinite(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(finite)])
    index = np.arange(len(values))
    low = np.clip(index - window // 2, 0, len(values))
    high = np.clip(index + window // 2 + 1, 0, len(values))
    with np.errstate(invalid="ignore", divide="ignore"):
        return (sums[high] - sums[low]) / (counts[high] - counts[low])


class StepArrays:
    """The effective StepCommitted stream as columns: x = tokens after the step, start = before it."""

    def __init__(self, steps: list[StepCommitted], num_stages: int, tokens_per_step: int):
        self.tokens = np.array([e.tokens for e in steps], dtype=np.float64)
        self.start = self.tokens - tokens_per_step
        self.loss = np.array([e.loss for e in steps], dtype=np.float64)
        self.stage = np.array([e.stage for e in steps], dtype=np.int64)
        self.lr = np.array([e.lr for e in steps], dtype=np.float64)
        self.beta = np.array([e.beta for e in steps], dtype=np.float64)
        rows = np.zeros((len(steps), num_stages))
        if steps and all(len(e.rows) == num_stages for e in steps):
            rows[:] = [e.rows for e in steps]
        else:
            for i, e in enumerate(steps):  # a fork may have added stages: older rows are shorter
                rows[i, : len(e.rows)] = e.rows
        totals = rows.sum(axis=1, keepdims=True)
        self.mixture = np.divide(rows, totals, out=np.zeros_like(rows), where=totals > 0)
        self.edges = bucket_edges(len(steps))


def _stage_runs(stages: np.ndarray) -> list[tuple[int, int, int]]:
    """(stage, first index, last index + 1) of each run of equal stages."""
    if len(stages) == 0:
        return []
    cuts = np.flatnonzero(np.diff(stages)) + 1
    bounds = [0, *cuts.tolist(), len(stages)]
    return [(int(stages[a]), a, b) for a, b in itertools.pairwise(bounds)]


def _stage_label(history: History, stage: int) -> str:
    datasets = history.config.training.datasets
    names = " + ".join(s.name for s in datasets[stage]) if stage < len(datasets) else ""
    return f"stage {stage}: {names}"


def _draw_loss(ax, history: History, steps: StepArrays, styles: dict) -> None:
    num_steps = len(steps.loss)
    if num_steps:
        window = max(1, round(num_steps / 40))  # about 40 windows across the run, however long
        smooth = rolling_mean(steps.loss, window)
        edges = steps.edges
        reduced = len(edges) < num_steps
        x = steps.tokens[edges]
        stages = steps.stage[edges]
        if reduced:  # the envelope of each bucket stands in for its raw steps
            low = np.fmin.reduceat(steps.loss, edges)
            high = np.fmax.reduceat(steps.loss, edges)
        labelled: set[int] = set()
        for stage, a, b in _stage_runs(stages):
            colour = stage_colour(stage)
            end = min(b + 1, len(x))  # overlap one point so the coloured pieces join
            if reduced:
                ax.fill_between(x[a:end], low[a:end], high[a:end], color=colour, alpha=0.18, linewidth=0)
            else:
                ax.plot(x[a:end], steps.loss[edges][a:end], color=colour, alpha=0.3, linewidth=0.8)
            label = _stage_label(history, stage) if stage not in labelled else None
            labelled.add(stage)
            ax.plot(x[a:end], smooth[edges][a:end], color=colour, linewidth=2.0, label=label)
    superseded = [e for _, e in history.superseded_records(StepCommitted)]
    if superseded:
        xs = np.array([e.tokens for e in superseded], dtype=np.float64)
        ys = np.array([e.loss for e in superseded], dtype=np.float64)
        keep = bucket_edges(len(xs))
        ax.plot(xs[keep], ys[keep], **SUPERSEDED, zorder=3, label="superseded, recomputed after resume")
    validations = history.effective_of(Validated)
    for name in [n for n in styles if any(n in v.losses for v in validations)]:
        points = [(v.tokens, v.losses[name]) for v in validations if name in v.losses]
        keep = bucket_edges(len(points))
        colour, marker = styles[name]
        xs, ys = [points[i][0] for i in keep], [points[i][1] for i in keep]
        ax.plot(xs, ys, color=colour, marker=marker, markersize=4, linewidth=0.8, label=f"validation: {name}")
    low_y, high_y = ax.dataLim.intervaly
    if num_steps and low_y > 0 and high_y / low_y > LOG_SCALE_RATIO:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter("")
    ax.set_ylabel("training loss" + (" (log)" if ax.get_yscale() == "log" else ""))
    if num_steps == 0:
        ax.text(0.5, 0.5, "no steps committed yet", transform=ax.transAxes, ha="center", color="0.4")


def _draw_evaluations(ax, history: History, styles: dict) -> None:
    evaluations = history.effective_of(Evaluated)
    tasks = [t for t in styles if any(t in e.scores for e in evaluations)]
    for task in tasks:
        points = [(e.tokens, e.scores[task]) for e in evaluations if task in e.scores]
        colour, marker = styles[task]
        xs, ys = [p[0] for p in points], [p[1] for p in points]
        ax.plot(xs, ys, color=colour, marker=marker, markersize=5, linewidth=1.2, label=task)
    if not tasks:
        why = "no evaluation tasks configured" if not history.config.training.evaluations else "none yet"
        ax.text(0.5, 0.5, f"boundary evaluations: {why}", transform=ax.transAxes, ha="center", color="0.4")
    best = max((s for e in evaluations for s in e.scores.values()), default=0.0)
    ax.set_ylim(0, best * 1.15 if best > 0 else 1.0)  # headroom for the markers of the best score
    ax.set_ylabel("evaluation score\n(at stage ends)")


def _draw_lr_beta(ax, history: History, steps: StepArrays) -> list:
    """LR and beta as trained; the planned rest of the run dashed. Returns the twin axis."""
    schedule, state = history.schedule, history.state
    edges = steps.edges
    ax.plot(steps.start[edges], steps.lr[edges], color="black", linewidth=1.3, label="learning rate")
    twin = ax.twinx()
    if len(edges):  # beta holds for the whole last step: draw it to that step's end
        x = np.append(steps.start[edges], steps.tokens[-1])
        beta = np.append(steps.beta[edges], steps.beta[-1])
        twin.step(x, beta, where="post", color=BETA_COLOUR, linewidth=1.3, label="KL beta")
    if not state.finished and state.step < schedule.num_steps:
        rest = np.unique(np.linspace(state.step, schedule.num_steps - 1, MAX_POINTS).astype(np.int64))
        x = rest * schedule.tokens_per_step
        planned_lr = [schedule.lr(int(k)) for k in rest]
        ax.plot(x, planned_lr, color="black", **PLANNED, label="planned (not trained yet)")
        twin.step(x, [schedule.beta(int(k)) for k in rest], where="post", color=BETA_COLOUR, **PLANNED)
    ax.set_ylabel("learning rate")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.2g}"))
    twin.set_ylabel("KL weight beta", color=BETA_COLOUR)
    twin.set_ylim(bottom=0, top=max(max(schedule.betas), 1e-3) * 1.3)
    twin.tick_params(axis="y", colors=BETA_COLOUR)
    return twin


def _draw_mixture(ax, steps: StepArrays) -> None:
    ax.set_ylim(0, 1)
    ax.set_ylabel("realised data\nmixture")
    if len(steps.mixture) == 0:
        return
    shares = bucket_mean(steps.mixture, steps.edges)
    shares = np.vstack([shares, shares[-1:]])  # the last step's mixture holds to its end
    x = np.append(steps.start[steps.edges], steps.tokens[-1])
    num_stages = shares.shape[1]
    colours, labels = (
        [stage_colour(i) for i in range(num_stages)],
        [f"stage {i} rows" for i in range(num_stages)],
    )
    ax.stackplot(x, shares.T, colors=colours, alpha=0.85, labels=labels)


def _draw_markers(ax, history: History, *, label: bool) -> None:
    """Stack appends, resumes, checkpoint ticks and non-finite losses on one panel."""
    at_bottom = ax.get_xaxis_transform()  # x in data, y in axes fraction
    for i, e in enumerate(history.effective_of(StackAppended)):
        first = label and i == 0
        ax.axvline(
            e.tokens,
            color="#6A3D9A",
            linestyle="-.",
            linewidth=1.2,
            label="stack appended" if first else None,
        )
    resumes = history.raw_of(RunResumed)
    for i, e in enumerate(resumes):
        ax.axvline(
            e.tokens,
            color=RESUME_COLOUR,
            linewidth=1.2,
            alpha=0.8,
            label="resume" if label and i == 0 else None,
        )
        if label and len(resumes) <= MAX_RESUME_LABELS:
            text = f" resume @ step {e.step:,}"
            ax.text(e.tokens, 0.98, text, transform=at_bottom, rotation=90, va="top", ha="right", fontsize=7)
    checkpoints = np.array([e.tokens for e in history.effective_of(CheckpointCommitted)], dtype=np.float64)
    if len(checkpoints):
        total = max(history.schedule.num_steps * history.schedule.tokens_per_step, 1)
        _, first = np.unique(
            np.round(checkpoints / total * MAX_POINTS), return_index=True
        )  # a tick per pixel
        ticks = {"linestyle": "none", "marker": "|", "markersize": 8, "markeredgewidth": 1.3, "color": "0.3"}
        y = np.full(len(first), 0.035)
        ax.plot(checkpoints[first], y, **ticks, transform=at_bottom, label="checkpoint" if label else None)
    bad = [e.tokens for e in history.raw_of(NonFiniteLoss)]
    if bad:
        cross = {"linestyle": "none", "marker": "x", "markersize": 7, "color": "#D00000"}
        ax.plot(
            bad, [0.93] * len(bad), **cross, transform=at_bottom, label="non-finite loss" if label else None
        )


def _draw_stops(ax, history: History) -> None:
    stops = [e.tokens for e in history.raw_of(RunStopped)]
    if stops:
        triangle = {
            "linestyle": "none",
            "marker": "v",
            "markersize": 7,
            "color": RESUME_COLOUR,
            "clip_on": False,
        }
        ax.plot(stops, [1.0] * len(stops), **triangle, transform=ax.get_xaxis_transform(), label="stopped")


def plot_timeline(history: History, out: str | Path) -> Path:
    plt = _pyplot()
    schedule, state, config = history.schedule, history.state, history.config
    tps = schedule.tokens_per_step
    steps = StepArrays(history.effective_of(StepCommitted), schedule.num_stages, tps)
    refreshes = history.effective_of(ReferenceRefreshed)  # all that draw_stage_context looks at
    names = [s.name for mixture in config.training.datasets for s in mixture] + [*config.training.evaluations]
    names += [n for e in history.effective_of(Validated) for n in e.losses]
    names += [n for e in history.effective_of(Evaluated) for n in e.scores]
    mixtures = [{s.name: s.rate for s in mixture} for mixture in config.training.datasets]
    styles = dataset_styles(names, mixtures)

    panels = {"height_ratios": [2.6, 1.5, 1.1, 1.0], "hspace": 0.08}
    fig, axes = plt.subplots(4, 1, figsize=(12, 10.5), sharex=True, gridspec_kw=panels)
    ax_loss, ax_eval, ax_lr, ax_mix = axes
    _draw_loss(ax_loss, history, steps, styles)
    _draw_evaluations(ax_eval, history, styles)
    twin = _draw_lr_beta(ax_lr, history, steps)
    _draw_mixture(ax_mix, steps)
    total = schedule.num_steps * tps
    for i, ax in enumerate(axes):
        draw_stage_context(ax, schedule, refreshes, label=i == 0)
        _draw_markers(ax, history, label=i == 0)
        if not state.finished and state.tokens < total:
            hatched = {"facecolor": "none", "edgecolor": "0.85", "hatch": "//", "linewidth": 0, "zorder": 0}
            ax.axvspan(state.tokens, total, **hatched, label="not trained yet" if i == 0 else None)
        ax.grid(axis="y", color="0.92", linewidth=0.8)
    _draw_stops(ax_loss, history)

    handles, labels = ax_lr.get_legend_handles_labels()
    twin_handles, twin_labels = twin.get_legend_handles_labels()
    ax_lr.legend(handles + twin_handles, labels + twin_labels, **LEGEND)
    for ax in (ax_loss, ax_eval, ax_mix):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(**LEGEND)
    ax_mix.set_xlim(0, total * 1.005)  # room for the markers of the final evaluation
    ax_mix.set_xlabel("training tokens")
    ax_mix.xaxis.set_major_formatter(FuncFormatter(format_tokens))
    top = ax_loss.secondary_xaxis("top", functions=(lambda t: t / tps, lambda s: s * tps))
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_xlabel("optimizer steps", fontsize=9)
    num_resumes = len(history.raw_of(RunResumed))
    ax_loss.set_title(
        f"{config.run.name} — {status_text(state)}\n"
        f"step {state.step:,} of {schedule.num_steps:,}, {state.tokens:,} tokens, "
        f"{num_resumes} resume{'s' if num_resumes != 1 else ''}",
        fontsize=11,
    )
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
