"""`rewind schedule CONFIG`: dry-run a whole run's schedule without torch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rewind.states.check_schedule import schedule_warnings, written_fields
from rewind.states.config import Stage
from rewind.states.events import Event, event_to_dict
from rewind.states.plan import plan
from rewind.states.schedule import Ramp, Schedule
from rewind.states.stagekinds.rules import LOSS_TIES
from rewind.tools.configfile import add_set_option, load_config, read_config_text
from rewind.tools.errors import UsageError
from rewind.tools.jsonout import print_json
from rewind.tools.kl_terms import has_own_kl, kl_kinds, kl_term


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("schedule", help="dry-run a config's schedule: transitions, weights, LR, KL (no torch)")
    p.add_argument("config", help="TOML config file")
    add_set_option(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of the readable timeline")
    p.add_argument("--at", metavar="P1,P2,...", help="describe the steps covering these token positions")
    p.add_argument("--plot", metavar="OUT.png", help="write a plot of weights, LR and KL over tokens")
    p.add_argument(
        "--check",
        action="store_true",
        help="instead of the timeline, warn about a legal but suspicious schedule (a stage shorter than a "
        "step, a KL weight before any reference refresh, a fade spanning most of a stage, an LR decay "
        "ending far from a stage boundary, ...), one 'warning:' line each (--json: {\"warnings\": [...]}); "
        "warnings are advice: the exit status is 0 with or without them (2 for a bad config)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.plot is not None:
        from rewind.tools.outfile import check_target

        check_target(args.plot, "--plot", ".png")  # a directory or a device: exit 2 before any work
    config = load_config(args.config, args.overrides)
    schedule = Schedule(config)
    if schedule.num_steps == 0:
        raise UsageError(
            f"{args.config}: the run has no steps: {schedule.total_tokens} tokens in all, "
            f"but one step takes {schedule.tokens_per_step} (batch_size x block_size)"
        )
    events = list(plan(schedule))
    if args.at is not None:
        _print_at(schedule, _parse_positions(args.at), args.json)
    elif args.json and not args.check:
        print_json(schedule_view(schedule, events, args.config))
    elif not args.check:
        print(render_timeline(schedule, events, args.config))
    if args.plot:
        from rewind.tools.plots import plot_schedule

        written = plot_schedule(schedule, events, args.plot, title=f"{config.run.name} ({args.config})")
        print(f"plot written to {written}", file=sys.stderr)  # exactly the path given, suffix or not
    if args.check:
        # What the file and --set wrote: a default the config never mentions is nobody's mistake.
        written = written_fields(read_config_text(Path(args.config), args.config), args.overrides)
        _check(schedule, args.json, written)
    return 0


def _parse_positions(text: str) -> list[int]:
    try:
        return [int(p.strip().replace("_", "")) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"--at {text!r}: expected comma-separated integer token positions") from None


def describe_step(schedule: Schedule, step: int) -> dict:
    sp = schedule.step_plan(step)
    return {
        "tokens": sp.tokens,
        "step": sp.step,
        "stage": sp.stage,
        "weights": list(sp.weights),
        "rows": list(sp.rows),
        "lr": sp.lr,
        "beta": sp.beta,
        "kl": kl_row(schedule.config.stages[sp.stage]),
    }


def _print_at(schedule: Schedule, positions: list[int], as_json: bool) -> None:
    end = schedule.num_steps * schedule.tokens_per_step
    for p in positions:
        if not 0 <= p < end:
            raise UsageError(f"--at {p}: token position outside the run [0, {end})")
    rows = [describe_step(schedule, p // schedule.tokens_per_step) for p in positions]
    if as_json:
        print_json(rows)
        return
    for p, r in zip(positions, rows, strict=True):
        weights = " ".join(f"{w:.3f}" for w in r["weights"])
        # A dpo or grpo stage's token-level beta is 0 by rule: its own setting is what ties it to the reference.
        kl = f"{r['kl']['setting']} {r['kl']['value']:g}"
        print(
            f"position {p:>12,}: step {r['step']:>8,} (tokens {r['tokens']:,}) stage {r['stage']} "
            f"weights [{weights}] rows {r['rows']} lr {r['lr']:.3g} {kl}"
        )


def _describe_event(schedule: Schedule, event: Event) -> str:
    data = event_to_dict(event)
    name = data["type"]
    config = schedule.config
    if name == "StageEntered":
        stage = config.stages[data["stage"]]
        mixture = ", ".join(f"{s.name} {s.rate:g}" for s in stage.datasets)
        term = kl_term(stage)  # beta, or a dpo or grpo stage's own setting
        return f"{name:<19} stage {data['stage']} ({mixture}), {term.setting} {term.value:g}"
    if name in ("FadeStarted", "FadeEnded"):
        ramp = schedule.ramps[data["boundary"]]
        return (
            f"{name:<19} boundary {data['boundary']} (stage {ramp.boundary} -> {ramp.boundary + 1}, "
            f"{schedule.curve}, tokens {ramp.start:,.0f}..{ramp.end:,.0f})"
        )
    if name == "ReferenceRefreshed":
        return f"{name:<19} stage {data['stage']}: reference := current weights"
    if name == "OptimizerReset":
        lr = "the LR restarts its warmup here" if data["lr_restarted"] else "the LR curve goes on unbroken"
        return f"{name:<19} stage {data['stage']}: AdamW moments cleared; {lr}"
    if name == "StackAppended":
        return f"{name:<19} {describe_growth(data)}"
    if name == "ActivationsCached":
        return f"{name:<19} trunk {data['version']}: its outputs for {data['num_steps']:,} steps ({data['num_rows']:,} rows) computed once"
    return name


def describe_growth(data: dict) -> str:
    """'stack 2 (2 blocks, append, init copy, fp32); trunk -> lora (ranks 0:8, 1:4)'."""
    own = f", own adapters rank {data['rank']}" if data["rank"] else ""
    ranks = ", ".join(f"{k}:{v}" for k, v in data["trunk_ranks"].items())
    anchor = "; norm and head fixed (anchor)" if data["anchor"] else ""
    return (
        f"stack {data['stack']} ({data['num_blocks']} blocks, {data['position']}, init {data['init']}, "
        f"{data['precision']}{own}); trunk -> {data['trunk']}" + (f" (adapter ranks {ranks})" if ranks else "") + anchor
    )


def kl_row(stage: Stage) -> dict:
    """What ties the stage to the reference (rewind.tools.kl_terms): the setting, its value, and the
    weight of the KL penalty it adds to the loss (0 for none)."""
    term = kl_term(stage)
    return {"setting": term.setting, "value": term.value, "penalty": term.penalty}


def strategy_settings(stage: Stage) -> dict | None:
    """The settings of the stage's strategy, defaults filled in (None for pretrain, which has none)."""
    import msgspec

    return msgspec.to_builtins(stage.settings) if stage.settings is not None else None


def stage_rows(schedule: Schedule) -> list[dict]:
    """One row per stage: its name and strategy, its budget, the tokens and steps it actually trains,
    its token-level KL weight (beta) and what ties it to the reference (`kl`: beta, or a dpo or grpo
    stage's own setting), its strategy's settings, what entering it does, its mixture, and its fade into
    the next stage (None for the last; a boundary without a fade window has start_tokens == end_tokens)."""
    trained = schedule.stage_tokens()
    return [
        {
            "stage": i,
            "name": stage.name,
            "strategy": stage.strategy,
            "budget": budget,
            "trained_tokens": trained[i],
            "steps": trained[i] // schedule.tokens_per_step,
            "beta": schedule.betas[i],
            "kl": kl_row(stage),
            "settings": strategy_settings(stage),
            "refresh_reference": stage.refresh_reference,
            "reset_optimizer": stage.reset_optimizer,
            "mixture": [{"name": s.name, "rate": s.rate} for s in stage.datasets],
            "fade": _fade_row(schedule, schedule.ramps[i]) if i < schedule.num_stages - 1 else None,
        }
        for i, (budget, stage) in enumerate(zip(schedule.budgets, schedule.config.stages, strict=True))
    ]


def fade_rows(schedule: Schedule) -> list[dict]:
    """One row per fade window: the boundary, its token range [start, end) and its steps."""
    return [_fade_row(schedule, ramp) for ramp in schedule.fades]


def _fade_row(schedule: Schedule, ramp: Ramp) -> dict:
    return {
        "boundary": ramp.boundary,
        "overlap": schedule.config.fade_overlap(ramp.boundary),
        "start_tokens": ramp.start,
        "end_tokens": ramp.end,
        "start_step": schedule.fade_start_step(ramp),
        "end_step": schedule.fade_end_step(ramp),
    }


def lr_settings(schedule: Schedule) -> dict:
    opt = schedule.config.optimization
    return {"schedule": opt.schedule, "peak": opt.lr, "first": schedule.lr(0), "last": schedule.lr(schedule.num_steps - 1)}


def kl_settings(schedule: Schedule) -> dict:
    """`kind` and `betas` are the token-level KL's (pretrain and sft stages); `stages` says, per stage,
    what ties it to the reference (`kl_row`)."""
    return {
        "kind": schedule.config.optimization.kl.kind,
        "betas": list(schedule.betas),
        "stages": [kl_row(stage) for stage in schedule.config.stages],
        "reference_update_stages": sorted(schedule.reference_update_stages),
    }


def schedule_view(schedule: Schedule, events: list[Event], source: str) -> dict:
    """`schedule --json`: everything the readable timeline shows, as one object."""
    return {
        "source": str(source),
        "num_stages": schedule.num_stages,
        "num_steps": schedule.num_steps,
        "tokens_per_step": schedule.tokens_per_step,
        "tokens": schedule.num_steps * schedule.tokens_per_step,
        "budget": schedule.total_tokens,
        "events": [event_to_dict(e) for e in events],
        "stages": stage_rows(schedule),
        "fade_curve": schedule.curve,
        "fades": fade_rows(schedule),
        "lr": lr_settings(schedule),
        "kl": kl_settings(schedule),
    }


def render_timeline(schedule: Schedule, events: list[Event], source: str) -> str:
    tps = schedule.tokens_per_step
    lines = [
        f"Schedule of {source}: {schedule.num_stages} stages, {schedule.num_steps:,} steps x {tps:,} tokens "
        f"= {schedule.num_steps * tps:,} tokens (budget {schedule.total_tokens:,})",
        "",
        f"{'step':>10} {'tokens':>14}  event",
    ]
    lines += [f"{e.step:>10,} {e.tokens:>14,}  {_describe_event(schedule, e)}" for e in events]
    lines.append("")
    for row in stage_rows(schedule):
        lines += stage_block(row, schedule.curve)
    if not schedule.fades:
        lines += ["fades: none (hard switches at the boundaries)", ""]
    lr, kl = lr_settings(schedule), kl_settings(schedule)
    lines.append(f"lr: {lr['schedule']}, peak {lr['peak']:g}, first {lr['first']:.3g}, last {lr['last']:.3g}")
    lines.append(kl_line(schedule, kl))
    return "\n".join(lines)


def kl_line(schedule: Schedule, kl: dict) -> str:
    """The timeline's last line: the token-level betas (a run of pretrain and sft stages only), or what
    ties each stage to the reference where a dpo or grpo stage has its own setting for it."""
    refreshed = f"reference refreshed on entering {kl['reference_update_stages'] or 'never'}"
    stages = schedule.config.stages
    if not any(has_own_kl(stage) for stage in stages):
        return f"KL ({kl['kind']}): betas {kl['betas']}, {refreshed}"
    terms = ", ".join(f"stage {i} {kl_term(stage).text()}" for i, stage in enumerate(stages))
    return f"KL ({kl_kinds(stages, kl['kind'])}): {terms}; {refreshed}"


def stage_block(row: dict, curve: str) -> list[str]:
    """A stage as `rewind schedule` prints it: a heading, then one line per thing the stage decides."""
    name = f" {row['name']!r}" if row["name"] else ""
    entry = [what for key, what in ENTRY_EFFECTS if row[key]]
    fade = row["fade"]
    if fade is None:
        faded = "none (the last stage)"
    elif fade["start_tokens"] == fade["end_tokens"]:
        faded = f"none: a hard switch into stage {row['stage'] + 1}"
    else:
        faded = (
            f"into stage {row['stage'] + 1}, {curve}, overlap {fade['overlap']:g}: tokens "
            f"[{fade['start_tokens']:,.0f}, {fade['end_tokens']:,.0f}), steps {fade['start_step']:,}..{fade['end_step']:,}"
        )
    kl = row["kl"]
    if kl["setting"] == "beta":
        tie = [f"  beta      {row['beta']:g}"]
    elif kl["setting"] in LOSS_TIES:  # a dpo or distill stage's loss is its tie
        tie = [
            f"  KL        none added: the {row['strategy']} loss compares the policy with the reference "
            f"({kl['setting']} {kl['value']:g})"
        ]
    elif kl["penalty"] > 0:
        estimate = row["settings"]["kl_estimator"]
        tie = [f"  KL        {kl['setting']} {kl['value']:g} x the {estimate} estimate of the KL to the reference"]
    else:
        tie = [f"  KL        none ({kl['setting']} 0)"]
    return [
        f"stage {row['stage']}{name} ({row['strategy']}): budget {row['budget']:,} tokens, trains "
        f"{row['trained_tokens']:,} in {row['steps']:,} steps",
        "  mixture   " + ", ".join(f"{m['name']} {m['rate']:g}" for m in row["mixture"]),
        *tie,
        *settings_lines(row["strategy"], row["settings"]),
        f"  on entry  {', '.join(entry) or '-'}",
        f"  fade      {faded}",
        "",
    ]


SETTINGS_WIDTH = 110  # a strategy's settings wrap to lines of at most this many characters


def settings_lines(strategy: str, settings: dict | None) -> list[str]:
    """'  grpo      group_size 4, temperature 1, ...' wrapped under its first value; none for pretrain."""
    if settings is None:
        return []
    items = [f"{key} {_setting(value)}" for key, value in settings.items()]
    lines, line = [], f"  {strategy:<9} "
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if line.strip() != strategy and len(line) + len(piece) + 1 > SETTINGS_WIDTH:
            lines.append(line.rstrip())
            line = " " * 12
        line += piece + " "
    return [*lines, line.rstrip()]


def _setting(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()  # as TOML writes it
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):  # grpo's rewards: [exact_match x 1, mymodule:score x 0.5]
        return "[" + ", ".join(f"{r['function']} x {r['weight']:g}" for r in value) + "]"
    return str(value)


ENTRY_EFFECTS = (
    ("refresh_reference", "refreshes the KL reference"),
    ("reset_optimizer", "resets the optimizer"),
)


def _check(schedule: Schedule, as_json: bool, written: frozenset[str]) -> None:
    """Print the warnings; they are advice, so they never change the exit status."""
    warnings = schedule_warnings(schedule.config, schedule, written)
    if as_json:
        print_json({"warnings": warnings})
        return
    for w in warnings:
        print(f"warning: {w}")
    print(f"{len(warnings)} warning(s)" if warnings else "no warnings")
