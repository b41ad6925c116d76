"""What a figure can draw: matplotlib's limits, margins and ticks compute with the span of what is drawn,
which overflows float64 for values near 1e308 (a traceback inside savefig, from a forged record or a
loss that overflowed), and an infinite value has no place on an axis. `Undrawn` leaves such values out
of a series, as a NaN already is (a gap), and names the series that lost some for the figure's note;
`drawable_steps` does it to a run's step columns before their smoothed curves are computed, so a huge
value neither makes them infinite nor, through a running sum it swamps, 0 ever after.
"""

from __future__ import annotations

import copy
import math

import numpy as np

from rewind.tools.timeline_buckets import StepBuckets, StepColumns

DRAWABLE = 1e300  # every figure beyond this magnitude is left out (2 x 1e300 x a margin stays finite)
LOSSES = ("first_loss", "loss_min", "loss_max")  # a bucket's loss columns besides its sum


class Undrawn:
    """Called on a series (and its name), returns it as float64 with every value that cannot be drawn
    (infinite, or beyond +-DRAWABLE) made NaN, a gap as a NaN already is, and remembers the name for
    the figure's note."""

    def __init__(self) -> None:
        self.names: dict[str, None] = {}  # (ordered, once each)

    def __call__(self, values, name: str) -> np.ndarray:
        array = np.array(values, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            bad = np.abs(array) > DRAWABLE  # (NaN compares False: a gap, not news)
        if bad.any():
            array[bad] = np.nan
            self.names[name] = None
        return array

    def points(self, xs_ys: tuple[list, list], name: str) -> tuple[list, np.ndarray]:
        return xs_ys[0], self(xs_ys[1], name)

    def note(self, fig) -> None:
        if self.names:
            fig.text(
                0.01, 0.0, f"not drawn, infinite or beyond ±1e{math.log10(DRAWABLE):.0f}: some values of "
                f"{', '.join(self.names)} (rewind log RUN --json has every figure)", fontsize=8, color="#C00000",
            )  # fmt: skip


def drawable_steps(buckets: StepBuckets, tokens_per_step: int, cuts: list[int], undrawn: Undrawn) -> StepColumns:
    """The columns of `buckets` with every figure that cannot be drawn left out: a gap where it stood,
    and out of the smoothed loss and KL (whose running sums it would make infinite, or 0 ever after)."""
    clean = copy.copy(buckets)
    for name, shown in [("lr", "learning rate"), ("beta", "KL weight"), *((n, "task loss") for n in LOSSES)]:
        setattr(clean, name, undrawn(getattr(buckets, name), shown))
    clean.last_beta = float(undrawn([buckets.last_beta], "KL weight")[0])
    for total, count, shown in (("loss_sum", "loss_count", "task loss"), ("kl_sum", "kl_count", "KL")):
        sums = undrawn(getattr(buckets, total), shown)
        setattr(clean, count, np.where(np.isnan(sums), 0, getattr(buckets, count)))
        setattr(clean, total, np.nan_to_num(sums, nan=0.0))
    with np.errstate(over="ignore", invalid="ignore"):
        steps = StepColumns(clean, tokens_per_step, cuts=cuts)
    for name, shown in (("smooth", "task loss"), ("kl", "KL")):  # (sums of several huge figures)
        setattr(steps, name, undrawn(getattr(steps, name), shown))
    return steps
