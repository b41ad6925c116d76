"""`rewind bench rollout`: tokens per second of rewind's batched, cached sampler (rewind.engine.posttrain.generation)
against transformers' `generate` on the same model, and the share of a GRPO-like step spent sampling.

The model is rewind's GPT with the Llama block (RMSNorm, SwiGLU), exported with rewind's own HF export
(rewind.engine.model.hf_models: the config.json and tensors `rewind export --hf` writes) into a temporary
directory and loaded with `AutoModelForCausalLM.from_pretrained`, float32 on the CPU. Both sample the
same prompts (different lengths; transformers left-pads them with an attention mask, rewind right-pads
into its cache), G completions per prompt (each prompt given G times), exactly `max_new_tokens` each (no
end token), greedy and at temperature 1 with no top-k/top-p on either side. Each timing is repeated, the
two sides alternated: `<mode>_ratios` are transformers seconds / rewind seconds per repeat (above 1:
rewind is faster), `speed_ratio` the median over every repeat of both modes (goal >= 1.0) with its range;
the raw seconds and the best tokens/s stand beside them. Greedy tokens are compared row by row as a check
that both computed the same model (`greedy_rows_equal`; a near tie between two logits may part a row,
which is float rounding, not a bug).

The GRPO-like step: G completions of every prompt at temperature 1, then one forward and backward over
prompt + completion (right-padded) with the completion tokens' log-probs (`token_logprobs`, as the losses read them) weighted by
random advantages, in training mode. `sampling_share`: sampling seconds over the whole step's (median of
the repeats, and the range).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.utils import logging

from rewind.engine.model import hf_models
from rewind.engine.model.model import GPT
from rewind.engine.model.rng import torch_generator
from rewind.engine.posttrain.generation import sample_completions
from rewind.engine.posttrain.response_logprobs import token_logprobs
from rewind.states.config import ArchitectureSection
from rewind.states.growth import initial_layout

SEED = 5
SPEED_RATIO_GOAL = 1.0
ARCHITECTURE = ArchitectureSection(
    block_size=256, vocab_size=512, num_layers=4, num_heads=4, d_model=128, mlp="swiglu", norm="rmsnorm"
)
QUICK_ARCHITECTURE = ArchitectureSection(
    block_size=64, vocab_size=128, num_layers=2, num_heads=2, d_model=32, mlp="swiglu", norm="rmsnorm"
)
# (prompts, G, shortest and longest prompt, max_new_tokens, repeats)
FULL = (8, 4, 16, 48, 64, 3)
QUICK = (2, 2, 4, 8, 8, 2)


def exported(model: GPT, directory: Path):
    """`model` as `rewind export --hf` writes it (config.json, model.safetensors), loaded by transformers."""
    arch = model.arch
    family = hf_models.FAMILIES[(arch.norm, arch.mlp)]
    layout = initial_layout(arch.num_layers)
    config = hf_models.hf_config(family, arch, num_layers=arch.num_layers)
    tensors = hf_models.hf_weights(model.state_dict(), layout, family)
    save_file(dict(sorted(tensors.items())), str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config))
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # its "Loading weights" bar would go to stderr beside the figures
    try:
        return AutoModelForCausalLM.from_pretrained(directory).eval()
    finally:
        if shown:
            logging.enable_progress_bar()


def bench_prompts(vocab_size: int, num_prompts: int, shortest: int, longest: int) -> list[list[int]]:
    generator = torch_generator(SEED, "bench-rollout", "prompts")
    lengths = torch.linspace(shortest, longest, num_prompts).round().long().tolist()
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def _ours(model, prompts, samples, new, temperature) -> tuple[float, list[list[int]]]:
    began = time.perf_counter()
    completions = sample_completions(
        model, prompts, samples_per_prompt=samples, max_new_tokens=new, temperature=temperature, seed=SEED,
        stage=0, step=0,
    )  # fmt: skip
    return time.perf_counter() - began, [c.tokens for c in completions]


def _theirs(hf, prompts, samples, new, temperature) -> tuple[float, list[list[int]]]:
    rows = [p for p in prompts for _ in range(samples)]  # (greedy generate refuses num_return_sequences)
    longest = max(len(p) for p in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    attention = torch.zeros(len(rows), longest, dtype=torch.long)
    for row, prompt in enumerate(rows):  # left padding, as transformers' decoder-only generate wants
        ids[row, longest - len(prompt) :] = torch.tensor(prompt)
        attention[row, longest - len(prompt) :] = 1
    sampled = temperature > 0
    options = {"temperature": temperature, "top_k": None, "top_p": None} if sampled else {}
    began = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=attention, max_new_tokens=new, min_new_tokens=new, do_sample=sampled,
            pad_token_id=0, eos_token_id=None, **options,
        )  # fmt: skip
    return time.perf_counter() - began, out[:, longest:].tolist()


def _grpo_step(model, prompts, samples, new) -> tuple[float, float]:
    """(sampling seconds, forward + backward seconds) of one GRPO-like step."""
    began = time.perf_counter()
    completions = sample_completions(
        model, prompts, samples_per_prompt=samples, max_new_tokens=new, temperature=1.0, seed=SEED, stage=0,
        step=1,
    )  # fmt: skip
    sampled = time.perf_counter()
    rows = [prompts[c.prompt_id] + c.tokens for c in completions]
    width = max(len(r) for r in rows) - 1
    inputs = torch.zeros(len(rows), width, dtype=torch.long)
    targets = torch.zeros(len(rows), width, dtype=torch.long)
    scored = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (row, c) in enumerate(zip(rows, completions, strict=True)):
        inputs[i, : len(row) - 1] = torch.tensor(row[:-1])
        targets[i, : len(row) - 1] = torch.tensor(row[1:])
        scored[i, len(row) - 1 - len(c.tokens) : len(row) - 1] = True
    advantages = torch.randn(len(rows), generator=torch_generator(SEED, "bench-rollout", "advantages"))
    model.train()
    log_probs = token_logprobs(model(inputs), targets, scored, 1.0)
    loss = -(log_probs * advantages[:, None]).sum() / scored.sum()
    loss.backward()
    model.zero_grad(set_to_none=True)
    model.eval()
    return sampled - began, time.perf_counter() - sampled


def _range(values: list[float]) -> list[float]:
    return [min(values), max(values)]


def run_rollout_bench(quick: bool = False) -> dict:
    arch = QUICK_ARCHITECTURE if quick else ARCHITECTURE
    num_prompts, samples, shortest, longest, new, repeats = QUICK if quick else FULL
    model = GPT(arch, seed=SEED).eval()
    prompts = bench_prompts(arch.vocab_size, num_prompts, shortest, longest)
    num_tokens = num_prompts * samples * new
    result: dict = {}
    every_ratio: list[float] = []
    with tempfile.TemporaryDirectory(prefix="rewind-bench-rollout-") as directory:
        hf = exported(model, Path(directory))
        for mode, temperature in (("greedy", 0.0), ("sampled", 1.0)):
            _ours(model, prompts, samples, 2, temperature)  # warm-up: lazy initialisation on either side
            _theirs(hf, prompts, samples, 2, temperature)
            ours_s, theirs_s = [], []
            for _ in range(repeats):  # alternated, so a burst of load on the machine hits both
                ours, our_tokens = _ours(model, prompts, samples, new, temperature)
                theirs, their_tokens = _theirs(hf, prompts, samples, new, temperature)
                ours_s.append(ours)
                theirs_s.append(theirs)
            ratios = [t / o for o, t in zip(ours_s, theirs_s, strict=True)]
            every_ratio += ratios
            result |= {
                f"{mode}_rewind_s": ours_s,
                f"{mode}_transformers_s": theirs_s,
                f"{mode}_rewind_tokens_per_second": num_tokens / min(ours_s),
                f"{mode}_transformers_tokens_per_second": num_tokens / min(theirs_s),
                f"{mode}_ratios": ratios,
                f"{mode}_ratio_range": _range(ratios),
            }
            if mode == "greedy":
                result["greedy_rows_equal"] = sum(
                    a == b for a, b in zip(our_tokens, their_tokens, strict=True)
                )
    steps = [_grpo_step(model, prompts, samples, new) for _ in range(repeats)]
    shares = [sampling / (sampling + training) for sampling, training in steps]
    return {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "architecture": f"{arch.num_layers} layers, d_model {arch.d_model}, {arch.num_heads} heads, {arch.mlp}, "
        f"{arch.norm}, vocab {arch.vocab_size}",
        "baseline": "transformers generate (KV cache, left padding) on rewind's own HF export of the model",
        "num_prompts": num_prompts,
        "samples_per_prompt": samples,
        "prompt_lengths": [len(p) for p in prompts],
        "max_new_tokens": new,
        "num_rows": num_prompts * samples,
        "repeats": repeats,
        **result,
        "speed_ratio": statistics.median(every_ratio),  # transformers seconds / rewind seconds
        "speed_ratio_range": _range(every_ratio),
        "speed_ratio_goal": SPEED_RATIO_GOAL,
        "grpo_sampling_s": [s for s, _ in steps],
        "grpo_train_s": [t for _, t in steps],
        "sampling_share": statistics.median(shares),
        "sampling_share_range": _range(shares),
    }
