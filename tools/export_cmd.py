"""`rewind export RUN --to FILE.safetensors` (weights of the last committed checkpoint), `--hf DIR` (a
transformers model directory, rewind.tools.export_hf), `--adapters DIR` with it (its LoRA adapters for
peft, onto that model: rewind.tools.export_adapters) and `rewind export tensorboard RUN` (rebuild the
metrics projection from the log alone).

An export writes only what is new: an existing --to file, or a --hf or --adapters directory that is not
empty, is refused (exit 2) unless `--overwrite` is given, and then a directory only if it holds nothing but
an earlier export's files (replaced whole, a user's other files never deleted). Every output is checked
before any work, made before any is written, and written whole or not at all with the others
(rewind.tools.outfile.write_outputs): a failed export leaves none of them, and what it would have
replaced as it was.

The `--to` file's metadata says what model its tensors make, so the file alone can start a run
(`[pretrained] path`, rewind.engine.model.pretrained): "layout" (the stacks in order, JSON of ModelLayout),
"rewind.architecture" (the architecture section, num_layers = all blocks), "rewind.objective", and
"rewind.format" (the version of these keys)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
from pathlib import Path

from rewind.tools.errors import UsageError
from rewind.tools.outfile import Output, check_target, write_outputs
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
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing --to file, and an --hf or --adapters directory holding an earlier export "
        "(replaced whole); without it an export writes only new files and new or empty directories",
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
    from rewind.tools.export_adapters import check_out_dir, prepare_adapters
    from rewind.tools.export_hf import check_hf_dir, prepare_hf

    # Every output is checked before any work (exit 2) and everything is made before anything is written;
    # then the outputs are written together, all whole or none (a failed --adapters leaves no --hf behind).
    overwrite = args.overwrite
    _check_apart({"--to": args.to, "--hf": args.hf, "--adapters": args.adapters})
    if args.to is not None:
        check_target(args.to, replace=overwrite)
    if args.hf is not None:
        check_hf_dir(args.hf, overwrite=overwrite)
    if args.adapters is not None:
        check_out_dir(args.adapters, overwrite=overwrite)
    made = []  # (what is written, where the user asked for it)
    if args.to is not None:
        made.append((prepare_weights(args.what, args.to, overwrite=overwrite), args.to))
    if args.hf is not None:
        merge = args.adapters is None
        made.append((prepare_hf(args.what, args.hf, merge=merge, overwrite=overwrite), args.hf))
    if args.adapters is not None:
        made.append((prepare_adapters(args.what, args.adapters, args.hf, overwrite=overwrite), args.adapters))
    write_outputs([prepared.output for prepared, _ in made])
    for prepared, out in made:
        print(prepared.written(out))
    return 0


def _check_apart(outputs: dict[str, str | None]) -> None:
    """No output inside another or at the same place (the second would move the first aside)."""
    places = {option: Path(out).absolute() for option, out in outputs.items() if out and out.strip()}
    for (option, place), (other, around) in itertools.permutations(places.items(), 2):
        if place == around or around in place.parents:
            raise UsageError(f"{option} {outputs[option]}: inside {other} {outputs[other]}; name another place")


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

    from rewind.engine.model.pretrained import (
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


@dataclasses.dataclass(frozen=True)
class PreparedWeights:
    """The --to file's bytes, made and checked: nothing is on disk yet."""

    target: Path
    data: bytes
    summary: str

    @property
    def output(self) -> Output:
        return Output("--to", self.target, self.data)

    def written(self, out: str) -> str:
        return f"wrote {self.summary} to {out}"


def prepare_weights(run_dir: str, out: str, *, overwrite: bool = False) -> PreparedWeights:
    """Every check of `export RUN --to FILE` (an existing FILE only with `overwrite`) and FILE's bytes."""
    from safetensors.torch import save

    from rewind.stores.trunks import checkpoint_weights
    from rewind.tools.export_source import export_source

    target = check_target(out, replace=overwrite)
    source = export_source(run_dir)
    state = source.state
    ref = state.last_checkpoint
    groups = {"model": checkpoint_weights(run_dir, ref.checkpoint, ref.files)["model"]}
    # The layout builds the model these weights fit (stack identities and order): rewind.engine.model.layout.
    recorded = state.tokenizer if state.behaviours.data_identity else None
    model = model_metadata(source.config, source.layout, recorded)
    metadata = {"run": run_dir, "checkpoint": ref.checkpoint, "step": str(ref.step), **model}
    summary = f"{len(groups['model'])} tensors of checkpoint {ref.checkpoint} (step {ref.step})"
    return PreparedWeights(target, save(groups["model"], metadata=metadata), summary)
