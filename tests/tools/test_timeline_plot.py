"""What `rewind timeline --plot` draws, read back from the Figure's artists (not pixels): the smoothed loss
averages within a stage and between growths only, a run that scores running text gets a bits-per-byte
panel, and figures measured at stage ends are points where they were measured. The runs are written
record by record from an example's own plan, without training, so these take a moment."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from rewind.states.events import Evaluated, RunStarted, StepCommitted
from rewind.states.fold import fold
from rewind.states.plan import plan
from rewind.states.schedule import Schedule
from rewind.tools.configfile import load_config
from rewind.tools.plots import pyplot, stage_colour
from rewind.tools.timeline_plot import timeline_figure
from rewind.tools.timeline_scan import Timeline
from tests.engine.test_loop import EXAMPLES

PROGRESSIVE, TEXT = EXAMPLES / "progressive.toml", EXAMPLES / "text.toml"
POSTTRAIN, TINY = EXAMPLES / "posttrain.toml", EXAMPLES / "tiny.toml"


def written_timeline(
    config_path, loss_of, evaluation_of, metrics_of=lambda k: {}, kl_of=lambda k, stage: 0.0, overrides=()
) -> Timeline:
    """A finished run of an example (with `overrides`, as `--set` takes them) as its log reads: the
    planned control events (stage entries, growths, refreshes, fades) where they fall, step k's loss
    `loss_of(k, stage)` and KL `kl_of(k, stage)` (and metrics `metrics_of(k)`), and before training and
    at each stage's end an Evaluated whose fields are `evaluation_of(boundary)`."""
    config = load_config(str(config_path), list(overrides))
    schedule = Schedule(config)
    tps = schedule.tokens_per_step
    started = RunStarted(step=0, tokens=0, config=config, config_hash="h")
    planned: dict[int, list] = {}
    for e in plan(schedule):
        planned.setdefault(e.step, []).append(e)
    ends = {schedule.stage_entry_step(s + 1): s for s in range(schedule.num_stages - 1)}
    ends[schedule.num_steps] = schedule.num_stages - 1
    records = [started, Evaluated(step=0, tokens=0, boundary=-1, **evaluation_of(-1))]
    for k in range(schedule.num_steps + 1):
        if k in ends:  # the evaluation closing a stage comes before the next stage's entry
            records.append(Evaluated(step=k, tokens=k * tps, boundary=ends[k], **evaluation_of(ends[k])))
        records += planned.get(k, [])
        if k < schedule.num_steps:
            p = schedule.step_plan(k)
            loss = loss_of(k, p.stage)
            records.append(
                StepCommitted(
                    step=k + 1, tokens=(k + 1) * tps, stage=p.stage, lr=p.lr, beta=p.beta, loss=loss,
                    kl=kl_of(k, p.stage), metrics=metrics_of(k),
                )
            )
    timeline = Timeline("written", with_plot=True)
    for seq, event in enumerate(records):
        timeline.add(seq, event, superseded=False)
    state = fold([started])
    end = schedule.num_steps
    return timeline.finish(msgspec.structs.replace(state, step=end, tokens=end * tps, finished=True))


@pytest.fixture
def figures():
    """Figures drawn in a test, closed after it."""
    drawn = []
    yield lambda timeline: drawn.append(timeline_figure(timeline)) or drawn[-1]
    for fig in drawn:
        pyplot().close(fig)


def panels(fig) -> dict:
    return {ax.get_label(): ax for ax in fig.axes if ax.get_label()}


def measured(ax) -> dict:
    """The figures drawn where they were measured, by name."""
    return {line.get_label(): line for line in ax.get_lines() if line.get_gid() == "measured"}


def no_text(_boundary: int) -> dict:
    return {"scores": {}}


def test_the_smoothed_loss_stays_inside_its_stage_across_growths(figures):
    """Progressive growth: each stage's loss is flat, and the next one starts far higher (a new task on a
    grown model). Smoothed across the boundary, stage 2's curve would climb toward stage 3's loss over
    its last steps, a rise before the growth that never happened; within the stage it is flat."""
    timeline = written_timeline(PROGRESSIVE, lambda k, stage: 2.0 + 2 * stage + 0.01 * math.sin(k), no_text)
    fig = figures(timeline)
    tps = timeline.schedule.tokens_per_step
    smoothed = [line for line in panels(fig)["loss"].get_lines() if line.get_gid() == "smoothed"]
    covered = []
    for line in smoothed:
        x, y = np.asarray(line.get_xdata()), np.asarray(line.get_ydata())
        stages = {timeline.schedule.step_plan(int(t) // tps - 1).stage for t in x}
        assert len(stages) == 1  # no piece reaches across a stage boundary
        (stage,) = stages
        assert line.get_color() == stage_colour(stage)
        assert np.all(np.abs(y - (2.0 + 2 * stage)) <= 0.01)  # flat: only its own stage's losses
        covered += list(x)
    assert sorted(covered) == [(k + 1) * tps for k in range(timeline.schedule.num_steps)]  # every step once
    assert len(smoothed) == timeline.schedule.num_stages


def test_a_text_run_gets_a_bits_per_byte_panel_with_its_figures_where_measured(figures):
    def evaluation(boundary: int) -> dict:
        return {"scores": {"sort": 0.1 * (boundary + 2)}, "bits_per_byte": {"stdlib": 6.0 - boundary}}

    timeline = written_timeline(TEXT, lambda k, stage: 5.0 - k / 200, evaluation)
    fig = figures(timeline)
    evaluations = timeline.evaluations
    bits = panels(fig)["bits per byte"]
    (line,) = measured(bits).values()
    assert line.get_label() == "stdlib" and line.get_linestyle() == "None" and line.get_marker() != "None"
    assert list(line.get_xdata()) == [e.tokens for e in evaluations]
    assert list(line.get_ydata()) == [6.0 - e.boundary for e in evaluations]
    assert [t.get_text() for t in bits.texts] == [f"{6.0 - evaluations[-1].boundary:.3f}"]  # the last figure
    assert list(panels(fig)) == ["loss", "bits per byte", "accuracy", "lr", "kl", "mixture"]
    # A run that scores no text has no such panel.
    plain = figures(written_timeline(PROGRESSIVE, lambda k, stage: 2.0, no_text))
    assert "bits per byte" not in panels(plain)


def test_accuracy_is_drawn_as_points_where_it_was_measured(figures):
    tasks = ("grammar", "reverse", "sort", "add")

    def evaluation(boundary: int) -> dict:
        return {"scores": {task: (i + 1) / 10 + boundary / 100 for i, task in enumerate(tasks[1:])}}

    timeline = written_timeline(PROGRESSIVE, lambda k, stage: 2.0, evaluation)
    lines = measured(panels(figures(timeline))["accuracy"])
    assert set(lines) == set(tasks[1:])
    tokens = [e.tokens for e in timeline.evaluations]
    assert tokens == [0, *(timeline.schedule.tokens_of(s) for s in (200, 400, 600, 800))]  # start, stage ends
    for task, line in lines.items():
        assert line.get_linestyle() == "None" and line.get_marker() != "None"  # nothing drawn between
        assert list(line.get_xdata()) == tokens
        assert list(line.get_ydata()) == [e.scores[task] for e in timeline.evaluations]


def test_post_training_steps_get_a_panel_of_their_own_figures(figures):
    """A step's metrics (a dpo step's accuracy and margin, a grpo step's reward) are drawn where they were
    measured, in a panel only runs with such steps get."""

    def metrics(k: int) -> dict:
        return {"reward": k / 100, "margin": -k / 50} if k >= 50 else {}

    plain = written_timeline(PROGRESSIVE, lambda k, stage: 3.0, no_text)
    assert "post-training" not in panels(figures(plain))  # a pretraining run: no such panel
    timeline = written_timeline(PROGRESSIVE, lambda k, stage: 3.0, no_text, metrics)
    drawn = panels(figures(timeline))["post-training"].get_lines()
    lines = {line.get_label(): line for line in drawn if line.get_label().partition(":")[0] in ("grpo", "dpo")}
    assert set(lines) == {"grpo: mean reward", "dpo: reward margin"}
    tps = timeline.schedule.tokens_per_step
    reward = lines["grpo: mean reward"]
    assert list(reward.get_xdata())[:2] == [51 * tps, 52 * tps] and list(reward.get_ydata())[:2] == [0.5, 0.51]


def test_the_kl_panels_draw_a_grpo_stages_kl_penalty_and_leave_a_dpo_stage_blank(figures):
    """examples/posttrain.toml: every beta is 0 (the rule for dpo and grpo stages), but its grpo stage has
    a KL penalty, grpo.kl_beta 0.02 x its estimate: panel (c) draws that weight, panel (d) the KL and 0.02
    x KL over the grpo steps, and nothing over the dpo steps (which compute no KL) -- not "no KL term"."""
    timeline = written_timeline(POSTTRAIN, lambda k, stage: 1.0, no_text, kl_of=lambda k, stage: 0.25 * stage)
    schedule, tps = timeline.schedule, timeline.schedule.tokens_per_step
    assert all(beta == 0 for beta in schedule.betas)
    fig = figures(timeline)
    kl = panels(fig)["kl"]
    assert [t.get_text() for t in kl.texts] == [
        "dpo stages: no KL penalty (the loss is the tie to the reference, dpo.beta)"
    ]  # and not "no KL term in this run"
    labels = {line.get_gid(): line.get_label() for line in kl.get_lines() if not line.get_label().startswith("_")}
    assert labels == {"kl": "KL(policy || reference); grpo: its estimate", "weighted kl": "weight x KL (in the objective)"}
    points: dict = {}  # step index -> value, of each curve
    for line in kl.get_lines():
        for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True):
            points.setdefault(line.get_gid(), {})[int(x) // tps - 1] = y
    solid, dotted = points["kl"], points["weighted kl"]
    assert sorted(solid) == sorted(dotted) == list(range(schedule.num_steps))  # every step once
    dpo, grpo = range(schedule.entry_steps[2], schedule.entry_steps[3]), range(schedule.entry_steps[3], schedule.num_steps)
    assert all(np.isnan(solid[k]) and np.isnan(dotted[k]) for k in dpo)  # blank, not a KL of 0
    assert all(solid[k] == pytest.approx(0.75) and dotted[k] == pytest.approx(0.02 * 0.75) for k in grpo)
    assert all(dotted[k] == 0 for k in range(schedule.entry_steps[2]))  # pretrain and sft: beta 0
    # Panel (c): the weight of the penalty, grpo.kl_beta in the grpo stage, on the axis beside the LR.
    (twin,) = [ax for ax in fig.axes if "KL weight" in ax.get_ylabel()]
    assert twin.get_ylabel() == "KL weight\nbeta, grpo.kl_beta"
    (weight,) = [line for line in twin.get_lines() if line.get_gid() == "kl weight"]
    x, y = np.asarray(weight.get_xdata()), np.asarray(weight.get_ydata())
    step_of = x.astype(np.int64) // tps
    assert set(y[step_of >= grpo.start]) == {0.02} and set(y[step_of < grpo.start]) == {0.0}
    assert twin.get_ylim()[1] >= 0.02


@pytest.mark.parametrize(
    ("config", "overrides", "said"),
    [
        (TINY, [], "task loss\ncross-entropy, without KL"),  # as pretraining runs' figures always said
        (POSTTRAIN, [], "task loss\neach stage's own:\ncross-entropy (no KL), DPO, GRPO policy + KL"),
        (
            POSTTRAIN,
            ["stages[3].grpo.kl_beta=0"],
            "task loss\neach stage's own:\ncross-entropy (no KL), DPO, GRPO policy",
        ),
    ],
    ids=["pretraining", "posttraining", "grpo_without_kl"],
)
def test_the_loss_panel_says_which_loss_each_stage_records(figures, config, overrides, said):
    """A grpo stage's recorded loss is its clipped policy loss with kl_beta x KL in (it can be negative), a
    dpo stage's the DPO loss: not a cross-entropy without KL, as a pretraining run's is."""
    timeline = written_timeline(config, lambda k, stage: 1.0, no_text, overrides=overrides)
    assert panels(figures(timeline))["loss"].get_ylabel() == said


@pytest.mark.parametrize(
    ("config", "overrides", "said"),
    [
        (TINY, ["stages[1].beta=0", "stages[2].beta=0"], "no KL penalty in this run (every beta is 0)"),
        (
            POSTTRAIN,
            ["stages[3].grpo.kl_beta=0"],
            "no KL penalty in this run (every beta and grpo.kl_beta is 0); a dpo stage's loss is its tie to the "
            "reference (dpo.beta)",
        ),
    ],
)
def test_a_run_without_a_kl_penalty_says_precisely_why(figures, config, overrides, said):
    timeline = written_timeline(config, lambda k, stage: 1.0, no_text, overrides=overrides)
    kl = panels(figures(timeline))["kl"]
    assert [t.get_text() for t in kl.texts] == [said]
    assert not [line for line in kl.get_lines() if line.get_gid() in ("kl", "weighted kl")]


def schedule_kl_panel(config, *overrides):
    """`rewind schedule --plot`'s KL panel for a config: its ylabel, texts, and the weight by step index."""
    from rewind.tools.plots import schedule_figure

    schedule = Schedule(load_config(str(config), list(overrides)))
    fig = schedule_figure(schedule, list(plan(schedule)))
    (kl,) = [ax for ax in fig.axes if ax.get_label() == "kl"]
    (curve,) = [line for line in kl.get_lines() if len(line.get_xdata()) > 2]  # not a boundary's axvline
    tps = schedule.tokens_per_step
    weight = {int(x) // tps: y for x, y in zip(curve.get_xdata(), curve.get_ydata(), strict=True)}
    said = (kl.get_ylabel(), [t.get_text() for t in kl.texts], kl.get_ylim()[1])
    pyplot().close(fig)
    return schedule, weight, said


def test_the_schedule_plot_draws_a_grpo_stages_kl_weight_and_says_a_dpo_stage_adds_none():
    """examples/posttrain.toml: every beta is 0 by rule, but the grpo stage's loss carries grpo.kl_beta 0.02 x
    its KL estimate: the schedule's KL weight panel draws 0.02 there, as `rewind schedule` and the timeline say."""
    schedule, weight, (ylabel, texts, top) = schedule_kl_panel(POSTTRAIN)
    grpo = schedule.entry_steps[3]
    assert {w for k, w in weight.items() if k >= grpo} == {0.02}
    assert {w for k, w in weight.items() if k < grpo} == {0.0}
    assert ylabel == "KL weight\n(beta (token_kl), grpo.kl_beta)" and top >= 0.02
    assert texts == ["dpo stages: no KL penalty (the loss is the tie to the reference, dpo.beta)"]
    # A run of pretrain stages draws its betas as before.
    schedule, weight, (ylabel, texts, _) = schedule_kl_panel(TINY)
    assert weight == {k: schedule.beta(k) for k in weight} and any(weight.values())
    assert ylabel == f"KL weight\n({schedule.config.optimization.kl.kind})" and texts == []
