"""`rewind export RUN --adapters DIR`: the run's LoRA adapters in peft's standard layout.

DIR gets `adapter_config.json` (peft's own LoraConfig, serialised as its `save_pretrained` does, so
every field is one peft reads: the adapted modules, and each stack's rank and alpha as rank_pattern /
alpha_pattern) and `adapter_model.safetensors` (peft's key layout:
`base_model.model.<module>.lora_A.weight`, no pickle). Loaded with `PeftModel.from_pretrained(base, DIR)`
onto the base model `--to` exports (whose safetensors metadata carries the layout that builds it), it
computes what the run's model computes, bit for bit. For a QLoRA run the base is exported in float:
quantise it (NF4, as the run did) before comparing outputs bit for bit.
Adapters are never merged into the base here: merging into a 4-bit trunk re-quantises it and moves the
logits by far more than rounding.

What is exported is the last committed checkpoint's model: its adapters, under the layout the run had
when that checkpoint was taken (a run that grew after its last checkpoint and then crashed has a later
layout in the log than the checkpoint holds). Everything is checked before anything is written: a run
without a checkpoint or whose checkpoint holds no adapters is exit 1, a DIR that cannot be a directory
(an existing file, a path inside a run's own files) exit 2, and then nothing is written
(`prepare_adapters` does all of it; a command writing other files as well calls it before writing
any). Each file is written whole or not at all (rewind.tools.outfile), the weights first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from rewind.tools.errors import CommandError, UsageError
from rewind.tools.runlog import load_records

PEFT_PREFIX = "base_model.model."
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
_ADAPTER_KEY = re.compile(r"(?P<module>stacks\.\d+\.blocks\.\d+\.[\w.]+)\.lora_(?P<part>[AB])\.weight")


def adapter_config(tensors: dict, layout):
    """peft's LoraConfig for checkpoint adapter `tensors` (unwrapped names, `<module>.lora_A.weight`)
    of a model of `layout`: the adapted modules are those the tensors name, each module's rank is its
    lora_A's, its alpha its stack's. None when there are no tensors; CommandError (exit 1) when the
    tensors are not a set of LoRA pairs that agrees with the layout."""
    from rewind.engine.layout import lora_config

    if not tensors:
        return None
    specs = {spec.stack: spec for spec in layout.stacks}
    parts: dict[str, dict[str, object]] = {}
    for name, tensor in tensors.items():
        match = _ADAPTER_KEY.fullmatch(name)
        if match is None:
            raise CommandError(f"checkpoint adapter {name!r} is not a LoRA weight of a stack's block", 1)
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    modules: dict[str, tuple[int, float]] = {}
    for module, pair in sorted(parts.items()):
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise CommandError(f"checkpoint adapters of {module}: not a lora_A, lora_B pair of one rank", 1)
        spec = specs.get(int(module.split(".")[1]))
        if spec is None or spec.adapter_rank != a.shape[0]:
            wanted = "no such stack" if spec is None else f"rank {spec.adapter_rank}"
            raise CommandError(
                f"checkpoint adapters of {module} (rank {a.shape[0]}) do not fit the layout ({wanted})", 1
            )
        modules[module] = (spec.adapter_rank, spec.adapter_alpha)
    return lora_config(modules)


def config_json(lora) -> bytes:
    """`adapter_config.json` as peft's `PeftConfig.save_pretrained` writes it (sets as lists, keys
    sorted, indent 2), with the target modules sorted so that the same adapters give the same bytes."""
    output = lora.to_dict()
    for key, value in output.items():
        if isinstance(value, set):
            output[key] = sorted(value)
    return json.dumps(output, indent=2, sort_keys=True).encode()


def checkpoint_layout(state):
    """The layout of the model that `state`'s last checkpoint holds: that of the fold's restore anchor
    (the state just after the checkpoint, which is what a resume loads it under), not the log's
    latest, which a growth after the checkpoint has changed."""
    from rewind.states.growth import current_layout

    anchor = state.anchor
    if anchor is None or anchor.last_checkpoint != state.last_checkpoint:
        raise CommandError(
            "the log's restore anchor is not its last checkpoint: cannot tell that model's layout", 1
        )
    return current_layout(anchor)


def check_out_dir(out_dir: str) -> tuple[Path, Path]:
    """The two files' paths in DIR, refused up front (exit 2) where DIR cannot be a directory of ours."""
    from rewind.tools.outfile import check_target

    if not out_dir.strip():
        raise UsageError("--adapters '': an empty path; name the directory to write the adapters to")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(
            f"--adapters {out_dir}: exists and is not a directory; name a directory to write the adapters to"
        )
    weights, config = (
        check_target(os.path.join(out_dir, name), "--adapters", "adapter")
        for name in (WEIGHTS_NAME, CONFIG_NAME)
    )
    return weights, config


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Adapters checked and ready to write: nothing is on disk yet."""

    weights_path: Path
    config_path: Path
    weights: bytes
    config: bytes
    summary: str


def prepare_adapters(run_dir: str, out_dir: str) -> Prepared:
    """Every check of `export RUN --adapters DIR` (exit 2: DIR; exit 1: the run has no checkpoint or
    its checkpoint no adapters, or they do not fit its layout) and the bytes to write; writes nothing,
    so a caller writing other files too can run it before them."""
    from safetensors.torch import save

    from rewind.states.fold import fold
    from rewind.stores.trunks import checkpoint_weights

    weights_path, config_path = check_out_dir(out_dir)
    records = load_records(run_dir)
    state = fold(e for _, e in records)
    ref = state.last_checkpoint
    if ref is None:
        raise CommandError(f"{run_dir}: the run has no committed checkpoint yet", 1)
    tensors = checkpoint_weights(run_dir, ref.checkpoint, ref.files)["adapters"]
    lora = adapter_config(tensors, checkpoint_layout(state))
    if lora is None:
        raise CommandError(
            f"{run_dir}: the model of checkpoint {ref.checkpoint} has no adapters (no lora or qlora trunk, no nf4 stack)",
            1,
        )
    weights = save(
        {PEFT_PREFIX + name: tensor.contiguous() for name, tensor in sorted(tensors.items())},
        metadata={"format": "pt"},
    )
    summary = f"{len(tensors)} adapter tensors of checkpoint {ref.checkpoint} (step {ref.step})"
    return Prepared(weights_path, config_path, weights, config_json(lora), summary)


def write_adapters(prepared: Prepared, out_dir: str) -> None:
    """Write what `prepare_adapters` made: the weights, then the config (each whole or not at all)."""
    from rewind.tools.outfile import write_file_atomically

    try:
        write_file_atomically(prepared.weights_path, prepared.weights)
        write_file_atomically(prepared.config_path, prepared.config)
    except OSError as exc:
        raise CommandError(
            f"--adapters {out_dir}: cannot write the adapters ({exc.strerror or exc})", 1
        ) from None
    print(f"wrote {prepared.summary} to {out_dir} (peft layout)")


def export_adapters(run_dir: str, out_dir: str) -> int:
    write_adapters(prepare_adapters(run_dir, out_dir), out_dir)
    return 0
