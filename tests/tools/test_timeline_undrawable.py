"""`rewind timeline --plot` on figures no axis can hold (issue 33, point 11): a loss, LR, KL, validation
loss, score or post-training figure of 1e308 (a forged record; the span of such values overflows inside
matplotlib's savefig) or an infinite one is left out of the picture, as a NaN is, out of the smoothed
curves too, and the figure names the series that lost some (rewind.tools.drawable.Undrawn)."""

from __future__ import annotations

import io
import math

import msgspec
import numpy as np
import pytest

from rewind.states.config_reading import loads_config
from rewind.states.events import Evaluated, StepCommitted, Validated
from rewind.states.strategies import simulate_run
from rewind.tools.drawable import DRAWABLE
from tests.tools.stream_synthetic import LONG_CONFIG, write_run
from tests.tools.test_timeline_plot import POSTTRAIN, TINY, figures, panels, written_timeline  # noqa: F401

HUGE = (1e308, -1e308, math.inf, -math.inf, 3e300)


def _loss(k: int, _stage: int) -> float:
    return HUGE[k % 5] if k % 4 == 1 else 5.0 - k / 100


def _evaluation(boundary: int) -> dict:
    return {"scores": {"sort": 1e308, "reverse": 0.1 * (boundary + 2)}, "losses": {"sort": -math.inf}}


def _the_picture_holds(fig) -> None:
    fig.savefig(io.BytesIO(), format="png", dpi=40)  # (matplotlib's traceback was here)
    for ax in fig.axes:
        assert all(math.isfinite(v) and abs(v) <= DRAWABLE for v in (*ax.get_ylim(), *ax.get_xlim())), ax


def test_figures_beyond_any_axis_are_left_out_and_counted(figures):  # noqa: F811
    timeline = written_timeline(TINY, _loss, _evaluation, kl_of=lambda k, stage: 1e308 if k == 7 else 0.01)
    fig = figures(timeline)
    _the_picture_holds(fig)
    steps = timeline.schedule.num_steps
    (note,) = [t.get_text() for t in fig.texts if "not drawn" in t.get_text()]
    assert note == (
        "not drawn, infinite or beyond ±1e300: some values of task loss, KL, accuracy (rewind log RUN --json "
        "has every figure)"
    )
    # the smoothed loss averages the drawable losses alone: neither infinite nor 0 after a huge one
    smoothed = [line for line in panels(fig)["loss"].get_lines() if line.get_gid() == "smoothed"]
    values = np.concatenate([np.asarray(line.get_ydata(), dtype=float) for line in smoothed])
    assert np.nanmin(values) >= 5.0 - steps / 100 and np.nanmax(values) <= 5.0


def test_a_drawable_run_has_no_note(figures):  # noqa: F811
    timeline = written_timeline(TINY, lambda k, stage: 5.0 - k / 100, lambda b: {"scores": {"sort": 0.2}})
    fig = figures(timeline)
    assert not [t for t in fig.texts if "not drawn" in t.get_text()]


def test_post_training_figures_beyond_any_axis_are_left_out(figures):  # noqa: F811
    metrics = {"reward": 1e308, "accuracy": -math.inf, "margin": 1.0, "kl": 0.1}
    timeline = written_timeline(
        POSTTRAIN, lambda k, stage: 2.0, lambda b: {"scores": {}}, metrics_of=lambda k: metrics
    )
    fig = figures(timeline)
    _the_picture_holds(fig)
    assert "post-training" in panels(fig)
    assert any("not drawn" in t.get_text() for t in fig.texts)


def test_the_command_draws_a_forged_run(tmp_path, rewind_cli):
    config = loads_config(
        LONG_CONFIG.format(tokens_a=5120, tokens_b=2560, validation_interval=5, checkpoint_interval=10)
    )

    def forged(event):
        if isinstance(event, StepCommitted):
            return msgspec.structs.replace(event, loss=1e308, lr=-1e308, kl=math.inf)
        if isinstance(event, Validated):
            return msgspec.structs.replace(event, losses={name: 1e308 for name in event.losses})
        if isinstance(event, Evaluated):
            return msgspec.structs.replace(event, scores={name: 1e308 for name in event.scores})
        return event

    run, out = tmp_path / "run", tmp_path / "out.png"
    write_run(run, [forged(e) for e in simulate_run(config)])
    code, _, err = rewind_cli("timeline", run, "--plot", out)
    assert (code, err) == (0, "")
    assert out.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("value", [1e308, math.inf])
def test_a_huge_figure_never_reaches_an_axis_limit(figures, value):  # noqa: F811
    timeline = written_timeline(TINY, lambda k, stage: value, lambda b: {"scores": {"sort": value}})
    _the_picture_holds(figures(timeline))


def test_diff_plot_leaves_out_what_no_axis_holds_and_says_so():
    """rewind diff --plot of two runs with figures of 1e308: no overflow in the smoothed curves or their
    difference (a warning, here an error), the picture is saved, and its note names what was left out."""
    from rewind.tools.plots import pyplot
    from rewind.tools.timeline_compare import comparison_figure

    a = written_timeline(TINY, _loss, _evaluation, kl_of=lambda k, stage: 1e308 if k == 7 else 0.01)
    b = written_timeline(TINY, lambda k, stage: _loss(k + 1, stage), _evaluation)
    fig = comparison_figure(a, b)
    try:
        _the_picture_holds(fig)
        (note,) = [t.get_text() for t in fig.texts if "not drawn" in t.get_text()]
        assert "task loss" in note and "KL" in note
    finally:
        pyplot().close(fig)
