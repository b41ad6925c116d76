"""Events for the log tests: realistic field values, every type, and a hypothesis strategy."""

from __future__ import annotations

from hypothesis import strategies as st

from rewind.states.events import (
    CheckpointCommitted,
    Evaluated,
    StageEntered,
    StepCommitted,
    Validated,
)

DATASETS = ("grammar", "reverse", "sort", "add")


def step_event(step: int, tokens_per_step: int = 512) -> StepCommitted:
    return StepCommitted(
        step=step,
        tokens=step * tokens_per_step,
        stage=step // 50,
        lr=3e-4 * (1 - step / 10_000),
        beta=0.05,
        loss=2.5 / (1 + step / 100),
        kl=0.01,
        grad_norm=0.8,
        rows=[6, 2],
        cursors={name: step * (i + 1) for i, name in enumerate(DATASETS)},
    )


def sample_events(num_events: int, first_step: int = 1) -> list:
    """A mix of event types with growing steps, as an engine would log them."""
    events: list = []
    step = first_step
    while len(events) < num_events:
        kind = len(events) % 7
        if kind == 3:
            events.append(Validated(step=step, tokens=step * 512, losses={"grammar": 1.5, "sort": 0.75}))
        elif kind == 5:
            events.append(
                CheckpointCommitted(
                    step=step,
                    tokens=step * 512,
                    checkpoint=f"{step:08d}-1a2b3c4d",
                    manifest_sha256="ab" * 32,
                    files={"model.safetensors": "cd" * 32},
                )
            )
        elif kind == 6:
            events.append(Evaluated(step=step, tokens=step * 512, boundary=0, scores={"add": 0.5}))
        else:
            events.append(step_event(step))
            step += 1
    return events


def events_strategy() -> st.SearchStrategy:
    """Small events with arbitrary-ish field values (sizes vary, so frames do too)."""
    ints = st.integers(min_value=0, max_value=2**40)
    floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
    return st.one_of(
        st.builds(StageEntered, step=ints, tokens=ints, stage=st.integers(0, 9)),
        st.builds(
            StepCommitted,
            step=ints,
            tokens=ints,
            stage=st.integers(0, 9),
            lr=floats,
            beta=floats,
            loss=floats,
            rows=st.lists(st.integers(0, 64), max_size=4),
            cursors=st.dictionaries(st.sampled_from(DATASETS), ints, max_size=4),
        ),
        st.builds(
            Validated,
            step=ints,
            tokens=ints,
            losses=st.dictionaries(st.text(max_size=12), floats, max_size=3),
        ),
    )
