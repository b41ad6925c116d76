"""`rewind state RUN`: the folded control state of a run, now or as of any step or log record.

The default folds every record, so it also describes a live run another process is writing (reading
the log takes no lock). `--at-seq S` folds the raw log up to record S, superseded records included as
they counted then; `--at-step N` folds the effective records (what still counts after resumes) up to
and including step N's control events. What the schedule says about the *next* step comes from the
config in force at that point.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from rewind.tools.errors import CommandError, UsageError
from rewind.tools.runlog import load_records

KEY_WIDTH = 18


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("state", help="the folded control state of a run, now or at a step or log record")
    p.add_argument("run_dir", metavar="RUN")
    at = p.add_mutually_exclusive_group()
    at.add_argument("--at-step", type=int, metavar="N", help="the state after step N (effective records)")
    at.add_argument(
        "--at-seq", type=int, metavar="S", help="the state right after log record S (raw records)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object: the state plus the next step's plan")
    p.set_defaults(run=run)


# --- helpers shared with `rewind timeline` ----------------------------------------------------------


def fold_events(run_dir: str, events) -> Any:
    from rewind.states.fold import IllegalTransition, fold

    try:
        return fold(events)
    except IllegalTransition as exc:
        raise CommandError(f"{run_dir}: the log does not fold: {exc}", exit_code=1) from None


def status_text(state) -> str:
    if state.finished:
        return "finished"
    if state.stopped_reason:
        return f"stopped: {state.stopped_reason}"
    return "not finished"


def next_step_plan(schedule, state) -> dict | None:
    """What the schedule says about the step with index state.step; None when no step is left."""
    if state.finished or state.step >= schedule.num_steps:
        return None
    plan = schedule.step_plan(state.step)
    return {
        "step": plan.step,
        "tokens": plan.tokens,
        "stage": plan.stage,
        "weights": list(plan.weights),
        "rows": list(plan.rows),
        "lr": plan.lr,
        "beta": plan.beta,
    }


def json_safe(value: Any) -> Any:
    """NaN and infinities (a skipped step's loss) become null: the output stays strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def print_json(value: Any) -> None:
    print(json.dumps(json_safe(value), indent=1, allow_nan=False))


# --- rewind state -----------------------------------------------------------------------------------


def select_records(records: list, at_step: int | None, at_seq: int | None) -> tuple[list, dict | None, str]:
    """The records to fold, the point they describe (for JSON) and the same as a phrase."""
    from rewind.states.history import effective

    if at_seq is not None:
        first, last = records[0][0], records[-1][0]
        if not first <= at_seq <= last:
            raise UsageError(f"--at-seq {at_seq}: out of range; the log holds records {first}..{last}")
        selected = [(s, e) for s, e in records if s <= at_seq]
        return selected, {"seq": at_seq}, f"log record {at_seq} (raw records, superseded included)"
    if at_step is not None:
        kept = effective(records)
        last_step = max(e.step for _, e in kept)
        if not 0 <= at_step <= last_step:
            raise UsageError(
                f"--at-step {at_step}: out of range; the run reached step {last_step} (use 0..{last_step})"
            )
        selected = [(s, e) for s, e in kept if e.step <= at_step]
        return selected, {"step": at_step}, f"after step {at_step} (effective records)"
    return records, None, f"the end of the log (record {records[-1][0]})"


def run(args: argparse.Namespace) -> int:
    import msgspec

    from rewind.states.history import config_in_force
    from rewind.states.schedule import Schedule

    records = load_records(args.run_dir)
    selected, point, as_of = select_records(records, args.at_step, args.at_seq)
    state = fold_events(args.run_dir, (e for _, e in selected))
    config = config_in_force(selected)
    upcoming = next_step_plan(Schedule(config), state)
    if args.json:
        print_json(
            {
                "run": config.run.name,
                "run_dir": str(args.run_dir),
                "as_of": point,
                "status": status_text(state),
                **msgspec.to_builtins(state),
                "next_step": upcoming,
            }
        )
    else:
        print("\n".join(render_state(args.run_dir, records[0][1], state, config, upcoming, as_of)))
    return 0


def _line(key: str, value: object) -> str:
    return f"{key:<{KEY_WIDTH}} {value}"


def _checkpoint(ref) -> str:
    return f"{ref.checkpoint} (step {ref.step:,}, {ref.reason})"


def _listed(key: str, items: list[str], empty: str) -> list[str]:
    """One item per line under a single key, so long lists stay readable."""
    if not items:
        return [_line(key, empty)]
    return [_line(key if i == 0 else "", item) for i, item in enumerate(items)]


def render_state(run_dir: str, started, state, config, upcoming: dict | None, as_of: str) -> list[str]:
    tps = state.tokens_per_step
    mixture = ""
    if 0 <= state.stage < len(config.training.datasets):
        mixture = ": " + ", ".join(f"{s.name} {s.rate:g}" for s in config.training.datasets[state.stage])
    stage = (
        f"{state.stage} (of 0..{state.num_stages - 1}){mixture}" if state.stage >= 0 else "none entered yet"
    )
    lines = [
        _line("run", f"{config.run.name}  ({run_dir})"),
        _line("as of", as_of),
        _line("config", state.config_hash[:12]),
        _line("status", status_text(state)),
        _line("step", f"{state.step:,} of {state.num_steps:,}"),
        _line("tokens", f"{state.tokens:,} of {state.num_steps * tps:,}"),
        _line("stage", stage),
    ]
    if upcoming is None:
        why = "the run has finished" if state.finished else f"all {state.num_steps:,} steps are done"
        lines.append(_line("next step", f"none: {why}"))
    else:
        lines += [
            _line(
                "next step",
                f"index {upcoming['step']:,}, tokens {upcoming['tokens']:,}..{upcoming['tokens'] + tps:,}",
            ),
            _line("  stage", upcoming["stage"]),
            _line("  weights", " ".join(f"{w:.3f}" for w in upcoming["weights"])),
            _line("  rows", " ".join(str(r) for r in upcoming["rows"])),
            _line("  lr", f"{upcoming['lr']:.6g}"),
            _line("  beta", f"{upcoming['beta']:g}"),
        ]
    cursors = ", ".join(f"{name} {count:,}" for name, count in state.cursors.items())
    reference = state.reference
    lines += [
        _line("last loss", "none yet" if state.last_loss is None else f"{state.last_loss:.6g}"),
        _line("skipped steps", state.num_skipped_steps),
        _line("data cursors", cursors or "none yet (samples consumed per dataset)"),
        _line(
            "reference",
            f"stage {reference.stage}, step {reference.step:,}, checkpoint {reference.checkpoint or '(dry run)'}"
            if reference
            else "none (no refresh yet)",
        ),
        _line("pending refreshes", ", ".join(f"stage {s}" for s in state.pending_refreshes) or "none"),
    ]
    stacks = [
        f"stack {s.stack}: {s.num_blocks} blocks, {s.position}, trunk {s.trunk} (step {s.step:,})"
        for s in state.stacks
    ]
    lines += _listed(
        "stacks", stacks, f"none: the initial model only ({config.architecture.num_layers} layers)"
    )
    lines += [
        _line("fades started", ", ".join(f"boundary {b}" for b in state.fades_started) or "none"),
        _line("fades ended", ", ".join(f"boundary {b}" for b in state.fades_ended) or "none"),
        _line("last evaluation", _boundary(state.last_evaluated_boundary)),
        _line("last checkpoint", _checkpoint(state.last_checkpoint) if state.last_checkpoint else "none"),
    ]
    lines += _listed("live checkpoints", [_checkpoint(c) for c in state.live_checkpoints], "none")
    resumes = [
        f"from {r.checkpoint or 'the start'} at step {r.step:,}; "
        + (
            f"records {r.first_seq}..{r.last_seq} superseded"
            if r.last_seq >= r.first_seq
            else "nothing superseded"
        )
        for r in state.resumes
    ]
    lines += _listed("resumes", resumes, "none")
    parent = getattr(started, "parent", None)
    lines.append(
        _line(
            "parent run",
            f"{parent.run} (step {parent.step:,}, checkpoint {parent.checkpoint})" if parent else "none",
        )
    )
    return lines


def _boundary(boundary: int) -> str:
    if boundary == -2:
        return "none yet"
    if boundary == -1:
        return "before training"
    return f"after stage {boundary}"
