"""`rewind timeline RUN`: the story of a run. A header, one table row per stage (loss, validation and the
boundary evaluation that closes it), then every control marker in token order; `--plot` draws it.

Curves and the table come from the effective records (what still counts after resumes); resumes,
stops and non-finite losses from the raw log, because they are what happened to the run. The log is
read once, as a stream (`tools.timeline_scan` keeps what the summary and the plot need), so a
million-step run takes seconds and a bounded amount of memory.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from rewind.states.stagekinds.rules import LOSS_TIES
from rewind.tools.jsonout import NON_FINITE_HELP, print_json
from rewind.tools.state_cmd import fold_events, status_text

MAX_CHECKPOINT_STEPS_SHOWN = 12


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("timeline", help="the story of a run: stages, losses, evaluations, resumes (--plot)")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument(
        "--plot", metavar="OUT.png", help="write a picture of the run: loss, evaluations, LR/KL, mixture"
    )
    p.add_argument("--json", action="store_true", help=f"the summary as one JSON object ({NON_FINITE_HELP})")
    p.set_defaults(run=run)


def read_timeline(run_dir: str, *, with_plot: bool = False) -> Any:
    """The run's `Timeline` (tools.timeline_scan): its log read once, after a first pass for the
    superseded ranges (see stores.runs.superseded_ranges), and folded on the way; never held."""
    from rewind.tools.streamlog import marked_records
    from rewind.tools.timeline_scan import Timeline

    records = marked_records(run_dir)
    timeline = Timeline(run_dir, with_plot=with_plot)

    def events() -> Any:
        for seq, event, superseded in records:
            timeline.add(seq, event, superseded)
            yield event

    return timeline.finish(fold_events(run_dir, events()))


# --- the summary ------------------------------------------------------------------------------------


def kl_columns(timeline, stage: int, kl_mean: float | None) -> dict:
    """For a dpo or grpo stage, whose beta is 0 by rule, what ties it to the reference instead
    (rewind.tools.kl_terms: "kl", as setting, value and penalty) and the mean KL that weighs: a grpo
    stage's logged estimate, none for a dpo stage; a stage tied by its beta keeps its row as it was."""
    from rewind.tools.kl_terms import kl_term

    stages = timeline.config.stages
    term = kl_term(stages[stage]) if stage < len(stages) else None
    if term is None or term.setting == "beta":
        return {"kl_mean": kl_mean}
    steps = timeline.stage_steps(stage)
    grpo_kl = steps.own_kl_sum / steps.num_own_kl if steps.num_own_kl and term.penalty > 0 else None
    return {"kl_mean": grpo_kl if term.setting == "grpo.kl_beta" else None, "kl": term._asdict()}


def stage_rows(timeline) -> list[dict]:
    evaluated = {e.boundary: e.scores for e in timeline.evaluations}
    bits = {e.boundary: e.bits_per_byte for e in timeline.evaluations if e.bits_per_byte}
    post = {e.boundary: e.posttraining for e in timeline.evaluations if e.posttraining}
    tps = timeline.schedule.tokens_per_step
    rows = []
    for stage in range(timeline.schedule.num_stages):
        steps = timeline.stage_steps(stage)
        first, last = steps.first, steps.last
        losses = steps.losses()  # loss_start, loss_end, loss_min, kl_mean (of the steps with beta > 0)
        rows.append(
            {
                "stage": stage,
                "datasets": {s.name: s.rate for s in timeline.config.stages[stage].datasets},
                "num_steps": steps.num_steps,
                "first_step": first.step if first else None,
                "last_step": last.step if last else None,
                "tokens_start": first.tokens - tps if first else None,
                "tokens_end": last.tokens if last else None,
                **losses,
                "beta": timeline.schedule.betas[stage] if stage < len(timeline.schedule.betas) else 0.0,
                **kl_columns(timeline, stage, losses["kl_mean"]),  # kl (the stage's term), kl_mean
                "validation": timeline.validated.get(stage, {}),
                "evaluation": evaluated.get(stage),
                "bits_per_byte": bits.get(stage),  # held-out text at the stage's end (None: no text scored)
                "posttraining": post.get(stage),  # held-out pass@1, pass@G, ... (None: a pretraining run)
            }
        )
    return rows


def markers(timeline) -> list[dict]:
    """Control markers in token order (then log order). Checkpoints are summarised separately."""
    from rewind.states.config_identity import config_differences
    from rewind.states.events import (
        ConfigChanged,
        FadeEnded,
        FadeStarted,
        NonFiniteLoss,
        OptimizerReset,
        ReferenceRefreshed,
        RunResumed,
        RunStopped,
        StackAppended,
        StageEntered,
    )

    found: list[dict] = []

    def add(seq: int, event, kind: str, text: str, **fields) -> None:
        found.append(
            {"kind": kind, "seq": seq, "step": event.step, "tokens": event.tokens, "text": text, **fields}
        )

    configs = timeline.configs
    datasets = [stage.datasets for stage in timeline.config.stages]
    for seq, e in timeline.control:
        match e:
            case StageEntered(stage=stage):
                mixture = ", ".join(s.name for s in datasets[stage]) if stage < len(datasets) else ""
                add(seq, e, "stage_entered", f"stage {stage} entered ({mixture})", stage=stage)
            case FadeStarted(boundary=b):
                add(seq, e, "fade_started", f"fade {b} -> {b + 1} started", boundary=b)
            case FadeEnded(boundary=b):
                add(seq, e, "fade_ended", f"fade {b} -> {b + 1} ended", boundary=b)
            case ReferenceRefreshed(stage=stage, checkpoint=checkpoint):
                text = f"KL reference refreshed for stage {stage} ({checkpoint or 'dry run'})"
                add(seq, e, "reference_refreshed", text, stage=stage, checkpoint=checkpoint)
            case OptimizerReset(stage=stage, lr_restarted=restarted):
                lr = "the LR restarts its warmup" if restarted else "the LR curve goes on"
                add(seq, e, "optimizer_reset", f"optimizer reset for stage {stage}: moments cleared, {lr}", stage=stage)
            case StackAppended():
                text = f"stack {e.stack} joined: {e.num_blocks} blocks, {e.position}, trunk {e.trunk}"
                add(seq, e, "stack_appended", text, stack=e.stack, num_blocks=e.num_blocks)
            case ConfigChanged(previous_hash=previous):
                changes = config_differences(configs[previous], e.config) if previous in configs else []
                shown = "; ".join(changes[:3]) + (
                    f"; and {len(changes) - 3} more" if len(changes) > 3 else ""
                )
                add(
                    seq,
                    e,
                    "config_changed",
                    f"config changed (fork): {shown or e.config_hash[:12]}",
                    changes=changes,
                )
    for seq, e in timeline.raw_markers:
        match e:
            case RunResumed(superseded_first_seq=first, superseded_last_seq=last):
                steps = [step for s, step in timeline.redone if first <= s <= last]
                lost = f"records {first}..{last} superseded" if last >= first else "nothing superseded"
                if steps:
                    lost += f" (steps {min(steps)}..{max(steps)} recomputed)"
                text = f"resumed from {e.checkpoint or 'the start'} at step {e.step:,}; {lost}"
                add(
                    seq,
                    e,
                    "resumed",
                    text,
                    checkpoint=e.checkpoint,
                    superseded=[first, last],
                    superseded_steps=steps,
                )
            case RunStopped(reason=reason):
                add(seq, e, "stopped", f"stopped: {reason}", reason=reason)
            case NonFiniteLoss(loss=loss, action=action):
                add(seq, e, "nonfinite_loss", f"non-finite loss {loss} ({action})", action=action)
    return sorted(found, key=lambda m: (m["tokens"], m["seq"]))


def checkpoint_summary(timeline) -> dict:
    return {
        "num_written": len(timeline.checkpoint_steps),
        "reasons": dict(timeline.checkpoint_reasons),
        "steps": list(timeline.checkpoint_steps),
        "live": [c.checkpoint for c in timeline.state.live_checkpoints],
    }


def summarize(timeline) -> dict:
    """The whole summary of a `Timeline` (what `--json` prints and `render` lays out)."""
    state, schedule = timeline.state, timeline.schedule
    before = [e for e in timeline.evaluations if e.boundary == -1]
    return {
        "run": timeline.config.run.name,
        "run_dir": str(timeline.run_dir),
        "status": status_text(state),
        "finished": state.finished,
        "step": state.step,
        "num_steps": schedule.num_steps,
        "tokens": state.tokens,
        "total_tokens": schedule.num_steps * schedule.tokens_per_step,
        "tokens_per_step": schedule.tokens_per_step,
        "num_resumes": timeline.num_resumes,
        "evaluation_before_training": before[-1].scores if before else None,
        "posttraining_before_training": (before[-1].posttraining or None) if before else None,
        "stages": stage_rows(timeline),
        "markers": markers(timeline),
        "checkpoints": checkpoint_summary(timeline),
    }


# --- text -------------------------------------------------------------------------------------------


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _span(low: int | None, high: int | None) -> str:
    return "not reached" if low is None else f"{low:,}..{high:,}"


def render_table(columns: list[tuple[str, str, list[str]]]) -> list[str]:
    """columns: (group, header, cells). Right-aligned cells; a group label spans its columns."""
    widths = [max(len(header), *(len(c) for c in cells)) for _, header, cells in columns]
    groups: list[tuple[str, int]] = []  # (label, total width), contiguous runs of one group
    for (group, _, _), width in zip(columns, widths, strict=True):
        if groups and groups[-1][0] == group:
            groups[-1] = (group, groups[-1][1] + 2 + width)
        else:
            groups.append((group, width))
    top = "  ".join(label.center(width) if label else " " * width for label, width in groups)
    lines = [top.rstrip()] if any(label for label, _ in groups) else []
    lines.append("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths, strict=True)))
    num_rows = len(columns[0][2])
    for i in range(num_rows):
        lines.append("  ".join(cells[i].rjust(w) for (_, _, cells), w in zip(columns, widths, strict=True)))
    return lines


def render(summary: dict, tables: Sequence[str] = ()) -> list[str]:
    """The summary as text, `tables` (a post-training run's, say) between the stages and the markers."""
    stages = summary["stages"]
    resumes = summary["num_resumes"]
    lines = [
        f"{summary['run']}  ({summary['run_dir']})",
        f"  status   {summary['status']}",
        f"  steps    {summary['step']:,} of {summary['num_steps']:,}",
        f"  tokens   {summary['tokens']:,} of {summary['total_tokens']:,}",
        f"  resumes  {resumes}",
        "",
    ]
    val_names = _in_stage_order({name for row in stages for name in row["validation"]}, stages)
    eval_names = _in_stage_order({name for row in stages for name in (row["evaluation"] or {})}, stages)
    text_names = _in_stage_order({name for row in stages for name in (row["bits_per_byte"] or {})}, stages)
    columns = [
        ("", "stage", [str(r["stage"]) for r in stages]),
        ("", "tokens", [_span(r["tokens_start"], r["tokens_end"]) for r in stages]),
        ("", "steps", [_span(r["first_step"], r["last_step"]) for r in stages]),
        ("task loss", "start", [_number(r["loss_start"]) for r in stages]),
        ("task loss", "end", [_number(r["loss_end"]) for r in stages]),
        ("task loss", "min", [_number(r["loss_min"]) for r in stages]),
    ]
    terms = [r.get("kl") or {"setting": "beta", "value": r["beta"], "penalty": r["beta"]} for r in stages]
    if any(term["penalty"] > 0 for term in terms):
        own = any(term["setting"] != "beta" for term in terms)  # then the weight is not beta everywhere
        columns += [
            ("KL to reference", "weight" if own else "beta", [_kl_weight(term) for term in terms]),
            ("KL to reference", "mean KL", [_number(r["kl_mean"]) for r in stages]),
        ]
    columns += [
        ("last validation loss", n, [_number(r["validation"].get(n)) for r in stages]) for n in val_names
    ]
    columns += [
        ("accuracy at stage end", n, [_number((r["evaluation"] or {}).get(n)) for r in stages])
        for n in eval_names
    ]
    columns += [
        ("bits per byte at stage end", n, [_number((r["bits_per_byte"] or {}).get(n)) for r in stages])
        for n in text_names
    ]
    lines += render_table(columns)
    if summary["evaluation_before_training"]:
        scores = ", ".join(f"{n} {v:.3f}" for n, v in sorted(summary["evaluation_before_training"].items()))
        lines.append(f"accuracy before training: {scores}")
    lines += ["", *tables] if tables else []
    lines += ["", f"{'step':>10} {'tokens':>14}  marker"]
    lines += [f"{m['step']:>10,} {m['tokens']:>14,}  {m['text']}" for m in summary["markers"]]
    lines.append(_checkpoint_line(summary["checkpoints"]))
    return lines


def _kl_weight(term: dict) -> str:
    """The weight of a stage's KL penalty: '0.2' (beta), 'grpo.kl_beta 0.02', 'none (dpo)'."""
    if term["setting"] in LOSS_TIES:  # 'none (dpo)', 'none (distill)': the loss is the tie
        return f"none ({term['setting'].split('.')[0]})"
    return f"{term['value']:g}" if term["setting"] == "beta" else f"{term['setting']} {term['value']:g}"


def _in_stage_order(names: set[str], stages: list[dict]) -> list[str]:
    """Datasets in the order of the stages they lead (as the plot colours them), the others after."""
    from rewind.tools.plots import home_stages

    homes = home_stages([row["datasets"] for row in stages])
    return sorted(names, key=lambda name: (homes.get(name, len(stages)), name))


def _checkpoint_line(checkpoints: dict) -> str:
    steps = checkpoints["steps"]
    if not steps:
        return "checkpoints: none written"
    shown = [f"{s:,}" for s in steps]
    if len(steps) > MAX_CHECKPOINT_STEPS_SHOWN:
        half = MAX_CHECKPOINT_STEPS_SHOWN // 2
        shown = [*shown[:half], "...", *shown[-half:]]
    reasons = ", ".join(f"{reason} {count}" for reason, count in checkpoints["reasons"].items())
    return (
        f"checkpoints: {len(steps)} written ({reasons}) at steps {', '.join(shown)}; "
        f"{len(checkpoints['live'])} live"
    )


def run(args: argparse.Namespace) -> int:
    if args.plot is not None:
        from rewind.tools.outfile import check_target

        check_target(args.plot, "--plot", ".png")  # before the log is read: exit 2, nothing done
    timeline = read_timeline(args.run_dir, with_plot=bool(args.plot))
    summary = summarize(timeline)
    if args.json:
        print_json(summary if not args.plot else {**summary, "plot": str(args.plot)})
    else:
        from rewind.tools.posttrain_report import posttrain_tables

        ends = {row["stage"]: row["loss_end"] for row in summary["stages"]}
        print("\n".join(render(summary, posttrain_tables(timeline.evaluations, timeline.config, ends))))
    if args.plot:
        from rewind.tools.timeline_plot import plot_timeline

        plot_timeline(timeline, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0
