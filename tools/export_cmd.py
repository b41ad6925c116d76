"""`rewind export RUN --to FILE.safetensors` (weights of the last committed checkpoint) and
`rewind export tensorboard RUN` (rebuild the metrics projection from the log alone)."""

from __future__ import annotations

import argparse

from rewind.tools.errors import CommandError, UsageError
from rewind.tools.outfile import check_target, write_file_atomically
from rewind.tools.runlog import load_records


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export weights (--to FILE.safetensors) or rebuild metrics (tensorboard RUN)")
    p.add_argument("what", metavar="RUN | tensorboard", help="a run directory, or 'tensorboard' followed by one")
    p.add_argument("run_dir", nargs="?", metavar="RUN")
    p.add_argument("--to", metavar="FILE.safetensors", help="where to write the model weights (base weights, frozen stacks included)")
    p.add_argument(
        "--adapters",
        metavar="DIR",
        help="also write the LoRA adapters in peft's layout (adapter_config.json + adapter_model.safetensors)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.what == "tensorboard":
        if not args.run_dir:
            raise UsageError("export tensorboard: expected a run directory")
        return export_metrics(args.run_dir)
    if args.run_dir:
        raise UsageError(f"export: unexpected argument {args.run_dir!r}")
    if args.to is None and args.adapters is None:
        raise UsageError("export RUN: --to FILE.safetensors (and/or --adapters DIR) is required")
    from rewind.tools.rundir import check_run_dir

    check_run_dir(args.what, "RUN")
    from rewind.tools.export_adapters import prepare_adapters, write_adapters

    # Every check of both outputs before either is written: a refused --adapters leaves no --to behind.
    prepared = prepare_adapters(args.what, args.adapters) if args.adapters is not None else None
    if args.to is not None:
        export_weights(args.what, args.to)
    if prepared is not None:
        write_adapters(prepared, args.adapters)
    return 0


def export_metrics(run_dir: str) -> int:
    from rewind.states.history import effective
    from rewind.stores.metrics import rebuild

    records = effective(load_records(run_dir))
    rebuild(run_dir, records)
    print(f"rebuilt {run_dir}/metrics.jsonl and {run_dir}/tb/ from {len(records)} effective events")
    return 0


def checkpointed_state(run_dir: str):
    """The run's folded state, which has a committed checkpoint (CommandError, exit 1, when it has none)."""
    from rewind.states.fold import fold

    state = fold(e for _, e in load_records(run_dir))
    if state.last_checkpoint is None:
        raise CommandError(f"{run_dir}: the run has no committed checkpoint yet", 1)
    return state


def export_weights(run_dir: str, out: str) -> int:
    import msgspec
    from safetensors.torch import save

    from rewind.stores.trunks import checkpoint_weights
    from rewind.tools.export_adapters import checkpoint_layout

    target = check_target(out)
    state = checkpointed_state(run_dir)
    ref = state.last_checkpoint
    groups = {"model": checkpoint_weights(run_dir, ref.checkpoint, ref.files)["model"]}
    # The layout builds the model these weights fit (stack identities and order): rewind.engine.layout.
    layout = msgspec.json.encode(checkpoint_layout(state)).decode()
    metadata = {"run": run_dir, "checkpoint": ref.checkpoint, "step": str(ref.step), "layout": layout}
    data = save(groups["model"], metadata=metadata)
    try:
        write_file_atomically(target, data)
    except OSError as exc:
        raise CommandError(f"--to {out}: cannot write the weights ({exc.strerror or exc}); nothing was written", 1) from None
    print(f"wrote {len(groups['model'])} tensors of checkpoint {ref.checkpoint} (step {ref.step}) to {out}")
    return 0
