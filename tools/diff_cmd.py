"""`rewind diff RUN_A RUN_B`: how two runs are related, how their configs differ, the first event where
they part, and by how much their metrics differ after it.

Exit 0 when the runs do not diverge, 1 when they do (like diff(1)), 2 for bad input. The comparison
itself is pure and lives in `rewind.states.diffing`; this module streams the two logs into it
(lock-free, so a live run can be compared while it trains; never held whole, so two million-step logs
compare in bounded memory) and prints. Floats are equal bit for bit unless `--rtol`; when floats differ
bitwise between runs that recorded different devices or numbers of processes, a hint says so.
"""

from __future__ import annotations

import argparse
import math
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rewind.states.diffing import (
    ComputeSite,
    DiffReport,
    EvaluationPair,
    Metrics,
    Relation,
    RunEnd,
    compute_site,
)
from rewind.states.events import ForkOrigin, RunResumed, RunStarted
from rewind.tools.errors import CommandError, UsageError
from rewind.tools.jsonout import NON_FINITE_HELP, print_json
from rewind.tools.replay_cmd import TOLERANCE_ADVICE, describe_sites


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diff",
        help="compare two runs: relation, config, first divergent event, metric deltas (exit 1 if they diverge)",
        description="Compare two runs. Exit 0 when they do not diverge, 1 when they do (like diff(1): a script "
        "that runs it under `set -e` stops there), 2 for bad input.",
    )
    p.add_argument("run_a", metavar="RUN_A")
    p.add_argument("run_b", metavar="RUN_B")
    p.add_argument(
        "--rtol",
        type=float,
        default=0.0,
        metavar="R",
        help="floats equal within relative tolerance R (default: bitwise)",
    )
    p.add_argument(
        "--json", action="store_true", help=f"one JSON object: relation, configs, divergence, metrics ({NON_FINITE_HELP})"
    )
    p.add_argument(
        "--plot",
        metavar="OUT.png",
        help="overlay both runs in the timeline's panels (A solid, B dashed): loss, accuracy, LR, KL, mixture",
    )
    p.set_defaults(run=run)


def same_run(named: str, run_dir: str) -> bool:
    """Does a ForkOrigin's `run` name this run directory? Paths by where they resolve, URLs as written."""
    if "://" in named or "://" in run_dir:
        return named.rstrip("/") == run_dir.rstrip("/")
    return Path(named).resolve() == Path(run_dir).resolve()


def run(args: argparse.Namespace) -> int:
    import msgspec

    from rewind.states.diffing import UnorderedSteps, diff_streams
    from rewind.tools.streamlog import effective_records

    if not (math.isfinite(args.rtol) and args.rtol >= 0.0):
        raise UsageError(f"--rtol {args.rtol}: must be a finite number >= 0")
    if args.plot is not None:
        from rewind.tools.outfile import check_target

        check_target(args.plot, "--plot", ".png")
    (_, started_a), records_a = effective_records(args.run_a)
    (_, started_b), records_b = effective_records(args.run_b)
    parent_a, parent_b = started_a.parent, started_b.parent
    child = ""
    if parent_b is not None and same_run(parent_b.run, args.run_a):
        child = "b"
    elif parent_a is not None and same_run(parent_a.run, args.run_b):
        child = "a"
    sites_a, sites_b = [], []
    try:
        report = diff_streams(
            watch_sites(records_a, sites_a), watch_sites(records_b, sites_b), rtol=args.rtol, child=child
        )
    except UnorderedSteps as exc:  # no run writes such a log; one put together by hand might
        run_dir = args.run_a if exc.side == "a" else args.run_b
        raise CommandError(f"{run_dir}: the effective records go back a step: {exc}", exit_code=1) from None
    hint = sites_hint(report, sites_a, sites_b)
    if args.json:
        extra = {"plot": str(args.plot)} if args.plot else {}
        computed_on = {
            side: [{"device": device, "world_size": size} for device, size in sites]
            for side, sites in (("a", sites_a), ("b", sites_b))
        }
        print_json(
            {
                "run_a": args.run_a,
                "run_b": args.run_b,
                **msgspec.to_builtins(report),
                "computed_on": computed_on,
                "hint": hint or None,
                **extra,
            }
        )
    else:
        lines = render(report, args.run_a, args.run_b)
        print("\n".join([*lines, "", f"hint: {hint}"] if hint else lines))
    if args.plot:
        from rewind.tools.timeline_cmd import read_timeline
        from rewind.tools.timeline_compare import plot_comparison

        timelines = [read_timeline(run_dir, with_plot=True) for run_dir in (args.run_a, args.run_b)]
        plot_comparison(*timelines, args.plot, child=child)  # the fork point is marked
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0 if report.divergence is None else 1


def watch_sites(records: Iterable[tuple], sites: list[ComputeSite]) -> Iterator[tuple]:
    """`records` passed through unchanged, noting in `sites` each (device, world size) a RunStarted or
    RunResumed records as it streams past (the logs are never held whole)."""
    for seq, event in records:
        if isinstance(event, RunStarted | RunResumed):
            site = compute_site(event.device, event.world_size)
            if site not in sites:
                sites.append(site)
        yield seq, event


def sites_hint(report: DiffReport, sites_a: list[ComputeSite], sites_b: list[ComputeSite]) -> str:
    """Why floats that differ bitwise may be no fault: the runs computed on different devices or in
    different numbers of processes, which promise the same numbers only within a tolerance. "" otherwise."""
    found = report.divergence
    if report.rtol != 0 or found is None or found.kind != "event" or set(sites_a) == set(sites_b):
        return ""
    if not (isinstance(found.value_a, float) and isinstance(found.value_b, float)):
        return ""
    return (
        f"A computed on {describe_sites(sites_a)}, B on {describe_sites(sites_b)}: floats computed on different "
        f"devices or by different numbers of processes agree within a tolerance, not bit for bit; compare with "
        f"{TOLERANCE_ADVICE}"
    )


# --- the readable report -----------------------------------------------------------------------------


def render(report: DiffReport, run_a: str, run_b: str) -> list[str]:
    ends, width = report.runs, max(len(run_a), len(run_b))
    lines = [
        f"{side.upper()}  {path.ljust(width)}  ({_extent(ends[side])})"
        for side, path in (("a", run_a), ("b", run_b))
    ]
    lines += ["", "relation", *(f"  {line}" for line in _relation(report.relation))]
    lines += ["", *_configs(report)]
    lines += ["", *_divergence(report)]
    if report.divergence is not None:
        lines += ["", *_metrics(report.metrics, ends)]
    return lines


def _extent(end: RunEnd) -> str:
    return f"steps {end.start_step}..{end.last_step}, {_finished(end)}"


def _relation(relation: Relation) -> list[str]:
    def fork_line(name: str, of: str, origin: ForkOrigin) -> str:
        source = f"checkpoint {origin.checkpoint}" if origin.checkpoint else "from scratch"
        return f"{name} is a fork of {of} at step {origin.step} ({source})"

    if relation.child == "b":
        return [fork_line("B", "A", relation.parent_b)]
    if relation.child == "a":
        return [fork_line("A", "B", relation.parent_a)]
    lines = ["neither run is a fork of the other"]
    for name, origin in (("A", relation.parent_a), ("B", relation.parent_b)):
        if origin is not None:
            lines.append(fork_line(name, origin.run, origin))
    return lines


def _configs(report: DiffReport) -> list[str]:
    differences = report.config_differences
    if differences:
        lines = [f"config in force at the end: {len(differences)} difference(s), A -> B"]
        lines += [f"  {line}" for line in differences]
    else:
        lines = ["config in force at the end: the same"]
    changes = [(side, change) for side in ("a", "b") for change in report.config_changes[side]]
    if changes:
        lines.append("config changed mid-run")
    for side, change in changes:
        what = "; ".join(change.changes) or "no field differs"
        if not change.previous_known:
            what = f"from config {change.previous_hash[:12]}, which neither log records"
        lines.append(f"  {side.upper()} from step {change.step} (seq {change.seq}): {what}")
    return lines


def _divergence(report: DiffReport) -> list[str]:
    ends, found = report.runs, report.divergence
    scope = (
        f"content events from step {report.compared_from_step}: {ends['a'].num_compared} in A, "
        f"{ends['b'].num_compared} in B"
    )
    if found is None:
        how = f"within rtol {report.rtol!r}" if report.rtol > 0 else "bit for bit"
        return [f"no divergence: the runs agree {how} ({scope})"]
    lines = [f"first divergence ({scope})"]
    if found.kind == "ends":
        ended, other = found.ended, ("b" if found.ended == "a" else "a")
        next_event = found.b if ended == "a" else found.a
        lines.append(
            f"  run {ended.upper()} ends at step {ends[ended].last_step} ({_finished(ends[ended])}); "
            f"run {other.upper()} goes on to step {ends[other].last_step} ({_finished(ends[other])})"
        )
        where = f"{next_event.type} at step {next_event.step} (seq {next_event.seq})"
        lines.append(f"  {other.upper()}'s next event: {where}")
        return lines
    where = found.a.type if found.a.type == found.b.type else f"{found.a.type} / {found.b.type}"
    lines.append(f"  at step {found.step}: {where}, field {found.field}")
    value_a, value_b = _shown(found.value_a, found.value_b)
    rows = [
        ("", "A", "B"),
        ("type", found.a.type, found.b.type),
        ("step", str(found.a.step), str(found.b.step)),
        ("seq", str(found.a.seq), str(found.b.seq)),
        (found.field, value_a, value_b),
    ]
    return lines + _table(rows, indent=4)


def _finished(end: RunEnd) -> str:
    return "finished" if end.finished else "not finished"


def _shown(a: Any, b: Any) -> tuple[str, str]:
    """Both values, floats in full precision; with their bits too when their reprs look the same
    (NaNs with different payloads)."""

    def text(value: Any) -> str:
        return "(absent)" if value is None else repr(value)

    shown_a, shown_b = text(a), text(b)
    if shown_a == shown_b and isinstance(a, float) and isinstance(b, float):
        shown_a += f" (bits {struct.pack('>d', a).hex()})"
        shown_b += f" (bits {struct.pack('>d', b).hex()})"
    return shown_a, shown_b


def _metrics(metrics: Metrics, ends: dict[str, RunEnd]) -> list[str]:
    last = max(ends["a"].last_step, ends["b"].last_step)
    lines = [
        f"after the divergence (steps {metrics.from_step}..{last}: {metrics.num_steps_both} in both, "
        f"{metrics.num_steps_only_a} only in A, {metrics.num_steps_only_b} only in B)"
    ]
    # Without a step logged by both runs (one ended early) the per-step deltas would be zeros that mean
    # nothing; validations and evaluations can still be matched.
    scalars = metrics.scalars if metrics.num_steps_both else []
    named = [(m.name, m) for m in scalars] + [(f"val {m.name}", m) for m in metrics.validation]
    if named:
        rows = [("metric", "max |delta|", "at step", "steps differing")]
        rows += [
            (name, f"{m.max_abs_delta:.6g}", _or_dash(m.at_step), str(m.num_steps_different))
            for name, m in named
        ]
        lines += _table(rows, indent=2)
    if metrics.num_steps_both:
        lines.append(
            f"  rows: {metrics.num_rows_steps_different} step(s) differ "
            f"(max row difference {metrics.max_row_difference}); "
            f"cursors: {metrics.num_cursor_steps_different} step(s) differ"
        )
    else:
        lines.append("  no step logged by both runs from here on")
    if not metrics.validation:
        lines.append("  validation: no step validated in both runs")
    if metrics.evaluations:
        lines += ["  evaluation scores", *_evaluations(metrics.evaluations)]
    return lines


def _evaluations(pairs: list[EvaluationPair]) -> list[str]:
    table = [("boundary", "task", "A", "B", "B - A")]
    for pair in pairs:
        same = pair.step_a == pair.step_b
        steps = _or_dash(pair.step_a) if same else f"{_or_dash(pair.step_a)} | {_or_dash(pair.step_b)}"
        scores_a, scores_b = pair.scores_a or {}, pair.scores_b or {}
        for i, task in enumerate(sorted(scores_a.keys() | scores_b.keys())):
            a, b = scores_a.get(task), scores_b.get(task)
            delta = "-" if a is None or b is None else ("0" if a == b else f"{b - a:+.6g}")
            table.append(("" if i else f"{pair.boundary} (step {steps})", task, _score(a), _score(b), delta))
    return _table(table, indent=4)


def _or_dash(value: int | None) -> str:
    return "-" if value is None else str(value)


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.6g}"


def _table(rows: list[tuple[str, ...]], indent: int) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        (" " * indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))).rstrip()
        for row in rows
    ]
