"""`rewind fork RUN --at-step N [--set KEY=VALUE ...] NEW_RUN`: a what-if experiment.

The new run starts from RUN's last intact checkpoint at or before step N, under RUN's config with the
overrides applied (or under `--config FILE`), and trains to its end like `rewind train`. Its RunStarted
names the parent, so `rewind diff RUN NEW_RUN` compares them from the fork point on.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rewind.tools.configfile import add_set_option
from rewind.tools.errors import CommandError, UsageError
from rewind.tools.train_cmd import add_threads_option


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fork", help="start a new run from a run's checkpoint at or before a step, with a changed config")
    p.add_argument("run_dir", metavar="RUN", help="the parent run")
    p.add_argument("new_run", metavar="NEW_RUN", help="directory of the new run (must not hold a run)")
    p.add_argument("--at-step", type=int, required=True, metavar="N", help="fork at the last checkpoint at or before N")
    add_set_option(p)
    p.add_argument("--config", help="a whole new config file instead of the parent's (--set applies on top)")
    p.add_argument(
        "--max-steps", type=int, default=None,
        help="stop cleanly after this many steps of this process, counted from the fork point (resumable)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_threads_option(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import msgspec

    from rewind.engine.run.fork import open_fork
    from rewind.engine.run.parts import RunError
    from rewind.states.config_identity import config_differences
    from rewind.states.config_reading import config_from_dict
    from rewind.states.overrides import apply_overrides, parse_override
    from rewind.states.stageform import flat_for_overrides
    from rewind.stores.eventlog import LogLockedError
    from rewind.tools.configfile import load_config, resolve_data_paths
    from rewind.tools.train_cmd import drive_and_report

    if args.at_step < 0:
        raise UsageError(f"--at-step {args.at_step}: must be >= 0")
    if args.max_steps is not None and args.max_steps < 0:
        raise UsageError(f"--max-steps {args.max_steps}: must be >= 0")
    if args.config is not None:
        chosen = load_config(args.config, args.overrides)  # problems show before the parent is read
    for text in args.overrides:
        parse_override(text)  # a malformed --set too

    def config_of_child(parent_config):
        if args.config is not None:
            return chosen
        parent = flat_for_overrides(msgspec.to_builtins(parent_config), args.overrides)
        raw = apply_overrides(parent, args.overrides)
        # A path given with --set is the user's, relative to where they stand (the parent's are absolute).
        return resolve_data_paths(config_from_dict(raw, source=f"{args.run_dir} config with --set"), Path.cwd())

    notes: list[str] = []
    # A --config file's reward modules are looked for beside it first, as `rewind train FILE` looks.
    base_dir = str(Path(args.config).resolve().parent) if args.config else None
    try:
        run, state, point, parent_config = open_fork(
            args.run_dir, args.at_step, config_of_child, args.new_run,
            num_threads=args.threads, note=notes.append, base_dir=base_dir,
        )
    except RunError as exc:  # (no run there, too)
        raise CommandError(str(exc), exc.exit_code) from None
    except LogLockedError as exc:
        raise CommandError(str(exc), 1) from None
    step = point.state.step
    where = f"checkpoint {point.checkpoint} (step {step})" if point.checkpoint else "its start (step 0)"
    print(f"forked {args.run_dir} at {where} into {args.new_run}", file=sys.stderr)
    if step != args.at_step:
        print(f"  (no intact checkpoint at step {args.at_step}; {step} is the last one before it)", file=sys.stderr)
    for line in config_differences(parent_config, run.parts.config):
        print(f"  config: {line}", file=sys.stderr)
    for note in notes:
        print(f"  {note}", file=sys.stderr)
    return drive_and_report(run, state, args.new_run, max_steps=args.max_steps, progress=not args.no_progress)
