"""Left-to-right generation from a causal model: greedy, or temperature then nucleus (top-p) sampling.

Reproducible for a seed on any machine that computes the same logits: each draw comes from its own
generator keyed by (seed, "sample", position), never from torch's global RNG, so a continuation depends
on the seed, the prompt and the weights only, not on what else ran in the process. Greedy decoding
(temperature 0) is `torch.argmax` of the last position's logits: the first of tied maxima, which is what
transformers' greedy `generate` picks on the exported model.

There is no KV cache: each new token runs the model over the last `block_size` tokens (the context the
model was trained on; longer inputs are cropped from the left). The models rewind trains are small, and
recomputing keeps the logits exactly those of the model's own `forward`. A continuation is at most
`block_size` tokens long: a longer one would no longer see its own start, and what it costs grows with
what is asked (a typo of 10**9 would run for days).

A temperature so small that logits / T overflow float32 (1e-300 is 0 there) draws from the limit of the
distribution as T falls, computed in float64 from the logits' differences to their maximum: the most
likely tokens, evenly. Logits that are not finite (a checkpoint whose weights went bad) are an error.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from rewind.engine.model.layout import evaluating
from rewind.engine.model.rng import torch_generator


class SamplingError(ValueError):
    """A request generation cannot serve (a masked model, an empty prompt, a bad setting): one line."""


class NonFiniteLogits(SamplingError):
    """The model computed NaN or an infinity: its weights, not the request, are at fault."""


def check_settings(*, max_new_tokens: int, temperature: float, top_p: float) -> None:
    """SamplingError unless the settings make sense (the CLI checks them before loading any model)."""
    if max_new_tokens < 0:
        raise SamplingError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not temperature >= 0.0 or temperature == float("inf"):  # `not >=` also refuses NaN
        raise SamplingError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise SamplingError(f"top_p must be in (0, 1], got {top_p}")


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` (vocab,) with everything outside the nucleus zeroed and the rest renormalised: the
    smallest set of most likely tokens whose probability reaches `top_p`. The most likely token is
    always kept, so a tiny top_p is greedy; ties are ordered by token id (stable sort), as argmax is."""
    if top_p >= 1.0:
        return probs
    ordered, order = torch.sort(probs, descending=True, stable=True)
    before = torch.cumsum(ordered, dim=0) - ordered  # probability of the tokens ranked above each
    kept = torch.zeros_like(probs)
    keep = before < top_p
    keep[0] = True  # (a top_p below float32's smallest number compares as 0: nothing would be kept)
    kept[order[keep]] = ordered[keep]
    return kept / kept.sum()


def next_token(logits: torch.Tensor, *, temperature: float, top_p: float, seed: int, position: int) -> int:
    """The token that follows, from the last position's `logits` (vocab,)."""
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogits(
            f"the model's logits at position {position} are not finite (NaN or infinite weights)"
        )
    if temperature == 0.0:
        return int(torch.argmax(logits))
    scaled = logits.float() / temperature
    if bool(torch.isfinite(scaled).all()):
        probs = torch.softmax(scaled, dim=-1)
    else:  # T too small for float32: differences to the maximum are <= 0, so nothing overflows to NaN
        probs = torch.softmax((logits.double() - logits.max().double()) / temperature, dim=-1).float()
    probs = nucleus(probs, top_p)
    generator = torch_generator(seed, "sample", position)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    eos_id: int | None = None,
) -> list[int]:
    """The continuation of `prompt_ids`: up to `max_new_tokens` (<= block_size) new token ids, ending before `eos_id`
    when the model produces it (the eos token itself is not returned). `position` in the draw's key is
    the new token's index in the whole sequence, prompt included."""
    check_settings(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    if not getattr(model, "causal", True):
        raise SamplingError("a masked objective (mlm, diffusion) does not predict left to right: cannot sample")
    if len(prompt_ids) == 0:
        raise SamplingError("the prompt is empty: generation needs at least one token to continue")
    block_size = model.arch.block_size
    if max_new_tokens > block_size:
        raise SamplingError(
            f"max_new_tokens {max_new_tokens}: at most the model's context, {block_size} tokens (block_size)"
        )
    vocab_size = model.head.out_features
    ids = [int(i) for i in prompt_ids]
    outside = [i for i in ids if not 0 <= i < vocab_size]
    if outside:
        raise SamplingError(f"prompt token id {outside[0]} is outside the model's vocabulary ({vocab_size})")
    device = next(model.parameters()).device
    new: list[int] = []
    with evaluating(model):
        for _ in range(max_new_tokens):
            context = torch.tensor([ids[-block_size:]], dtype=torch.long, device=device)
            logits = model(context)[0, -1]
            token = next_token(logits, temperature=temperature, top_p=top_p, seed=seed, position=len(ids))
            if eos_id is not None and token == eos_id:
                break
            ids.append(token)
            new.append(token)
    return new
