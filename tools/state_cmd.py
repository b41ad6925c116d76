"""`rewind state RUN`: the folded control state of a run, now or as of any step or log record.

The default folds every record, so it also describes a live run another process is writing (reading
the log takes no lock). `--at-seq S` folds the raw log up to record S, superseded records included as
they counted then; `--at-step N` folds the effective records (what still counts after resumes) up to
and including step N's control events. What the schedule says about the *next* step comes from the
config in force at that point.
"""

from __future__ import annotations

import argparse
from typing import Any

from rewind.states.stagekinds.rules import LOSS_TIES
from rewind.tools.errors import CommandError, UsageError
from rewind.tools.jsonout import NON_FINITE_HELP, print_json

KEY_WIDTH = 18


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("state", help="the folded control state of a run, now or at a step or log record")
    p.add_argument("run_dir", metavar="RUN")
    at = p.add_mutually_exclusive_group()
    at.add_argument("--at-step", type=int, metavar="N", help="the state after step N (effective records)")
    at.add_argument(
        "--at-seq", type=int, metavar="S", help="the state right after log record S (raw records)"
    )
    said = f"one JSON object: the state plus the next step's plan ({NON_FINITE_HELP})"
    p.add_argument("--json", action="store_true", help=said)
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


def _reset_text(state) -> str:
    """The last optimizer reset and any still due (the stages with reset_optimizer)."""
    last = state.last_optimizer_reset
    text = (
        "none yet"
        if last is None
        else (
            f"stage {last.stage} at step {last.step:,} ({'the LR restarted there' if last.lr_restarted else 'the LR curve unbroken'})"
        )
    )
    if state.pending_optimizer_resets:
        text += "; due: " + ", ".join(f"stage {s}" for s in state.pending_optimizer_resets)
    return text


def next_step_plan(schedule, state) -> dict | None:
    """What the schedule says about the step with index state.step; None when no step is left."""
    if state.finished or state.step >= schedule.num_steps:
        return None
    from rewind.states.plan import step_lr
    from rewind.tools.kl_terms import kl_term

    plan = schedule.step_plan(state.step)
    return {
        "step": plan.step,
        "tokens": plan.tokens,
        "stage": plan.stage,
        "weights": list(plan.weights),
        "rows": list(plan.rows),
        "lr": step_lr(state, schedule, state.step),  # what the engine trains it at (the run's resets)
        "beta": plan.beta,  # the token-level KL weight: 0 by rule in a dpo or grpo stage
        "kl": kl_term(schedule.config.stages[plan.stage])._asdict(),  # what ties the stage to the reference
    }


# --- rewind state -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    import msgspec

    from rewind.states.fold import IllegalTransition
    from rewind.states.schedule import Schedule
    from rewind.stores.folding import fold_log, fold_to
    from rewind.tools.runlog import open_log

    with open_log(args.run_dir) as (log, started):
        end_seq = log.next_seq - 1
        try:  # from the nearest state snapshot that agrees with the log: the cost is the tail
            now = fold_log(log, str(args.run_dir))
            if args.at_seq is not None:
                if not 0 <= args.at_seq <= end_seq:
                    raise UsageError(
                        f"--at-seq {args.at_seq}: out of range; the log holds records 0..{end_seq}"
                    )
                state, config = fold_to(log, str(args.run_dir), at_seq=args.at_seq)
                point, as_of = (
                    {"seq": args.at_seq},
                    f"log record {args.at_seq} (raw records, superseded included)",
                )
            elif args.at_step is not None:
                last_step = now.state.step
                if not 0 <= args.at_step <= last_step:
                    raise UsageError(
                        f"--at-step {args.at_step}: out of range; the run reached step {last_step} (use 0..{last_step})"
                    )
                state, config = fold_to(log, str(args.run_dir), at_step=args.at_step)
                point, as_of = {"step": args.at_step}, f"after step {args.at_step} (effective records)"
            else:
                state, config = now.state, now.config
                point, as_of = None, f"the end of the log (record {end_seq})"
        except IllegalTransition as exc:
            raise CommandError(f"{args.run_dir}: the log does not fold: {exc}", exit_code=1) from None
    upcoming = next_step_plan(Schedule(config, state.features), state)
    if args.json:
        shown = msgspec.to_builtins(state)
        # Bookkeeping of the fold itself, not of the run: the restore anchor is a copy of the state.
        for key in ("anchor", "anchor_open"):
            shown.pop(key, None)
        print_json(
            {
                "run": config.run.name,
                "run_dir": str(args.run_dir),
                "as_of": point,
                "status": status_text(state),
                **shown,
                "next_step": upcoming,
            }
        )
    else:
        print("\n".join(render_state(args.run_dir, started, state, config, upcoming, as_of)))
    return 0


def _data_lines(state) -> list[str]:
    """What the run's data is on record (lines only for a run that has some: the goldens of others stay)."""
    lines = []
    if state.epochs:
        lines.append(_line("epochs", ", ".join(f"{name} {epoch}" for name, epoch in sorted(state.epochs.items()))))
    if state.tokenizer:
        lines.append(_line("tokenizer", f"sha256 {state.tokenizer[:12]} (RUN/data/tokenizer.json)"))
    if state.pretrained:
        lines.append(_line("pretrained", f"sha256 {state.pretrained[:12]}"))
    for i, (name, identity) in enumerate(sorted(state.data.items())):
        files = len(identity.sources) + len(identity.validation_sources)
        tokens = f", {identity.num_tokens:,} tokens" if identity.num_tokens else ""
        lines.append(_line("data on record" if i == 0 else "", f"{name}: {identity.kind}, {files} file(s){tokens}"))
    return lines


def _line(key: str, value: object) -> str:
    return f"{key:<{KEY_WIDTH}} {value}"


def _checkpoint(ref) -> str:
    return f"{ref.checkpoint} (step {ref.step:,}, {ref.reason})"


def _listed(key: str, items: list[str], empty: str) -> list[str]:
    """One item per line under a single key, so long lists stay readable."""
    if not items:
        return [_line(key, empty)]
    return [_line(key if i == 0 else "", item) for i, item in enumerate(items)]


def _stack_lines(run_dir: str, state: Any, config: Any) -> list[str]:
    """The model's stacks, input side first (what trains, adapters), and the trunk's activation cache."""
    from rewind.states.growth import current_layout, stack_table

    if state.layout is None:
        return [_line("stacks", f"none: the initial model only ({config.architecture.num_layers} layers)")]
    layout = current_layout(state)
    rows = [
        f"stack {r['stack']}: {r['num_blocks']} blocks, base {r['base']}"
        + (f", adapters {r['adapters']}" if r["adapters"] else "")
        + (f" (joined at step {r['joined_step']:,})" if r["stack"] else "")
        for r in stack_table(layout)
    ]
    lines = _listed("stacks", rows, "none")  # input side first
    trains = f"embedding {'trains' if layout.embed_trains else 'fixed'}; final norm and head {'train' if layout.head_trains else 'fixed'}"
    lines.append(_line("  outside", trains))
    cache = state.activation_cache
    if cache is not None and cache.path:
        from rewind.stores.activations import cache_status
        from rewind.stores.fsio import filesystem

        status = cache_status(filesystem(run_dir).join(*cache.path.split("/")).url)
        lines.append(
            _line("trunk cache", f"{cache.path}: {status}, {cache.num_rows:,} rows for steps "
                  f"{cache.step:,}..{cache.step + cache.num_steps - 1:,}, {cache.num_bytes / 2**20:.1f} MiB")
        )
    return lines


def render_state(run_dir: str, started, state, config, upcoming: dict | None, as_of: str) -> list[str]:
    tps = state.tokens_per_step
    mixture = ""
    if 0 <= state.stage < config.num_stages:
        mixture = ": " + ", ".join(f"{s.name} {s.rate:g}" for s in config.stages[state.stage].datasets)
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
            _kl_line(upcoming),
        ]
    cursors = ", ".join(f"{name} {count:,}" for name, count in state.cursors.items())
    reference = state.reference
    lines += [
        _line("last loss", "none yet" if state.last_loss is None else f"{state.last_loss:.6g}"),
        _line("skipped steps", state.num_skipped_steps),
        _line("data cursors", cursors or "none yet (samples consumed per dataset)"),
        *_data_lines(state),
        _line(
            "reference",
            f"stage {reference.stage}, step {reference.step:,}, checkpoint {reference.checkpoint or '(dry run)'}"
            if reference
            else "none (no refresh yet)",
        ),
        _line("pending refreshes", ", ".join(f"stage {s}" for s in state.pending_refreshes) or "none"),
    ]
    if state.optimizer_reset_stages or state.last_optimizer_reset is not None:  # a run that resets at all
        lines.append(_line("optimizer reset", _reset_text(state)))
    lines += _stack_lines(run_dir, state, config)
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


def _kl_line(upcoming: dict) -> str:
    """The next step's tie to the reference (rewind.tools.kl_terms): its beta, or a dpo or grpo stage's own
    setting (grpo.kl_beta, dpo.beta), where the beta is the 0 the rules force."""
    kl = upcoming["kl"]
    if kl["setting"] == "beta":
        return _line("  beta", f"{upcoming['beta']:g}")
    loss = " (its loss; no KL penalty added)" if kl["setting"] in LOSS_TIES else ""
    return _line(f"  {kl['setting']}", f"{kl['value']:g}{loss}")


def _boundary(boundary: int) -> str:
    if boundary == -2:
        return "none yet"
    if boundary == -1:
        return "before training"
    return f"after stage {boundary}"
