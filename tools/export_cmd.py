"""`rewind export RUN --to FILE.safetensors` (weights of the last committed checkpoint), `--hf DIR` (a
transformers model directory, rewind.tools.export_hf), `--adapters DIR` with it (its LoRA adapters for
peft, onto that model: rewind.tools.export_adapters) and `rewind export tensorboard RUN` (rebuild the
metrics projection from the log alone).

The `--to` file's metadata says what model its tensors make, so the file alone can start a run
(`[pretrained] path`, rewind.engine.pretrained): "layout" (the stacks in order, JSON of ModelLayout),
"rewind.architecture" (the architecture section, num_layers = all blocks), "rewind.objective", and
"rewind.format" (the version of these keys)."""

from __future__ import annotations

import argparse
import os

from rewind.tools.errors import CommandError, UsageError
from rewind.tools.outfile import check_target, write_file_atomically
from rewind.tools.runlog import load_records

HELP = (
    "export a checkpoint's model (--to FILE.safetensors; --hf DIR for transformers, with --adapters DIR "
    "for peft) or rebuild metrics (tensorboard RUN)"
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help=HELP, description=HELP[0].upper() + HELP[1:] + ".")
    p.add_argument("what", metavar="RUN | tensorboard", help="a run directory, or 'tensorboard' followed by one")
    p.add_argument("run_dir", nargs="?", metavar="RUN")
    p.add_argument("--to", metavar="FILE.safetensors", help="where to write the model weights (base weights, frozen stacks included)")
    p.add_argument(
        "--hf",
        metavar="DIR",
        help="write a transformers model directory (config.json, model.safetensors, tokenizer): Llama, Arcee, "
        "Starcoder2 or StableLm, whichever computes the run's block; adapters merged unless --adapters",
    )
    p.add_argument(
        "--adapters",
        metavar="DIR",
        help="with --hf: write the LoRA adapters for peft (adapter_config.json + adapter_model.safetensors), "
        "named for the --hf model, which then holds the unmerged base",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.what == "tensorboard":
        if not args.run_dir:
            raise UsageError("export tensorboard: expected a run directory")
        return export_metrics(args.run_dir)
    if args.run_dir:
        raise UsageError(f"export: unexpected argument {args.run_dir!r}")
    if args.to is None and args.adapters is None and args.hf is None:
        raise UsageError("export RUN: --to FILE.safetensors, --hf DIR or --hf DIR --adapters DIR is required")
    if args.adapters is not None and args.hf is None:
        raise UsageError(
            "--adapters DIR: the adapters are named for the transformers model --hf writes; give --hf DIR too "
            "(it then holds the unmerged base they go onto)"
        )
    if args.adapters is not None and os.path.abspath(args.adapters) == os.path.abspath(args.hf):
        raise UsageError(
            f"--adapters {args.adapters}: the --hf directory itself (transformers would load the adapters with "
            "the model); name another directory"
        )
    from rewind.tools.rundir import check_run_dir

    check_run_dir(args.what, "RUN")
    from rewind.tools.export_adapters import prepare_adapters, write_adapters
    from rewind.tools.export_hf import prepare_hf, write_hf

    # Every check of every output before any is written: a refused --adapters or --hf leaves no --to behind.
    prepared_hf = prepare_hf(args.what, args.hf, merge=args.adapters is None) if args.hf is not None else None
    prepared = prepare_adapters(args.what, args.adapters, args.hf) if args.adapters is not None else None
    if args.to is not None:
        export_weights(args.what, args.to)
    if prepared_hf is not None:
        write_hf(prepared_hf, args.hf)
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


def model_metadata(config, layout, tokenizer: str | None = None) -> dict[str, str]:
    """What makes the exported tensors a model again (see the module docstring), and the sha256 of the
    tokenizer its ids belong to ("" = UTF-8 bytes; None: not on record, so not said)."""
    import msgspec

    from rewind.engine.pretrained import (
        ARCHITECTURE_KEY,
        FORMAT,
        FORMAT_KEY,
        LAYOUT_KEY,
        OBJECTIVE_KEY,
        TOKENIZER_KEY,
    )

    num_layers = sum(spec.num_blocks for spec in layout.stacks)
    architecture = msgspec.structs.replace(config.architecture, num_layers=num_layers)
    return {
        LAYOUT_KEY: msgspec.json.encode(layout).decode(),
        ARCHITECTURE_KEY: msgspec.json.encode(architecture).decode(),
        OBJECTIVE_KEY: msgspec.json.encode(config.objective).decode(),
        FORMAT_KEY: FORMAT,
        **({TOKENIZER_KEY: tokenizer} if tokenizer is not None else {}),
    }


def export_weights(run_dir: str, out: str) -> int:
    from safetensors.torch import save

    from rewind.states.history import config_in_force
    from rewind.stores.trunks import checkpoint_weights
    from rewind.tools.export_source import checkpoint_layout, checkpointed_state

    target = check_target(out)
    records = load_records(run_dir)
    state = checkpointed_state(run_dir, records)
    ref = state.last_checkpoint
    groups = {"model": checkpoint_weights(run_dir, ref.checkpoint, ref.files)["model"]}
    # The layout builds the model these weights fit (stack identities and order): rewind.engine.layout.
    recorded = state.tokenizer if state.behaviours.data_identity else None
    model = model_metadata(config_in_force(records), checkpoint_layout(state), recorded)
    metadata = {"run": run_dir, "checkpoint": ref.checkpoint, "step": str(ref.step), **model}
    data = save(groups["model"], metadata=metadata)
    try:
        write_file_atomically(target, data)
    except OSError as exc:
        raise CommandError(f"--to {out}: cannot write the weights ({exc.strerror or exc}); nothing was written", 1) from None
    print(f"wrote {len(groups['model'])} tensors of checkpoint {ref.checkpoint} (step {ref.step}) to {out}")
    return 0
