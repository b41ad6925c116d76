"""`rewind timeline --plot`: the one picture of a run. Five panels over training tokens (six for a run
that scores running text):

(a) the task loss, each step's stage's own (cross-entropy on the batch's target tokens, whose objective
    adds beta x KL, drawn in (d); a dpo stage's DPO loss; a grpo stage's policy loss, its kl_beta x KL
    term included: rewind.tools.kl_terms.RunKl.loss_meaning): raw per-step loss faint, a smoothed line
    bold in the colour of each step's primary stage (averaged within a stage and between growths only: a
    jump at a boundary stays a jump), validation losses per dataset, and the steps a resume superseded in
    grey;
(+) bits per byte of each held-out text, before training and at each stage end, where the run
    scores running text (its headline figure);
(b) answer-token accuracy per evaluation task, before training (the baseline) and at each stage end
    (where forgetting shows): points where it was measured, nothing drawn between;
(c) learning rate (left axis) and the KL penalty's weight (right axis), as trained, then as planned:
    beta, a grpo stage's grpo.kl_beta (rewind.tools.kl_terms);
(d) the KL penalty itself, KL(policy || reference) per target token (a grpo stage's estimate of it),
    and weight x KL, the part it adds to the objective (smoothed as the loss is); a dpo stage has no KL
    penalty (its loss is its tie to the reference, at dpo.beta) and is left blank there;
(e) the realised data mixture per dataset (each step's cursor advance / batch) as a stacked area, so
    the split inside a stage (80% task, 20% replay) shows, not only the fades between stages;
(f) for a run with post-training stages, their steps' own figures: a grpo stage's mean reward and KL
    to the reference, a dpo stage's implicit-reward accuracy and margin.

A figure that cannot be drawn (infinite, or beyond +-DRAWABLE: a forged record, a loss that overflowed)
is left out, as a NaN is, and the figure names the series that lost some (rewind.tools.drawable).

Every panel carries the stage context (boundaries, fade windows, reference refreshes) and the run's
markers (stack appends, resumes, checkpoints, non-finite losses). It draws from a `Timeline`
(tools.timeline_scan), whose long series were reduced to bounded buckets while the log streamed past
(tools.timeline_buckets); here they come down to at most MAX_POINTS per curve (min/max envelopes for
the raw loss), so a million steps plot in seconds and in little memory.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, ScalarFormatter

from rewind.states.events import (
    Evaluated,
    NonFiniteLoss,
    ReferenceRefreshed,
    RunResumed,
    RunStopped,
    StackAppended,
)
from rewind.tools.drawable import DRAWABLE, Undrawn, drawable_steps
from rewind.tools.kl_terms import RunKl
from rewind.tools.outfile import write_file_atomically
from rewind.tools.plots import (
    MAX_POINTS,
    dataset_styles,
    draw_stage_context,
    format_tokens,
    pyplot,
    stage_colour,
)
from rewind.tools.state_cmd import status_text
from rewind.tools.timeline_buckets import StepColumns, runs_of
from rewind.tools.timeline_scan import Timeline

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
def _stage_label(timeline: Timeline, stage: int) -> str:
    stages = timeline.config.stages
    names = " + ".join(s.name for s in stages[stage].datasets) if stage < len(stages) else ""
    return f"stage {stage}: {names}"


def _draw_loss(ax, timeline: Timeline, steps: StepColumns, styles: dict, undrawn: Undrawn) -> None:
    if steps.num_steps:
        x = steps.tokens
        for stage, a, b in runs_of(steps.stage):
            colour = stage_colour(stage)
            end = min(b + 1, len(x))  # overlap one point so the raw pieces join, as the steps do
            if steps.reduced:  # the envelope of each bucket stands in for its raw steps
                ax.fill_between(
                    x[a:end], steps.low[a:end], steps.high[a:end], color=colour, alpha=0.18, linewidth=0
                )
            else:
                ax.plot(x[a:end], steps.loss[a:end], color=colour, alpha=0.3, linewidth=0.8)
        labelled: set[int] = set()
        for _, a, b in runs_of(steps.segment):  # each smoothed piece alone: no line across a jump
            stage = int(steps.stage[a])
            label = _stage_label(timeline, stage) if stage not in labelled else None
            labelled.add(stage)
            ax.plot(
                x[a:b],
                steps.smooth[a:b],
                color=stage_colour(stage),
                linewidth=2.0,
                label=label,
                gid="smoothed",
            )
    if timeline.superseded_points.num_points:
        xs, ys = undrawn.points(timeline.superseded_points.points(), "task loss")
        ax.plot(xs, ys, **SUPERSEDED, zorder=3, label="superseded, recomputed after resume")
    for name in [n for n in styles if n in timeline.validation_points]:
        xs, ys = undrawn.points(timeline.validation_points[name].points(), "validation loss")
        colour, marker = styles[name]
        ax.plot(xs, ys, color=colour, marker=marker, markersize=4, linewidth=0.8, label=f"validation: {name}")
    low_y, high_y = ax.dataLim.intervaly
    if steps.num_steps and 0 < low_y < high_y and high_y / low_y > LOG_SCALE_RATIO:
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter("")
    log = " (log)" if ax.get_yscale() == "log" else ""
    ax.set_ylabel(f"task loss{log}\n{RunKl(timeline.config.stages).loss_meaning()}")
    if steps.num_steps == 0:
        ax.text(0.5, 0.5, "no steps committed yet", transform=ax.transAxes, ha="center", color="0.4")


def evaluation_points(evaluations: list[Evaluated], figure: str) -> dict[str, tuple[list[int], list[float]]]:
    """name -> (tokens, values) of one figure of the boundary evaluations ("scores": answer-token
    accuracy per task; "bits_per_byte": per held-out text), where each was measured."""
    points: dict[str, tuple[list[int], list[float]]] = {}
    for e in evaluations:
        for name, value in getattr(e, figure).items():
            xs, ys = points.setdefault(name, ([], []))
            xs.append(e.tokens)
            ys.append(value)
    return points


def _draw_points(ax, points: dict, styles: dict, **style) -> None:
    """Each figure as markers where it was measured: nothing was measured between two of them. Not
    clipped: the one before training stands on the left edge."""
    for name in [n for n in styles if n in points]:
        colour, marker = styles[name]
        line = {"linestyle": "none", "clip_on": False, "zorder": 3}
        ax.plot(*points[name], color=colour, marker=marker, label=name, gid="measured", **line, **style)


def _draw_bits_per_byte(ax, points: dict, styles: dict) -> None:
    _draw_points(ax, points, styles, markersize=7)
    for name in [n for n in styles if n in points]:  # the headline figure: the last one written out
        xs, ys = points[name]
        if not np.isfinite(ys[-1]):
            continue
        ax.annotate(
            f"{ys[-1]:.3f}",
            (xs[-1], ys[-1]),
            xytext=(-6, 0),
            textcoords="offset points",
            ha="right",
            va="center",
            fontsize=8,
            color=styles[name][0],
        )
    low, high = ax.dataLim.intervaly
    if low <= high:  # (nothing drawn: no limits to set)
        margin = max((high - low) * 0.15, 0.05)
        ax.set_ylim(max(low - margin, 0.0), high + margin)
    ax.set_ylabel("bits per byte, held-out\n(start, stage ends)")


def _draw_evaluations(ax, timeline: Timeline, styles: dict, undrawn: Undrawn) -> None:
    measured = evaluation_points(timeline.effective_of(Evaluated), "scores")
    points = {name: undrawn.points(xy, "accuracy") for name, xy in measured.items()}
    _draw_points(ax, points, styles, markersize=6)
    if not points:
        why = "no evaluation tasks configured" if not timeline.config.training.evaluations else "none yet"
        ax.text(0.5, 0.5, f"boundary evaluations: {why}", transform=ax.transAxes, ha="center", color="0.4")
    best = max((y for _, ys in points.values() for y in ys if np.isfinite(y)), default=0.0)
    ax.set_ylim(0, best * 1.15 if best > 0 else 1.0)  # headroom for the markers of the best score
    ax.set_ylabel("answer-token accuracy\n(start, stage ends)")


class KlWeights(RunKl):
    """A run's KL terms (rewind.tools.kl_terms) as arrays over its stages, for the panels."""

    def __init__(self, stages):
        super().__init__(stages)
        self.penalty, self.is_own = np.array(self.penalties, dtype=np.float64), np.array(self.own, dtype=bool)
        self.is_dpo, self.is_grpo = np.array(self.dpo, dtype=bool), np.array(self.grpo, dtype=bool)

    def of(self, stages: np.ndarray, recorded: np.ndarray) -> np.ndarray:
        """Per step (or bucket) of these primary stages: the recorded beta, or the stage's own weight."""
        stages = np.asarray(stages, dtype=np.int64)
        return np.where(self.is_own[stages], self.penalty[stages], recorded) if len(stages) else recorded


def _draw_lr_beta(ax, timeline: Timeline, steps: StepColumns, undrawn: Undrawn) -> list:
    """LR and the KL penalty's weight as trained; the planned rest of the run dashed. Returns the twin axis."""
    schedule, state = timeline.schedule, timeline.state
    weights = KlWeights(timeline.config.stages)
    ax.plot(steps.start, steps.lr, color="black", linewidth=1.3, label="learning rate")
    twin = ax.twinx()
    if steps.num_steps:  # the weight holds for the whole last step: draw it to that step's end
        x = np.append(steps.start, steps.last_tokens)
        beta = np.append(steps.beta, steps.last_beta)
        stages = np.append(steps.stage, steps.stage[-1:])  # (the last bucket's stage: the last step's)
        label, weight = weights.weight_name(), undrawn(weights.of(stages, beta), "KL weight")
        twin.step(x, weight, where="post", color=BETA_COLOUR, linewidth=1.3, label=label, gid="kl weight")
    if not state.finished and state.step < schedule.num_steps:
        rest = np.unique(np.linspace(state.step, schedule.num_steps - 1, MAX_POINTS).astype(np.int64))
        x = rest * schedule.tokens_per_step
        planned_lr = undrawn([schedule.lr(int(k)) for k in rest], "learning rate")
        ax.plot(x, planned_lr, color="black", **PLANNED, label="planned (not trained yet)")
        primary = np.array([schedule.primary(int(k)) for k in rest], dtype=np.int64)
        planned = undrawn(weights.of(primary, np.array([schedule.beta(int(k)) for k in rest])), "KL weight")
        twin.step(x, planned, where="post", color=BETA_COLOUR, **PLANNED)
    ax.set_ylabel("learning rate")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.2g}"))
    twin.set_ylabel(weights.weight_name().replace(": ", "\n"), color=BETA_COLOUR)
    top = min(max(float(weights.penalty.max(initial=0.0)), *schedule.betas, 1e-3), DRAWABLE)
    twin.set_ylim(bottom=0, top=top * 1.3)
    twin.tick_params(axis="y", colors=BETA_COLOUR)
    return twin


def _draw_kl(ax, timeline: Timeline, steps: StepColumns, undrawn: Undrawn) -> None:
    ax.set_ylabel("KL to reference\nper token")
    weights = KlWeights(timeline.config.stages)
    if not weights.has_penalty:
        ax.text(0.5, 0.5, weights.no_penalty_text(), transform=ax.transAxes, ha="center", color="0.4")
        return
    x = steps.tokens
    # A dpo step computes no KL (its record says 0): blank there, not a KL of 0.
    kl = np.where(weights.is_dpo[steps.stage], np.nan, steps.kl) if steps.num_steps else steps.kl
    with np.errstate(over="ignore"):
        weighted = undrawn(kl * weights.of(steps.stage, steps.beta), "weight x KL")
    estimate = "; grpo: its estimate" if (weights.is_grpo & (weights.penalty > 0)).any() else ""
    for i, (_, a, b) in enumerate(runs_of(steps.segment)):  # smoothed within a segment, as the loss is
        first = i == 0
        label = f"KL(policy || reference){estimate}" if first else None
        ax.plot(x[a:b], kl[a:b], color=BETA_COLOUR, linewidth=1.5, gid="kl", label=label)
        label = "weight x KL (in the objective)" if first else None
        ax.plot(x[a:b], weighted[a:b], color=BETA_COLOUR, linewidth=1.0, linestyle=":", gid="weighted kl", label=label)
    if weights.is_dpo.any():
        ax.text(
            0.01, 0.9, "dpo stages: no KL penalty (the loss is the tie to the reference, dpo.beta)",
            transform=ax.transAxes, fontsize=7, color="0.4", va="top",
        )  # fmt: skip
    ax.set_ylim(bottom=0)


# The post-training figures the panel draws (StepCommitted.metrics), in its legend's order.
POSTTRAINING_METRICS = {
    "reward": "grpo: mean reward",
    "accuracy": "dpo: reward accuracy",
    "margin": "dpo: reward margin",
    "kl": "grpo: KL to the reference",
}


def _draw_posttraining(ax, timeline: Timeline, undrawn: Undrawn) -> None:
    """(f) Each post-training step's own figures: a grpo stage's mean reward (and KL to the reference),
    a dpo stage's implicit-reward accuracy and margin."""
    for name, label in POSTTRAINING_METRICS.items():
        if name in timeline.metric_points:
            ax.plot(*undrawn.points(timeline.metric_points[name].points(), label), linewidth=1.0, label=label)
    ax.set_ylabel("post-training", fontsize=9)


def _draw_mixture(ax, steps: StepColumns, styles: dict) -> None:
    ax.set_ylim(0, 1)
    ax.set_ylabel("realised data\nmixture")
    if steps.num_steps == 0 or not steps.dataset_names:
        return
    shares = np.vstack([steps.datasets, steps.datasets[-1:]])  # the last step's mixture holds to its end
    x = np.append(steps.start, steps.last_tokens)
    colours = [styles.get(name, ("0.5", "o"))[0] for name in steps.dataset_names]
    ax.stackplot(x, shares.T, colors=colours, alpha=0.85, labels=[f"{n} rows" for n in steps.dataset_names])


def _draw_markers(ax, timeline: Timeline, *, label: bool) -> None:
    """Stack appends, resumes, checkpoint ticks and non-finite losses on one panel."""
    at_bottom = ax.get_xaxis_transform()  # x in data, y in axes fraction
    for i, e in enumerate(timeline.effective_of(StackAppended)):
        first = label and i == 0
        ax.axvline(
            e.tokens,
            color="#6A3D9A",
            linestyle="-.",
            linewidth=1.2,
            label="stack appended" if first else None,
        )
    resumes = timeline.raw_of(RunResumed)
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
    checkpoints = np.array(timeline.checkpoint_tokens, dtype=np.float64)
    if len(checkpoints):
        total = max(timeline.schedule.num_steps * timeline.schedule.tokens_per_step, 1)
        _, first = np.unique(
            np.round(checkpoints / total * MAX_POINTS), return_index=True
        )  # a tick per pixel
        ticks = {"linestyle": "none", "marker": "|", "markersize": 8, "markeredgewidth": 1.3, "color": "0.3"}
        y = np.full(len(first), 0.035)
        ax.plot(checkpoints[first], y, **ticks, transform=at_bottom, label="checkpoint" if label else None)
    bad = [e.tokens for e in timeline.raw_of(NonFiniteLoss)]
    if bad:
        cross = {"linestyle": "none", "marker": "x", "markersize": 7, "color": "#D00000"}
        ax.plot(
            bad, [0.93] * len(bad), **cross, transform=at_bottom, label="non-finite loss" if label else None
        )


def _draw_stops(ax, timeline: Timeline) -> None:
    stops = [e.tokens for e in timeline.raw_of(RunStopped)]
    if stops:
        triangle = {
            "linestyle": "none",
            "marker": "v",
            "markersize": 7,
            "color": RESUME_COLOUR,
            "clip_on": False,
        }
        ax.plot(stops, [1.0] * len(stops), **triangle, transform=ax.get_xaxis_transform(), label="stopped")


def timeline_figure(timeline: Timeline):
    """The picture of a Timeline read `with_plot` (its bounded series), as a matplotlib Figure whose
    panels are labelled (Axes.get_label): loss, bits per byte (text runs), accuracy, lr, kl, mixture,
    post-training (runs with post-training stages)."""
    if timeline.steps is None:
        raise ValueError("the timeline was read without with_plot: it has no series to draw")
    plt = pyplot()
    schedule, state, config = timeline.schedule, timeline.state, timeline.config
    tps = schedule.tokens_per_step
    refreshes = timeline.effective_of(ReferenceRefreshed)  # all that draw_stage_context looks at
    growths = timeline.effective_of(StackAppended)
    undrawn = Undrawn()
    steps = drawable_steps(timeline.steps, tps, [e.tokens for e in [*growths, *refreshes]], undrawn)
    bits = {
        name: undrawn.points(xy, "bits per byte")
        for name, xy in evaluation_points(timeline.effective_of(Evaluated), "bits_per_byte").items()
    }
    names = [s.name for stage in config.stages for s in stage.datasets] + [*config.training.evaluations]
    names += list(timeline.validation_points)
    names += [n for e in timeline.evaluations for n in e.scores] + list(bits)
    mixtures = [{s.name: s.rate for s in stage.datasets} for stage in config.stages]
    styles = dataset_styles(names, mixtures)

    heights = {"loss": 2.6, "bits per byte": 1.3, "accuracy": 1.5, "lr": 1.1, "kl": 1.0, "mixture": 1.0}
    if not bits:
        del heights["bits per byte"]
    posttraining = any(name in timeline.metric_points for name in POSTTRAINING_METRICS)
    if posttraining:
        heights["post-training"] = 1.2
    panels = {"height_ratios": list(heights.values()), "hspace": 0.08}
    fig, axes = plt.subplots(
        len(heights), 1, figsize=(12, 1.74 * sum(heights.values())), sharex=True, gridspec_kw=panels
    )
    by_name = dict(zip(heights, axes, strict=True))
    for name, ax in by_name.items():
        ax.set_label(name)
    ax_loss, ax_eval, ax_lr, ax_kl, ax_mix = (by_name[n] for n in ("loss", "accuracy", "lr", "kl", "mixture"))
    _draw_loss(ax_loss, timeline, steps, styles, undrawn)
    if bits:
        _draw_bits_per_byte(by_name["bits per byte"], bits, styles)
    _draw_evaluations(ax_eval, timeline, styles, undrawn)
    twin = _draw_lr_beta(ax_lr, timeline, steps, undrawn)
    _draw_kl(ax_kl, timeline, steps, undrawn)
    _draw_mixture(ax_mix, steps, styles)
    if posttraining:
        _draw_posttraining(by_name["post-training"], timeline, undrawn)
    total = schedule.num_steps * tps
    for i, ax in enumerate(axes):
        draw_stage_context(ax, schedule, refreshes, label=i == 0)
        _draw_markers(ax, timeline, label=i == 0)
        if not state.finished and state.tokens < total:
            hatched = {"facecolor": "none", "edgecolor": "0.85", "hatch": "//", "linewidth": 0, "zorder": 0}
            ax.axvspan(state.tokens, total, **hatched, label="not trained yet" if i == 0 else None)
        ax.grid(axis="y", color="0.92", linewidth=0.8)
    _draw_stops(ax_loss, timeline)

    handles, labels = ax_lr.get_legend_handles_labels()
    twin_handles, twin_labels = twin.get_legend_handles_labels()
    ax_lr.legend(handles + twin_handles, labels + twin_labels, **LEGEND)
    for ax in axes:
        if ax is not ax_lr and ax.get_legend_handles_labels()[0]:
            ax.legend(**LEGEND)
    bottom = axes[-1]
    bottom.set_xlim(0, total * 1.005)  # room for the markers of the final evaluation
    bottom.set_xlabel("training tokens")
    bottom.xaxis.set_major_formatter(FuncFormatter(format_tokens))
    top = ax_loss.secondary_xaxis("top", functions=(lambda t: t / tps, lambda s: s * tps))
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    top.set_xlabel("optimizer steps", fontsize=9)
    num_resumes = timeline.num_resumes
    ax_loss.set_title(
        f"{config.run.name} — {status_text(state)}\n"
        f"step {state.step:,} of {schedule.num_steps:,}, {state.tokens:,} tokens, "
        f"{num_resumes} resume{'s' if num_resumes != 1 else ''}",
        fontsize=11,
    )
    undrawn.note(fig)
    return fig


def plot_timeline(timeline: Timeline, out: str | Path) -> Path:
    """Draw a Timeline read `with_plot` into `out`: exactly that path (a PNG whatever its name ends in),
    written whole."""
    fig = timeline_figure(timeline)
    path = Path(out)
    image = io.BytesIO()  # the PNG whole, then written whole: exactly `out`, never `out`.png beside it
    fig.savefig(image, format="png", dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    write_file_atomically(path, image.getvalue())
    return path
