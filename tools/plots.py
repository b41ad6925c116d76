"""Plots a person reads at a glance: the schedule (weights, LR, KL) and, with `timeline_plot`, a run's story."""

from __future__ import annotations

import io
from pathlib import Path

from rewind.states.events import Event, ReferenceRefreshed, StackAppended, StageEntered
from rewind.states.schedule import Schedule
from rewind.tools.kl_terms import RunKl
from rewind.tools.outfile import write_file_atomically

# One colour per stage, the same in every panel and every plot rewind draws.
STAGE_COLOURS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]
# For datasets and tasks that lead no stage: dark tones that stay apart from the stage colours.
DATASET_COLOURS = ["#222222", "#17BECF", "#9E9E00", "#7F3C8D", "#666666", "#E377C2", "#1F4E79", "#8C564B"]
DATASET_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
MAX_POINTS = 2000


def stage_colour(stage: int) -> str:
    return STAGE_COLOURS[stage % len(STAGE_COLOURS)]


def home_stages(mixtures: list[dict[str, float]]) -> dict[str, int]:
    """dataset name -> the first stage whose mixture (name -> rate) it leads; ties go to the first listed."""
    homes: dict[str, int] = {}
    for stage, mixture in enumerate(mixtures):
        if mixture:
            homes.setdefault(max(mixture, key=mixture.__getitem__), stage)
    return homes


def dataset_styles(names, mixtures: list[dict[str, float]]) -> dict[str, tuple[str, str]]:
    """name -> (colour, marker), the same in every panel. A dataset that leads a stage's mixture takes that
    stage's colour (so a task's evaluation curve reads against its own stage); the others get their own."""
    homes = home_stages(mixtures)
    ordered = sorted(set(names), key=lambda n: (homes.get(n, len(mixtures)), n))
    styles = {}
    num_others = 0
    for i, name in enumerate(ordered):
        if name in homes:
            colour = stage_colour(homes[name])
        else:
            colour = DATASET_COLOURS[num_others % len(DATASET_COLOURS)]
            num_others += 1
        styles[name] = (colour, DATASET_MARKERS[i % len(DATASET_MARKERS)])
    return styles


def format_tokens(value: float, _position=None) -> str:
    """Axis ticks in tokens: 0, 500, 50k, 1.5M, 2B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.4g}{suffix}"
    return f"{value:.4g}"


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, imported when a plot is drawn (never at startup)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def sample_steps(schedule: Schedule) -> list[int]:
    """~MAX_POINTS steps across the run plus every step inside a fade window, capped, so the curves are
    exact where they bend and a million-step run still plots in a moment."""
    n = schedule.num_steps
    stride = max(1, n // MAX_POINTS)
    steps = set(range(0, n, stride)) | {n - 1}
    for ramp in schedule.fades:
        a, b = schedule.fade_start_step(ramp), schedule.fade_end_step(ramp)
        inner = max(1, (b - a) // 200)
        steps |= set(range(max(a - 1, 0), min(b + 1, n), inner))
    steps |= {s for s in schedule.entry_steps if s < n} | {max(s - 1, 0) for s in schedule.entry_steps}
    return sorted(steps)


def draw_stage_context(
    ax, schedule: Schedule, events: list[Event], *, label: bool = False, growth_label_top: float = 1.0
) -> None:
    """Boundaries (dashed), fade windows (shaded), reference refreshes (red dotted) and growths (green,
    with the new stack's id and the trunk it joined, written downwards from `growth_label_top`, in axes
    fraction) on one axis."""
    for j, b in enumerate(schedule.boundaries[:-1]):
        ax.axvline(b, color="0.35", linestyle="--", linewidth=0.8, label="stage boundary" if label and j == 0 else None)
    for i, ramp in enumerate(schedule.fades):
        ax.axvspan(ramp.start, ramp.end, color="0.85", alpha=0.6, zorder=0, label="fade window" if label and i == 0 else None)
    refreshes = [e for e in events if isinstance(e, ReferenceRefreshed)]
    for i, e in enumerate(refreshes):
        ax.axvline(e.tokens, color="#C00000", linestyle=":", linewidth=1.4, label="reference refresh" if label and i == 0 else None)
    growths = [e for e in events if isinstance(e, StackAppended)]
    for i, e in enumerate(growths):
        ax.axvline(e.tokens, color="#2CA02C", linestyle="-.", linewidth=1.4, label="stack joins" if label and i == 0 else None)
        if label:
            ax.annotate(f"+stack {e.stack} ({e.position}, trunk {e.trunk})", (e.tokens, growth_label_top), xycoords=("data", "axes fraction"),
                        rotation=90, va="top", ha="left", fontsize=7, color="#1A6B1A",
                        xytext=(3, -14), textcoords="offset points", bbox={"fc": "white", "alpha": 0.75, "lw": 0})


def fades_text(schedule: Schedule) -> str:
    """The fades in a few words, as `rewind schedule` says them: "none" where every boundary is a hard switch."""
    if not schedule.fades:
        return "none"
    config = schedule.config
    if all(stage.overlap is None for stage in config.stages[:-1]):
        return f"{schedule.curve}, overlap {config.training.fade.overlap}"
    return f"{schedule.curve}, overlap {[config.fade_overlap(j) for j in range(config.num_stages - 1)]}"


# The weights panel's top: the band above weight 1 holds the stage labels ("enter 1"), the growth labels
# start below it, so the two never cover each other where a stack joins as a stage begins.
WEIGHTS_TOP = 1.08


def schedule_figure(schedule: Schedule, events: list[Event], title: str = ""):
    """The schedule's picture as a matplotlib Figure: panels labelled (Axes.get_label) weights, lr, kl."""
    plt = pyplot()
    steps = sample_steps(schedule)
    x = [schedule.tokens_of(k) for k in steps]
    weights = [schedule.weights(k) for k in steps]
    config = schedule.config

    fig, axes = plt.subplots(3, 1, figsize=(11, 7.5), sharex=True, gridspec_kw={"height_ratios": [2.2, 1, 1]})
    ax_w, ax_lr, ax_kl = axes
    for name, ax in zip(("weights", "lr", "kl"), axes, strict=True):
        ax.set_label(name)
    series = [[w[i] for w in weights] for i in range(schedule.num_stages)]
    labels = [
        f"stage {i}: " + " + ".join(s.name for s in config.stages[i].datasets) for i in range(schedule.num_stages)
    ]
    ax_w.stackplot(x, series, labels=labels, colors=[stage_colour(i) for i in range(schedule.num_stages)], alpha=0.85)
    draw_stage_context(ax_w, schedule, events, label=True, growth_label_top=1.0 / WEIGHTS_TOP)
    for e in events:
        if isinstance(e, StageEntered):
            ax_w.annotate(
                f"enter {e.stage}", (e.tokens, 1.0), xytext=(2, 3), textcoords="offset points", fontsize=8, color="0.2",
                gid="stage label",
            )
    ax_w.set_ylim(0, WEIGHTS_TOP)
    ax_w.set_ylabel("data mixture weight")
    ax_w.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    ax_w.set_title(
        (title + "\n" if title else "")
        + f"{schedule.num_stages} stages, {schedule.num_steps:,} steps of {schedule.tokens_per_step:,} tokens; "
        + f"fades: {fades_text(schedule)}",
        fontsize=10,
    )

    ax_lr.plot(x, [schedule.lr(k) for k in steps], color="black", linewidth=1.2)
    draw_stage_context(ax_lr, schedule, events)
    ax_lr.set_ylabel(f"learning rate\n({config.optimization.schedule})")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))

    # The weight of the KL penalty each step's stage adds (rewind.tools.kl_terms): beta, a grpo stage's
    # grpo.kl_beta; a dpo stage adds none (its beta is 0 by rule), its loss being its tie to the reference.
    kl = RunKl(config.stages)
    ax_kl.step(x, [kl.penalties[schedule.primary(k)] for k in steps], where="post", color="#C00000", linewidth=1.2,
               gid="kl weight")
    draw_stage_context(ax_kl, schedule, events)
    kinds = config.optimization.kl.kind
    kinds = f"beta ({kinds}), grpo.kl_beta" if any(kl.grpo) else kinds
    ax_kl.set_ylabel(f"KL weight\n({kinds})")
    if any(kl.dpo):
        ax_kl.text(0.01, 0.85, "dpo stages: no KL penalty (the loss is the tie to the reference, dpo.beta)",
                   transform=ax_kl.transAxes, fontsize=8, color="0.4")
    ax_kl.set_xlabel("tokens consumed")
    ax_kl.set_ylim(bottom=0, top=max(max(kl.penalties), 1e-3) * 1.25)
    ax_kl.set_xlim(0, schedule.num_steps * schedule.tokens_per_step)
    fig.tight_layout()
    return fig


def plot_schedule(schedule: Schedule, events: list[Event], out: str | Path, title: str = "") -> Path:
    """Draw `schedule_figure` into exactly `out` (a PNG whatever its name ends in), written whole."""
    fig = schedule_figure(schedule, events, title)
    image = io.BytesIO()  # savefig to a path without a suffix would write `out`.png: the bytes go to `out`
    fig.savefig(image, format="png", dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    write_file_atomically(Path(out), image.getvalue())
    return Path(out)
