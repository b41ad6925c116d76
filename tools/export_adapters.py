"""`rewind export RUN --adapters DIR`: the run's LoRA adapters in peft's standard layout.

DIR gets `adapter_config.json` (written by peft's own LoraConfig, so every field is one peft reads:
the target modules, and each stack's rank and alpha as rank_pattern / alpha_pattern) and
`adapter_model.safetensors` (peft's key layout: `base_model.model.<module>.lora_A.weight`). Loaded with
`PeftModel.from_pretrained(base, DIR)` onto the base model `--to` exports (whose safetensors metadata
carries the layout that builds it), it computes what the run's model computes. For a QLoRA run the
base is exported in float: quantise it (NF4, as the run did) before comparing outputs bit for bit.
Adapters are never merged into the base here: merging into a 4-bit trunk re-quantises it and moves the
logits by far more than rounding.
"""

from __future__ import annotations

import os
import re

from rewind.tools.errors import CommandError, UsageError
from rewind.tools.runlog import load_records

PEFT_PREFIX = "base_model.model."
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"


def adapter_config(config, layout):
    """peft's LoraConfig for the adapters of `layout` (None when it has none)."""
    from peft import LoraConfig

    targets, ranks, alphas = [], {}, {}
    for spec in layout.stacks:
        if spec.adapter_rank <= 0:
            continue
        for block in range(spec.num_blocks):
            for layer in config.lora.targets:
                name = f"stacks.{spec.stack}.blocks.{block}.{layer}"
                targets.append(name)
                ranks[re.escape(name)] = spec.adapter_rank
                alphas[re.escape(name)] = spec.adapter_alpha
    if not targets:
        return None
    first = next(s for s in layout.stacks if s.adapter_rank > 0)
    return LoraConfig(
        r=first.adapter_rank,
        lora_alpha=first.adapter_alpha,
        target_modules=targets,
        rank_pattern=ranks,
        alpha_pattern=alphas,
        lora_dropout=0.0,
        bias="none",
    )


def export_adapters(run_dir: str, out_dir: str) -> int:
    from safetensors.torch import save

    from rewind.states.fold import fold
    from rewind.states.growth import current_layout
    from rewind.stores.trunks import checkpoint_weights
    from rewind.tools.outfile import write_file_atomically

    records = load_records(run_dir)
    state = fold(e for _, e in records)
    ref = state.last_checkpoint
    if ref is None:
        raise CommandError(f"{run_dir}: the run has no committed checkpoint yet", 1)
    config = records[0][1].config
    for _, event in records:  # the config in force at the end (a fork's last ConfigChanged)
        if type(event).__name__ == "ConfigChanged":
            config = event.config
    lora = adapter_config(config, current_layout(state))
    if lora is None:
        raise CommandError(f"{run_dir}: the model has no adapters (no lora or qlora trunk, no nf4 stack)", 1)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UsageError(f"--adapters {out_dir}: exists and is not a directory")
    tensors = checkpoint_weights(run_dir, ref.checkpoint, ref.files)["adapters"]
    os.makedirs(out_dir, exist_ok=True)
    data = save({PEFT_PREFIX + name: tensor for name, tensor in tensors.items()}, metadata={"format": "pt"})
    write_file_atomically(os.path.join(out_dir, WEIGHTS_NAME), data)
    lora.save_pretrained(out_dir)
    print(f"wrote {len(tensors)} adapter tensors of checkpoint {ref.checkpoint} (step {ref.step}) to {out_dir} (peft layout)")
    return 0
