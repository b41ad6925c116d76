"""`rewind export RUN --hf DIR`: the run's model as a transformers model directory.

The architecture is the one that computes the run's block exactly (rewind.engine.model.hf_models:
LlamaForCausalLM for RMSNorm + SwiGLU (Qwen2ForCausalLM with q, k, v biases, Qwen3ForCausalLM with q/k
norms: rewind.engine.model.hf_families), ArceeForCausalLM for RMSNorm + GELU, Starcoder2ForCausalLM for
LayerNorm + GELU, StableLmForCausalLM for LayerNorm + SwiGLU). DIR gets `config.json`, `model.safetensors`
(float32, metadata {"format": "pt"} as transformers writes it), `generation_config.json` (the model's end
token when it has one, and no length: a length there would make every `generate(max_new_tokens=...)`
warn) and, when the run has a tokenizer (RUN/data/tokenizer.json), `tokenizer.json` and
`tokenizer_config.json` (PreTrainedTokenizerFast), so `AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)` load it as is.

What is exported is the last committed checkpoint's model, under the layout it had (a grown model's
stacks in their final order, one layer per block), in float32, an NF4 stack's weights dequantised (what
the run computed with; nothing is re-quantised). Its LoRA adapters are merged into their base weights,
unless `--adapters` is given too: DIR then holds the unmerged base the adapters go onto
(rewind.tools.export_adapters). A masked objective, which no causal LM computes, is refused in one line
(exit 2), and so is a DIR that exists and is not empty, unless `--overwrite` is given and DIR holds only
what an earlier --hf export wrote (it is then replaced whole). Every check runs before anything is written;
the files are written into a temporary directory beside DIR, synced, and renamed to DIR once the export's
other outputs are whole too (rewind.tools.outfile.write_outputs), so DIR is there whole or not at all.

The end token (`eos_token_id` of generation_config.json and config.json, where `generate` stops) is the
one `rewind sample` stops at (rewind.tools.sample_cmd.end_token_of): the tokenizer's <|endoftext|>; for a
model on UTF-8 bytes that has trained in an sft, dpo or grpo stage, the "\n" that ends its responses
(docs/posttraining.md); none for a model pretrained on bytes, whose newlines are text.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rewind.tools.errors import CommandError
from rewind.tools.outfile import Output

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
GENERATION_NAME = "generation_config.json"
TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
END_OF_TEXT = "<|endoftext|>"
RUN_TOKENIZER = ("data", "tokenizer.json")  # where a run keeps its tokenizer (absent: token id = byte value)


@dataclasses.dataclass(frozen=True)
class PreparedHf:
    """The directory's files, checked and serialised: nothing is on disk yet."""

    target: Path
    files: dict[str, bytes]
    summary: str
    architecture: str  # the transformers class, e.g. LlamaForCausalLM

    @property
    def output(self) -> Output:
        """DIR, for rewind.tools.outfile.write_outputs (whole or not at all, with the other outputs)."""
        return Output("--hf", self.target, self.files)

    def written(self, out_dir: str) -> str:
        return f"wrote {self.summary} to {out_dir} (transformers {self.architecture})"


HF_FILES = (CONFIG_NAME, WEIGHTS_NAME, GENERATION_NAME, TOKENIZER_NAME, TOKENIZER_CONFIG_NAME)


def check_hf_dir(out_dir: str, *, overwrite: bool = False) -> Path:
    """DIR, refused up front (exit 2) unless it is a new or empty local directory outside a run's files, or
    with `overwrite` one holding only what an earlier --hf export wrote (rewind.tools.outfile)."""
    from rewind.tools.outfile import check_out_directory

    return check_out_directory("--hf", out_dir, HF_FILES, overwrite=overwrite)


def prepare_hf(run_dir: str, out_dir: str, *, merge: bool = True, overwrite: bool = False) -> PreparedHf:
    """Every check of `export RUN --hf DIR` and the bytes of DIR's files; writes nothing. `merge`: the
    adapters merged into the weights (else the unmerged base, for `--adapters`); `overwrite`: an earlier
    export in DIR may be replaced."""
    from safetensors.torch import save

    from rewind.engine.model import hf_models
    from rewind.engine.model.hf_llama import Unmapped
    from rewind.stores.trunks import checkpoint_weights
    from rewind.tools.export_source import export_source, expressible

    target = check_hf_dir(out_dir, overwrite=overwrite)
    source = export_source(run_dir)
    state, config, layout = source.state, source.config, source.layout
    ref = state.last_checkpoint
    family = expressible(config, "--hf")
    groups = checkpoint_weights(run_dir, ref.checkpoint, ref.files)
    arch = config.architecture
    try:
        computed = hf_models.computed_weights(groups["model"], groups["adapters"] if merge else {}, layout, arch)
        tensors = hf_models.hf_weights(computed, layout, family)
    except (ValueError, Unmapped) as exc:
        raise CommandError(f"--hf: checkpoint {ref.checkpoint} does not fit its layout: {exc}", 1) from None
    num_layers = sum(spec.num_blocks for spec in layout.stacks)
    tokenizer = run_tokenizer(run_dir, state.tokenizer if state.behaviours.data_identity else None)
    eos, has_end_of_text = end_token_id(tokenizer, run_dir, config, (state.anchor or state).stage)
    files = {
        WEIGHTS_NAME: save(dict(sorted(tensors.items())), metadata={"format": "pt"}),
        CONFIG_NAME: _json(hf_models.hf_config(family, arch, num_layers=num_layers, eos_token_id=eos)),
        GENERATION_NAME: _json(generation_config(eos)),
    }
    if tokenizer is not None:
        files[TOKENIZER_NAME] = tokenizer
        files[TOKENIZER_CONFIG_NAME] = _json(tokenizer_config(arch.block_size, has_end_of_text))
    adapters_note = ""
    if groups["adapters"]:
        adapters_note = ", adapters merged" if merge else ", the base of --adapters: adapters not merged"
    tokenizer_note = " and its tokenizer" if tokenizer is not None else ""
    summary = (
        f"{len(tensors)} tensors ({num_layers} layers{adapters_note}) of checkpoint {ref.checkpoint} "
        f"(step {ref.step}){tokenizer_note}"
    )
    return PreparedHf(target, files, summary, family.names.architecture)


def run_tokenizer(run_dir: str, recorded: str | None) -> bytes | None:
    """The bytes of RUN/data/tokenizer.json, or None when the run has none (its tokens are bytes), checked
    against the sha256 the run `recorded` ("" = bytes; None: a run from before tokenizers were on record):
    an export never ships a tokenizer other than the one the weights learned."""
    import hashlib

    from rewind.stores.datamanifest import MAX_TOKENIZER_BYTES
    from rewind.stores.fsio import filesystem

    location = filesystem(run_dir).join(*RUN_TOKENIZER)
    try:  # (a regular file of at most MAX_TOKENIZER_BYTES: a FIFO or /dev/zero is refused, not read)
        data = location.read_bounded(MAX_TOKENIZER_BYTES) if location.exists() else None
    except OSError as exc:
        raise CommandError(f"{location.url}: cannot read the run's tokenizer ({exc.strerror or exc})", 1) from None
    found = hashlib.sha256(data).hexdigest() if data is not None else ""
    if recorded is not None and found != recorded:
        raise CommandError(
            f"{location.url}: not the tokenizer the run recorded ({found[:12] or 'missing'}, recorded "
            f"{recorded[:12] or 'none: UTF-8 bytes'}); `rewind verify --data {run_dir}`",
            1,
        )
    return data


def end_token_id(tokenizer: bytes | None, run_dir: str, config, stage: int) -> tuple[int | None, bool]:
    """The id of the model's end token (None: it has none) and whether it is the tokenizer's
    <|endoftext|>, for the run's tokenizer (`tokenizer`, None for UTF-8 bytes) and a checkpoint in
    `stage` of `config` (see the module's docstring)."""
    from rewind.engine.data.tokenizer import ByteTokenizer, Tokenizer, TokenizerError
    from rewind.tools.sample_cmd import end_token_of

    try:
        text = ByteTokenizer() if tokenizer is None else Tokenizer(tokenizer.decode(), source="tokenizer.json")
    except (TokenizerError, UnicodeDecodeError) as exc:
        raise CommandError(f"{run_dir}/data/tokenizer.json: not a tokenizers file ({exc})", 1) from None
    return end_token_of(config, stage, text), text.eos_id is not None


def generation_config(eos: int | None) -> dict[str, object]:
    """Only the end token: any length here (max_length) makes transformers warn on every
    `generate(..., max_new_tokens=N)`; the trained context is config.json's max_position_embeddings."""
    return {} if eos is None else {"eos_token_id": eos}


def tokenizer_config(block_size: int, has_eos: bool) -> dict[str, object]:
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": block_size,
        "clean_up_tokenization_spaces": False,
    }
    if has_eos:
        config["eos_token"] = END_OF_TEXT
    return config


def _json(value: dict) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()
