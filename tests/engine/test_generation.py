"""Batched rollout sampling (rewind.engine.posttrain.generation): a completion is a function of its key (seed, stage,
step, prompt id, sample index), never of the batch it is sampled in; greedy is `rewind sample`'s greedy;
the log-probs are those of the sampled distribution; eos and length end a row; bad requests are refused."""

from __future__ import annotations

import msgspec
import pytest
import torch

from rewind.engine.model.model import GPT
from rewind.engine.posttrain.generation import (
    Request,
    requests_for,
    sample_completions,
    sample_requests,
    uniform,
)
from rewind.engine.posttrain.sampling import SamplingError, generate
from rewind.states.config import ArchitectureSection

ARCH = ArchitectureSection(block_size=32, vocab_size=48, num_layers=2, num_heads=2, d_model=16)
PROMPT_A, PROMPT_B, PROMPT_C = [3, 14, 15, 9, 2, 6], [5, 35], [8, 9, 7, 9, 3, 2, 3, 8, 4]
SETTINGS = {"max_new_tokens": 10, "temperature": 1.0, "seed": 7, "stage": 2, "step": 11}


def tiny_model(scale: float = 1.0, **arch) -> GPT:
    model = GPT(msgspec.structs.replace(ARCH, **arch), seed=5)
    with torch.no_grad():
        model.head.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_model(dropout=0.2).train()  # in training mode with dropout: sampling must turn it off


def tokens_of(completions) -> list[list[int]]:
    return [c.tokens for c in completions]


def test_a_completion_does_not_depend_on_its_batch(model):
    together = sample_completions(model, [PROMPT_A, PROMPT_B], samples_per_prompt=3, **SETTINGS)
    alone = sample_completions(model, [PROMPT_B], samples_per_prompt=3, prompt_ids=[1], **SETTINGS)
    assert [(c.prompt_id, c.sample_index) for c in together] == [(i, g) for i in (0, 1) for g in range(3)]
    assert tokens_of(together[3:]) == tokens_of(alone)
    for a, b in zip(together[3:], alone, strict=True):
        assert a.log_probs == pytest.approx(b.log_probs, abs=1e-5)
    # Each sample index alone (its own batch of one) is what it was among G = 3.
    for g in range(3):
        (single,) = sample_requests(model, [Request(tuple(PROMPT_A), 0, g)], **SETTINGS)
        assert single.tokens == together[g].tokens
    # The samples of a group differ, and so do other keys' draws.
    assert len({tuple(t) for t in tokens_of(together[:3])}) == 3
    other_step = sample_completions(
        model, [PROMPT_A, PROMPT_B], samples_per_prompt=3, **(SETTINGS | {"step": 12})
    )
    assert tokens_of(other_step) != tokens_of(together)
    assert model.training  # put back as it was


def test_the_draws_are_named_by_their_key():
    """Each draw is the uniform of stream (seed, "rollout", stage, step, prompt id, sample index, position)."""
    from rewind.engine.model.rng import torch_generator

    expected = torch.rand((), dtype=torch.float64, generator=torch_generator(7, "rollout", 2, 11, "q", 3, 4))
    assert uniform((7, 2, 11, "q", 3), 4) == float(expected)
    assert uniform((7, 2, 11, "q", 3), 4) != uniform((7, 2, 11, "q", 3), 5)


def test_greedy_is_rewind_samples_greedy_token_for_token():
    model = tiny_model(scale=20.0).eval()  # peaked logits: no near-ties for rounding to break
    prompts = [PROMPT_A, PROMPT_B, PROMPT_C]
    settings = SETTINGS | {"temperature": 0.0, "max_new_tokens": 20}
    greedy = sample_completions(model, prompts, samples_per_prompt=2, **settings)
    for c in greedy:
        prompt = prompts[c.prompt_id]
        expected = generate(model, prompt, max_new_tokens=20, temperature=0.0, top_p=1.0, seed=0)
        assert c.tokens == expected and c.finish_reason == "length"
    assert len({tuple(c.tokens) for c in greedy}) == 3  # the prompts' continuations differ


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_log_probs_are_the_full_forwards_at_the_sampling_temperature(model, temperature):
    settings = SETTINGS | {"temperature": temperature}
    completions = sample_completions(model, [PROMPT_A, PROMPT_C], samples_per_prompt=2, **settings)
    model.eval()
    try:
        for c in completions:
            prompt = [PROMPT_A, PROMPT_C][c.prompt_id]
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c.tokens[:-1]]))[0, len(prompt) - 1 :]
            scale = temperature or 1.0  # greedy: the log-prob at T = 1
            expected = torch.log_softmax(logits / scale, dim=-1).gather(1, torch.tensor(c.tokens)[:, None])[
                :, 0
            ]
            assert c.log_probs == pytest.approx(expected.tolist(), abs=1e-5)
            assert all(p <= 0 for p in c.log_probs)
    finally:
        model.train()


def test_sampling_follows_the_distribution():
    """Over many draws of one position, the tokens' frequencies are the softmax's (T = 0.5 sharpens it)."""
    model = tiny_model(scale=30.0).eval()
    prompt, temperature, draws = [1, 2, 3], 0.5, 600
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt]))[0, -1] / temperature, dim=-1)
    settings = SETTINGS | {"temperature": temperature, "max_new_tokens": 1}
    firsts = [c.tokens[0] for c in sample_completions(model, [prompt], samples_per_prompt=draws, **settings)]
    counts = torch.bincount(torch.tensor(firsts), minlength=ARCH.vocab_size).double()
    likely = probs > 0.05
    assert likely.sum() >= 2  # a distribution worth checking, not one certain token
    # Each likely token's frequency within 4 standard deviations of its probability.
    spread = (probs * (1 - probs) / draws).sqrt() * 4
    assert ((counts / draws - probs).abs()[likely] <= spread[likely]).all()
    assert counts[probs < 1e-6].sum() == 0


def test_eos_ends_a_row_and_is_kept_with_its_log_prob():
    model = tiny_model(scale=20.0).eval()
    free = sample_completions(
        model, [PROMPT_A, PROMPT_C], samples_per_prompt=1, **(SETTINGS | {"temperature": 0.0})
    )
    eos = free[0].tokens[3]  # a token greedy produces at completion position 3 of prompt 0
    first = free[0].tokens.index(eos)
    ended = sample_completions(
        model, [PROMPT_A, PROMPT_C], samples_per_prompt=1, eos_id=eos, **(SETTINGS | {"temperature": 0.0})
    )
    assert ended[0].finish_reason == "eos" and ended[0].tokens == free[0].tokens[: first + 1]
    assert ended[0].log_probs == pytest.approx(free[0].log_probs[: first + 1], abs=1e-5)
    other = ended[1]  # the row still generating after the first left the batch continues as it would
    if eos in free[1].tokens:
        assert (
            other.finish_reason == "eos" and other.tokens == free[1].tokens[: free[1].tokens.index(eos) + 1]
        )
    else:
        assert other.finish_reason == "length" and other.tokens == free[1].tokens
    assert len(other.tokens) == len(other.log_probs)


def test_a_temperature_too_small_for_float32_is_refused():
    model = tiny_model(scale=20.0).eval()
    with pytest.raises(SamplingError, match="temperature 1e-300: logits / temperature leave float32's range"):
        sample_completions(model, [PROMPT_A], samples_per_prompt=1, **(SETTINGS | {"temperature": 1e-300}))


def test_no_tokens_asked_gives_empty_completions(model):
    (c,) = sample_completions(model, [PROMPT_A], samples_per_prompt=1, **(SETTINGS | {"max_new_tokens": 0}))
    assert (c.tokens, c.log_probs, c.finish_reason) == ([], [], "length")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"prompts": [PROMPT_A, []]}, "prompt 1 is empty"),
        ({"prompts": [[3, 99]]}, "token id 99 is outside the vocabulary"),
        ({"max_new_tokens": 27}, "prompt 0 of 6 tokens \\+ max_new_tokens 27 exceeds block_size 32"),
        ({"temperature": -1.0}, "temperature must be"),
        ({"samples_per_prompt": 0}, "samples_per_prompt must be >= 1"),
        ({"prompt_ids": [0, 1]}, "2 prompt ids for 1 prompts"),
    ],
)
def test_bad_requests_are_refused_in_one_line(model, change, message):
    arguments = {"prompts": [PROMPT_A], "samples_per_prompt": 2, **SETTINGS, **change}
    with pytest.raises(SamplingError, match=message):
        sample_completions(model, **arguments)


def test_a_masked_objective_cannot_sample():
    model = tiny_model()
    model.causal = False
    with pytest.raises(SamplingError, match="masked objective"):
        sample_completions(model, [PROMPT_A], samples_per_prompt=1, **SETTINGS)


def test_requests_are_prompt_by_prompt_with_their_ids():
    requests = requests_for([[1], [2, 3]], 2, ["x", "y"])
    assert requests == [
        Request((1,), "x", 0),
        Request((1,), "x", 1),
        Request((2, 3), "y", 0),
        Request((2, 3), "y", 1),
    ]
