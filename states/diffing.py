"""Comparing two runs: where their histories part, and by how much they differ afterwards.

The pure half of `rewind diff`:
- only *content* events are compared (what training did: stages, fades, steps, validations, scores);
  bookkeeping (starts, resumes, config records, checkpoints, stops) is left out, so a run that was
  stopped and resumed equals the same run trained straight through;
- both streams are taken from the effective records (history.effective), and aligned at the step
  where the later-starting run began (a fork starts at its parent's checkpoint step);
- the first pair of events that `compare.first_difference` tells apart is the divergence; a stream
  that is a prefix of the other one ends early (a live or stopped run against a finished one);
- after it, per-metric summaries over the steps both runs logged.

`diff_streams` does it in one pass over each run's effective records, which may be iterators as long
as a log (`rewind.stores.runs.iter_effective`): memory does not grow with the runs' length
(`diffstream` says how). `diff_runs` is the same over whole logs held as lists, superseded records
included. The helpers below it answer the same questions about a list of records, for callers and
tests that hold one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rewind.states.config import Config
from rewind.states.config_identity import config_differences
from rewind.states.diffmetrics import MetricsAccumulator, UnorderedSteps, abs_delta, merge_by_step
from rewind.states.diffreport import (
    CONTENT_TYPES,
    IGNORED_FIELDS,
    SCALAR_METRICS,
    ConfigChange,
    DiffReport,
    Divergence,
    EvaluationPair,
    EventAt,
    MetricDelta,
    Metrics,
    Relation,
    RunEnd,
)
from rewind.states.diffstream import RunSide, alignment, changes_of, compare_content, content_after
from rewind.states.events import ConfigChanged, ForkOrigin, RunStarted
from rewind.states.history import SeqEvent, config_events, effective

__all__ = [
    "CONTENT_TYPES",
    "IGNORED_FIELDS",
    "SCALAR_METRICS",
    "ComputeSite",
    "ConfigChange",
    "DiffReport",
    "Divergence",
    "EvaluationPair",
    "EventAt",
    "MetricDelta",
    "Metrics",
    "Relation",
    "RunEnd",
    "UnorderedSteps",
    "abs_delta",
    "aligned_streams",
    "compute_site",
    "config_changes",
    "content_events",
    "content_from",
    "diff_runs",
    "diff_streams",
    "final_config",
    "fork_origin",
    "known_configs",
    "promises_bits",
    "start_step",
    "summarize_metrics",
]


ComputeSite = tuple[str, int]  # (device, number of processes) a segment of a run computed on


def compute_site(device: str, world_size: int) -> ComputeSite:
    """A recorded RunStarted/RunResumed (device, world size), with the defaults of a log that records
    none: the CPU, one process."""
    return (device or "cpu", max(world_size, 1))


def promises_bits(site: ComputeSite) -> bool:
    """Bits are promised only on the CPU in one process; elsewhere floats agree within a tolerance."""
    device, world_size = site
    return world_size == 1 and not device.startswith("cuda")


def diff_streams(
    effective_a: Iterable[SeqEvent], effective_b: Iterable[SeqEvent], *, rtol: float = 0.0, child: str = ""
) -> DiffReport:
    """The whole comparison, over each run's *effective* records in seq order, each read once and in
    step with the other. `child` says which run is a fork of the other ("a", "b" or ""): deciding it
    means resolving run locations, which is the caller's business.

    Raises ValueError for a stream that does not start with RunStarted, and UnorderedSteps (a
    ValueError too) for one whose steps go back."""
    side_a, side_b = RunSide(effective_a, "a"), RunSide(effective_b, "b")
    from_step, checkpoint, cut_a, cut_b = alignment(side_a.origin, side_b.origin)
    content_a = side_a.content(from_step, checkpoint, cut_a)
    content_b = side_b.content(from_step, checkpoint, cut_b)
    divergence, metrics = compare_content(content_a, content_b, from_step, rtol=rtol)
    # compare_content reads both to their ends, so each side has now seen every record.
    known = {**side_a.known_configs(), **side_b.known_configs()}
    return DiffReport(
        relation=Relation(child=child, parent_a=side_a.origin, parent_b=side_b.origin),
        config_differences=config_differences(side_a.final_config, side_b.final_config),
        config_changes={
            "a": changes_of(side_a.config_records, known),
            "b": changes_of(side_b.config_records, known),
        },
        compared_from_step=from_step,
        runs={"a": side_a.end(), "b": side_b.end()},
        rtol=rtol,
        divergence=divergence,
        metrics=metrics,
    )


def diff_runs(
    records_a: Sequence[SeqEvent], records_b: Sequence[SeqEvent], *, rtol: float = 0.0, child: str = ""
) -> DiffReport:
    """`diff_streams` over two whole logs held in memory, superseded records included."""
    return diff_streams(effective(records_a), effective(records_b), rtol=rtol, child=child)


# --- the same questions about a list of records -------------------------------------------------------


def fork_origin(records: Sequence[SeqEvent]) -> ForkOrigin | None:
    if not records or not isinstance(records[0][1], RunStarted):
        raise ValueError("the log does not start with RunStarted")
    return records[0][1].parent


def start_step(records: Sequence[SeqEvent]) -> int:
    origin = fork_origin(records)
    return origin.step if origin is not None else 0


def final_config(records: Sequence[SeqEvent]) -> Config:
    """The config in force at the end: RunStarted's, or that of the last effective ConfigChanged."""
    return config_events(effective(records))[-1][1].config


def known_configs(records: Sequence[SeqEvent]) -> dict[str, Config]:
    """Every config a run's effective log records, by its hash."""
    return {
        e.config_hash: e.config for _, e in effective(records) if isinstance(e, RunStarted | ConfigChanged)
    }


def config_changes(records: Sequence[SeqEvent], known: dict[str, Config] | None = None) -> list[ConfigChange]:
    """The run's effective ConfigChanged records, each compared with the config it replaced: one this
    log records, or one of `known` (a fork child's log starts under its own config; the config it
    changed from is its parent's)."""
    return changes_of(config_events(effective(records)), known or {})


def content_events(records: Iterable[SeqEvent]) -> list[SeqEvent]:
    return [(seq, e) for seq, e in records if isinstance(e, CONTENT_TYPES)]


def content_from(records: Sequence[SeqEvent], step: int, checkpoint: str) -> list[SeqEvent]:
    """The effective content a run logged after the point where a fork of it at `step` from
    `checkpoint` starts (see diffstream.content_after)."""
    return list(content_after(effective(records), step, checkpoint))


def aligned_streams(
    records_a: Sequence[SeqEvent], records_b: Sequence[SeqEvent]
) -> tuple[int, list[SeqEvent], list[SeqEvent]]:
    """(S, content of A, content of B) compared from step S = the later of the two start steps (see
    diffstream.alignment)."""
    side_a, side_b = RunSide(effective(records_a)), RunSide(effective(records_b))
    from_step, checkpoint, cut_a, cut_b = alignment(side_a.origin, side_b.origin)
    return (
        from_step,
        list(side_a.content(from_step, checkpoint, cut_a)),
        list(side_b.content(from_step, checkpoint, cut_b)),
    )


def summarize_metrics(
    content_a: Iterable[SeqEvent], content_b: Iterable[SeqEvent], from_step: int
) -> Metrics:
    """The per-metric summaries of two content streams over the steps from `from_step` on."""
    metrics = MetricsAccumulator(from_step)
    merge_by_step(metrics, (e for _, e in content_a), (e for _, e in content_b))
    return metrics.result()
