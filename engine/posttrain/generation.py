"""Batched sampling of completions for rollouts (GRPO): many prompts, several samples each, one KV cache.

Every row (a prompt and a sample index) is prefilled once, right-padded to the longest prompt, then
extended one token per call, each row at its own length (rewind.engine.model.attention_inputs.KVCache); a row
that finishes leaves the batch. A prompt plus its completion must fit the model's block_size: a request
that could outgrow it is refused up front, never cropped (the training forward over prompt + completion
must see what the sampler saw).

Randomness is named, never carried: the draw of row (prompt id, sample index) at completion position k
(0 = the first new token) is a uniform from `torch_generator(seed, "rollout", stage, step, prompt_id,
sample_index, k)`, turned into a token by inverting the cumulative distribution (float64). So a completion
depends on its key, its prompt and the weights only, not on the batch it is sampled in, its place there,
or what else was drawn (up to the float rounding a different batch shape may bring, which can move a
draw that lands on a boundary between two tokens). The caller names the stage, the step and the prompt
ids (e.g. the prompt's index in its data), so a resume draws the same completions.

Log-probabilities are those of the distribution sampled from, log_softmax(logits / T) at the chosen token,
computed by `rewind.engine.posttrain.response_logprobs.token_logprobs`, the one path through which the training side
reads policy, old policy and reference (a temperature so small that logits / T leave float32's range is
refused when it happens: its log-probs would be NaN). Greedy
decoding (T = 0) picks `torch.argmax` (the first of tied maxima, as `rewind.engine.posttrain.sampling.generate`
does) and reports the log-prob at T = 1. Top-k and top-p are not offered: they change the distribution
the log-probs describe. The model runs in eval mode (no dropout) while sampling and is put back after.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from rewind.engine.model.attention_inputs import KVCache
from rewind.engine.model.layout import evaluating
from rewind.engine.model.rng import torch_generator
from rewind.engine.posttrain.response_logprobs import token_logprobs
from rewind.engine.posttrain.sampling import NonFiniteLogits, SamplingError, check_settings

DRAW_PURPOSE = "rollout"


@dataclasses.dataclass(frozen=True)
class Request:
    """One completion to sample: the prompt's token ids, its id (part of the draw's key) and sample index."""

    prompt: tuple[int, ...]
    prompt_id: int | str
    sample_index: int


@dataclasses.dataclass(frozen=True)
class Completion:
    """A sampled completion. `tokens` end with the eos token when `finish_reason` is "eos" (its log-prob
    is trained on too); "length": max_new_tokens were drawn without one. `log_probs[k]` is the log-prob
    of `tokens[k]` at the sampling temperature (T = 1 for greedy)."""

    prompt_id: int | str
    sample_index: int
    tokens: list[int]
    finish_reason: Literal["eos", "length"]
    log_probs: list[float]


def requests_for(
    prompts: Sequence[Sequence[int]], samples_per_prompt: int, prompt_ids: Sequence[int | str] | None = None
) -> list[Request]:
    """Each prompt's `samples_per_prompt` requests (sample indices 0..G-1), prompt by prompt; prompt ids
    default to the prompts' indices."""
    if samples_per_prompt < 1:
        raise SamplingError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    ids = list(range(len(prompts))) if prompt_ids is None else list(prompt_ids)
    if len(ids) != len(prompts):
        raise SamplingError(f"{len(ids)} prompt ids for {len(prompts)} prompts")
    return [
        Request(tuple(int(t) for t in p), i, g)
        for p, i in zip(prompts, ids, strict=True)
        for g in range(samples_per_prompt)
    ]


def sample_completions(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    stage: int | str,
    step: int,
    prompt_ids: Sequence[int | str] | None = None,
    eos_id: int | None = None,
) -> list[Completion]:
    """G = `samples_per_prompt` completions of every prompt, prompt by prompt (see `requests_for`)."""
    requests = requests_for(prompts, samples_per_prompt, prompt_ids)
    return sample_requests(
        model, requests, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, stage=stage,
        step=step, eos_id=eos_id,
    )  # fmt: skip


@torch.inference_mode()
def sample_requests(
    model: nn.Module,
    requests: Sequence[Request],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    stage: int | str,
    step: int,
    eos_id: int | None = None,
) -> list[Completion]:
    """A completion per request, in their order, all sampled in one batch."""
    _check(model, requests, max_new_tokens, temperature)
    if not requests or max_new_tokens == 0:
        return [Completion(r.prompt_id, r.sample_index, [], "length", []) for r in requests]
    with evaluating(model):
        return _sample(model, list(requests), max_new_tokens, temperature, (seed, stage, step), eos_id)


def _check(model: nn.Module, requests: Sequence[Request], max_new_tokens: int, temperature: float) -> None:
    check_settings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=1.0)
    if not getattr(model, "causal", True):
        raise SamplingError(
            "a masked objective (mlm, diffusion) does not predict left to right: cannot sample"
        )
    block_size, vocab_size = model.arch.block_size, model.head.out_features
    for r in requests:
        if not r.prompt:
            raise SamplingError(f"prompt {r.prompt_id!r} is empty: generation needs a token to continue")
        if len(r.prompt) + max_new_tokens > block_size:
            raise SamplingError(
                f"prompt {r.prompt_id!r} of {len(r.prompt)} tokens + max_new_tokens {max_new_tokens} exceeds "
                f"block_size {block_size}: a prompt and its completion must fit the model's context"
            )
        outside = [t for t in r.prompt if not 0 <= t < vocab_size]
        if outside:
            raise SamplingError(
                f"prompt {r.prompt_id!r}: token id {outside[0]} is outside the vocabulary ({vocab_size})"
            )


def _sample(
    model: nn.Module,
    requests: list[Request],
    max_new_tokens: int,
    temperature: float,
    key: tuple[int, int | str, int],
    eos_id: int | None,
) -> list[Completion]:
    device = next(model.parameters()).device
    lengths = torch.tensor([len(r.prompt) for r in requests], device=device)
    longest = int(lengths.max())
    padded = torch.zeros(len(requests), longest, dtype=torch.long, device=device)
    for row, r in enumerate(requests):
        padded[row, : len(r.prompt)] = torch.tensor(r.prompt, device=device)
    # The last token drawn is never fed back: the cache needs room for one fewer.
    cache = KVCache(len(requests), longest + max_new_tokens - 1, device)
    hidden = model(padded, cache=cache, valid=lengths, head_fn=lambda normed, _weight: normed)
    logits = model.head(hidden[torch.arange(len(requests), device=device), lengths - 1])
    tokens: list[list[int]] = [[] for _ in requests]
    log_probs: list[list[float]] = [[] for _ in requests]
    reasons: dict[int, Literal["eos", "length"]] = {}
    active = list(range(len(requests)))
    for position in range(max_new_tokens):
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogits(f"the model's logits at completion position {position} are not finite")
        keys = [(*key, requests[row].prompt_id, requests[row].sample_index) for row in active]
        chosen = _draw(logits, temperature, keys, position)
        one = chosen[:, None]  # a (B, 1) batch of one position each, as token_logprobs takes it
        scored = token_logprobs(
            logits[:, None], one, torch.ones_like(one, dtype=torch.bool), temperature or 1.0
        )[:, 0]
        if not bool(torch.isfinite(scored).all()):
            raise SamplingError(f"temperature {temperature}: logits / temperature leave float32's range")
        still = []
        for slot, (row, token, score) in enumerate(
            zip(active, chosen.tolist(), scored.tolist(), strict=True)
        ):
            tokens[row].append(token)
            log_probs[row].append(score)
            if eos_id is not None and token == eos_id:
                reasons[row] = "eos"
            elif position == max_new_tokens - 1:
                reasons[row] = "length"
            else:
                still.append(slot)
        if not still:
            break
        if len(still) < len(active):  # finished rows leave the batch (and the cache)
            kept = torch.tensor(still, device=device)
            cache, chosen = cache.select(kept), chosen[kept]
            active = [active[slot] for slot in still]
        logits = model(chosen[:, None], cache=cache)[:, -1]
    return [
        Completion(r.prompt_id, r.sample_index, tokens[row], reasons[row], log_probs[row])
        for row, r in enumerate(requests)
    ]


def uniform(key: tuple, position: int) -> float:
    """The uniform in [0, 1) of the draw at completion `position` of the row keyed (seed, stage, step,
    prompt id, sample index)."""
    seed, *parts = key
    generator = torch_generator(seed, DRAW_PURPOSE, *parts, position)
    return float(torch.rand((), dtype=torch.float64, generator=generator))


def _draw(logits: torch.Tensor, temperature: float, keys: list[tuple], position: int) -> torch.Tensor:
    """Each row's next token: argmax for greedy, else the inverse CDF of softmax(logits / T) (float64) at
    the row's own uniform, drawn from the stream (seed, "rollout", stage, step, prompt id, sample index,
    position)."""
    if temperature == 0.0:
        return torch.argmax(logits, dim=-1)
    uniforms = torch.tensor([uniform(key, position) for key in keys], dtype=torch.float64).to(logits.device)
    scaled = (logits.double() - logits.double().amax(dim=-1, keepdim=True)) / temperature
    probs = torch.softmax(scaled, dim=-1)
    cumulative = torch.cumsum(probs, dim=-1)
    picked = torch.searchsorted(cumulative, (uniforms * cumulative[:, -1])[:, None], right=True)[:, 0]
    # Rounding can put u * total at the total itself: the last token with any probability, never one without.
    last = probs.shape[1] - 1 - torch.argmax((probs.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.minimum(picked, last)
