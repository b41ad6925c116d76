"""The metrics projection: JSONL lines and TensorBoard scalars from (seq, event) records, rebuilt byte for
byte. Resuming it in place is tested in test_metrics_resume.py."""

from __future__ import annotations

import json
import math
import os
import struct

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rewind.states.events import (
    CheckpointCommitted,
    Evaluated,
    FadeStarted,
    StageEntered,
    StepCommitted,
    Validated,
)
from rewind.stores.metrics import JSONL_NAME, TB_DIR_NAME, MetricsError, MetricsProjection, project, rebuild

TOKENS_PER_STEP = 64


def step_event(step: int, loss: float, **fields) -> StepCommitted:
    defaults = {"stage": 0, "lr": 1e-3 * step, "beta": 0.01, "kl": 0.125, "grad_norm": 1.5, "rows": [3, 1]}
    return StepCommitted(step=step, tokens=step * TOKENS_PER_STEP, loss=loss, **{**defaults, **fields})


def synthetic_events() -> list:
    return [
        StageEntered(step=0, tokens=0, stage=0),
        Evaluated(step=0, tokens=0, boundary=-1, scores={"copy": 0.0}, losses={"copy": 3.0}),
        step_event(1, 2.5),
        step_event(2, 2.25, cursors={"a": 8}),
        Validated(step=2, tokens=128, losses={"b": 2.0, "a": 2.125}),
        CheckpointCommitted(step=2, tokens=128, checkpoint="00000002-0123abcd", manifest_sha256="0" * 64),
        FadeStarted(step=2, tokens=128, boundary=0),
        step_event(3, float("nan"), skipped=True, stage=1),
        Evaluated(step=3, tokens=192, boundary=0, scores={"copy": 0.5, "add": 0.25}, losses={"copy": 1.5}),
    ]


def synthetic_records() -> list:
    """(seq, event) pairs, as the log numbers them."""
    return list(enumerate(synthetic_events()))


# The seq of each line is the index of its event in synthetic_events().
EXPECTED_LINES = [
    {
        "type": "evaluation",
        "seq": 1,
        "step": 0,
        "tokens": 0,
        "boundary": -1,
        "scores": {"copy": 0.0},
        "losses": {"copy": 3.0},
        "perplexity": {"copy": math.exp(3.0)},
        "bits_per_byte": {},
    },
    {
        "type": "train",
        "seq": 2,
        "step": 1,
        "tokens": 64,
        "stage": 0,
        "loss": 2.5,
        "kl": 0.125,
        "lr": 1e-3,
        "beta": 0.01,
    }
    | {"grad_norm": 1.5, "rows": [3, 1], "skipped": False},
    {
        "type": "train",
        "seq": 3,
        "step": 2,
        "tokens": 128,
        "stage": 0,
        "loss": 2.25,
        "kl": 0.125,
        "lr": 2e-3,
        "beta": 0.01,
    }
    | {"grad_norm": 1.5, "rows": [3, 1], "skipped": False},
    {"type": "validation", "seq": 4, "step": 2, "tokens": 128, "losses": {"a": 2.125, "b": 2.0}},
    {
        "type": "train",
        "seq": 7,
        "step": 3,
        "tokens": 192,
        "stage": 1,
        "loss": None,
        "kl": 0.125,
        "lr": 3e-3,
        "beta": 0.01,
    }
    | {"grad_norm": 1.5, "rows": [3, 1], "skipped": True},
    {"type": "evaluation", "seq": 8, "step": 3, "tokens": 192, "boundary": 0}
    | {"scores": {"add": 0.25, "copy": 0.5}, "losses": {"copy": 1.5}, "perplexity": {"copy": math.exp(1.5)}}
    | {"bits_per_byte": {}},
]


def jsonl_bytes(run_dir) -> bytes:
    with open(os.path.join(run_dir, JSONL_NAME), "rb") as handle:
        return handle.read()


def jsonl_records(run_dir) -> list[dict]:
    return [json.loads(line) for line in jsonl_bytes(run_dir).splitlines()]


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    accumulator = EventAccumulator(os.path.join(run_dir, TB_DIR_NAME))
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]
    }


def bit_patterns(found: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, bytes]]]:
    # Compares NaN with NaN, which == on floats cannot.
    return {
        tag: [(step, struct.pack("<f", value)) for step, value in points] for tag, points in found.items()
    }


def live(run_dir, records) -> None:
    with MetricsProjection(run_dir) as projection:
        for seq, event in records:
            projection.observe(seq, event)


def test_live_projection_writes_one_line_per_metric_event(tmp_path):
    live(tmp_path, synthetic_records())
    assert jsonl_records(tmp_path) == EXPECTED_LINES
    # Key order is part of the format: type, seq, step, tokens first.
    assert jsonl_bytes(tmp_path).startswith(
        b'{"type":"evaluation","seq":1,"step":0,"tokens":0,"boundary":-1,'
    )


def test_flush_makes_lines_visible_while_the_projection_stays_open(tmp_path):
    projection = MetricsProjection(tmp_path)
    records = synthetic_records()
    for seq, event in records[:3]:
        projection.observe(seq, event)
    projection.flush()
    assert jsonl_records(tmp_path) == EXPECTED_LINES[:2]
    for seq, event in records[3:]:
        projection.observe(seq, event)
    projection.close()
    assert jsonl_records(tmp_path) == EXPECTED_LINES


def test_tensorboard_gets_every_scalar_against_the_step(tmp_path):
    live(tmp_path, synthetic_records())
    found = scalars(tmp_path)
    f32 = lambda value: float(np.float32(value))  # noqa: E731 - TensorBoard stores float32
    assert sorted(found) == sorted(
        [f"train/{name}" for name in ("loss", "kl", "lr", "beta", "grad_norm", "stage")]
        + ["validation/a", "validation/b", "eval/copy/accuracy", "eval/add/accuracy", "eval/copy/loss"]
        + ["eval/copy/perplexity"]
    )
    assert found["train/loss"][:2] == [(1, 2.5), (2, 2.25)]
    assert found["train/loss"][2][0] == 3 and math.isnan(found["train/loss"][2][1])
    assert found["train/lr"] == [(1, f32(1e-3)), (2, f32(2e-3)), (3, f32(3e-3))]
    assert found["train/stage"] == [(1, 0.0), (2, 0.0), (3, 1.0)]
    assert found["train/grad_norm"] == [(1, 1.5), (2, 1.5), (3, 1.5)]
    assert found["validation/a"] == [(2, 2.125)] and found["validation/b"] == [(2, 2.0)]
    assert found["eval/copy/accuracy"] == [(0, 0.0), (3, 0.5)]
    assert found["eval/add/accuracy"] == [(3, 0.25)]
    assert found["eval/copy/loss"] == [(0, 3.0), (3, 1.5)]
    assert found["eval/copy/perplexity"] == [(0, f32(math.exp(3.0))), (3, f32(math.exp(1.5)))]


def test_rebuild_gives_the_same_bytes_as_the_live_projection(tmp_path):
    live(tmp_path / "live", synthetic_records())
    rebuild(tmp_path / "rebuilt", iter(synthetic_records()))
    assert jsonl_bytes(tmp_path / "rebuilt") == jsonl_bytes(tmp_path / "live")
    assert bit_patterns(scalars(tmp_path / "rebuilt")) == bit_patterns(scalars(tmp_path / "live"))


def test_rebuild_on_resume_drops_superseded_events_then_keeps_appending(tmp_path):
    records = synthetic_records()
    projection = MetricsProjection(tmp_path / "run")
    for seq, event in [
        *records,
        (9, step_event(4, 9.0)),
        (10, step_event(5, 9.5)),
    ]:  # seqs 9-10 will be superseded
        projection.observe(seq, event)
    projection.flush()
    projection.rebuild(tmp_path / "run", records)  # the effective stream, as the resumed process sees it
    continuation = [(12, step_event(4, 1.0)), (13, Validated(step=4, tokens=256, losses={"a": 1.0}))]
    for seq, event in continuation:
        projection.observe(seq, event)
    projection.close()

    live(tmp_path / "straight", [*records, *continuation])
    assert jsonl_bytes(tmp_path / "run") == jsonl_bytes(tmp_path / "straight")
    train_lines = [line for line in jsonl_records(tmp_path / "run") if line["type"] == "train"]
    assert [(line["step"], line["loss"]) for line in train_lines][-2:] == [(3, None), (4, 1.0)]
    assert scalars(tmp_path / "run")["train/loss"][-1] == (4, 1.0)
    assert [step for step, _ in scalars(tmp_path / "run")["train/loss"]] == [1, 2, 3, 4]
    assert len(os.listdir(tmp_path / "run" / TB_DIR_NAME)) == 1  # the old event file is gone


def test_events_without_metrics_leave_no_files(tmp_path):
    live(
        tmp_path,
        [(0, StageEntered(step=0, tokens=0, stage=0)), (1, FadeStarted(step=0, tokens=0, boundary=0))],
    )
    assert os.listdir(tmp_path) == []
    assert project(StageEntered(step=0, tokens=0, stage=0)) is None


def test_metrics_are_local_only(tmp_path):
    with pytest.raises(MetricsError, match="local directories only, not memory://"):
        MetricsProjection("memory://somewhere/run")
    projection = MetricsProjection(tmp_path / "a")
    with pytest.raises(MetricsError, match="this projection writes"):
        projection.rebuild(tmp_path / "b", [])
