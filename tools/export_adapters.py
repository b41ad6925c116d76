"""`rewind export RUN --hf HF_DIR --adapters DIR`: the run's LoRA adapters in peft's standard layout, for the
transformers model `--hf` writes.

DIR gets `adapter_config.json` (peft's own LoraConfig, serialised as its `save_pretrained` does, so every
field is one peft reads: task CAUSAL_LM, the adapted modules, each one's rank and alpha as rank_pattern /
alpha_pattern, and HF_DIR as the base model) and `adapter_model.safetensors` (peft's key layout,
`base_model.model.<module>.lora_A.weight`, no pickle), named for HF_DIR's modules
(rewind.engine.model.hf_models.hf_adapters: a fused qkv or gate-and-up adapter becomes one per projection, its
lora_A copied and its lora_B split). `--adapters` needs `--hf` in the same command, which then writes the
adapters' base unmerged (an NF4 stack's weights dequantised, what the run computed with), so

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(HF_DIR), DIR)

computes what the run's model computes, to float32 rounding (`--hf` alone merges the adapters instead).

What is exported is the last committed checkpoint's model: its adapters, under the layout the run had
when that checkpoint was taken (a run that grew after its last checkpoint and then crashed has a later
layout in the log than the checkpoint holds). Everything is checked before anything is written: a run
without a checkpoint or whose checkpoint holds no adapters is exit 1, a DIR that cannot be a directory
of ours (an existing file, a path inside a run's own files, a directory that is not empty: with
`--overwrite`, one holding only an earlier --adapters export, then replaced whole) or a model no
transformers model computes exit 2, and then nothing is written (`prepare_adapters` does all of it; a
command writing other files as well calls it before writing any). DIR is written into a temporary
directory beside it and renamed into place with the export's other outputs (rewind.tools.outfile
.write_outputs): all of them whole, or none.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from rewind.tools.errors import CommandError
from rewind.tools.outfile import Output

PEFT_PREFIX = "base_model.model."
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"
_ADAPTER_KEY = re.compile(r"(?P<module>stacks\.\d+\.blocks\.\d+\.[\w.]+)\.lora_(?P<part>[AB])\.weight")


def check_adapters(tensors: dict, layout) -> None:
    """CommandError (exit 1) unless checkpoint adapter `tensors` (unwrapped names, `<module>.lora_A.weight`)
    are LoRA pairs of the stacks of `layout`, each of its stack's rank."""
    specs = {spec.stack: spec for spec in layout.stacks}
    parts: dict[str, dict[str, object]] = {}
    for name, tensor in tensors.items():
        match = _ADAPTER_KEY.fullmatch(name)
        if match is None:
            raise CommandError(f"checkpoint adapter {name!r} is not a LoRA weight of a stack's block", 1)
        parts.setdefault(match["module"], {})[match["part"]] = tensor
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


def peft_config(modules: dict[str, tuple[int, float]], base: str):
    """peft's LoraConfig of a causal LM at `base` adapting `modules` (name -> (rank, alpha))."""
    from rewind.engine.model.layout import lora_config

    lora = lora_config(modules)
    lora.task_type = "CAUSAL_LM"  # PeftModel.from_pretrained then gives a PeftModelForCausalLM (generate)
    lora.base_model_name_or_path = base  # AutoPeftModelForCausalLM loads the base from here
    return lora


def config_json(lora) -> bytes:
    """`adapter_config.json` as peft's `PeftConfig.save_pretrained` writes it (sets as lists, keys
    sorted, indent 2), with the target modules sorted so that the same adapters give the same bytes."""
    output = lora.to_dict()
    for key, value in output.items():
        if isinstance(value, set):
            output[key] = sorted(value)
    return json.dumps(output, indent=2, sort_keys=True).encode()


def check_out_dir(out_dir: str, *, overwrite: bool = False) -> Path:
    """DIR, refused up front (exit 2) where it cannot be a directory of ours: new or empty, or with
    `overwrite` holding only what an earlier --adapters export wrote (rewind.tools.outfile)."""
    from rewind.tools.outfile import check_out_directory

    return check_out_directory("--adapters", out_dir, (WEIGHTS_NAME, CONFIG_NAME), overwrite=overwrite)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Adapters checked and ready to write: nothing is on disk yet."""

    target: Path
    weights: bytes
    config: bytes
    summary: str
    architecture: str  # the transformers class the adapters are named for

    @property
    def output(self) -> Output:
        """DIR, for rewind.tools.outfile.write_outputs (whole or not at all, with the other outputs)."""
        return Output("--adapters", self.target, {WEIGHTS_NAME: self.weights, CONFIG_NAME: self.config})

    def written(self, out_dir: str) -> str:
        return f"wrote {self.summary} to {out_dir} (peft layout, for the {self.architecture} of --hf)"


def prepare_adapters(run_dir: str, out_dir: str, hf_dir: str, *, overwrite: bool = False) -> Prepared:
    """Every check of `export RUN --hf HF_DIR --adapters DIR` for DIR (exit 2: DIR, or a model no
    transformers model computes; exit 1: the run has no checkpoint or its checkpoint no adapters, or they
    do not fit its layout) and the bytes to write; writes nothing, so a caller writing other files too
    can run it before them."""
    from safetensors.torch import save

    from rewind.engine.model import hf_models
    from rewind.stores.trunks import checkpoint_weights
    from rewind.tools.export_source import export_source, expressible

    target = check_out_dir(out_dir, overwrite=overwrite)
    source = export_source(run_dir)
    state, layout = source.state, source.layout
    ref = state.last_checkpoint
    family = expressible(source.config, "--adapters")
    tensors = checkpoint_weights(run_dir, ref.checkpoint, ref.files)["adapters"]
    if not tensors:
        raise CommandError(
            f"{run_dir}: the model of checkpoint {ref.checkpoint} has no adapters (no lora or qlora trunk, no nf4 stack)",
            1,
        )
    check_adapters(tensors, layout)
    try:
        renamed, modules = hf_models.hf_adapters(tensors, layout, family)
    except ValueError as exc:
        raise CommandError(f"--adapters: checkpoint {ref.checkpoint}: {exc}", 1) from None
    weights = save(
        {PEFT_PREFIX + name: tensor for name, tensor in sorted(renamed.items())}, metadata={"format": "pt"}
    )
    lora = peft_config(modules, str(Path(hf_dir).absolute()))
    summary = (
        f"{len(renamed)} adapter tensors ({len(tensors)} in rewind's fused layers) of checkpoint "
        f"{ref.checkpoint} (step {ref.step})"
    )
    return Prepared(target, weights, config_json(lora), summary, family.names.architecture)
