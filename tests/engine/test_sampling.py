"""Generation (rewind.engine.posttrain.sampling): greedy is the argmax chain, sampling is a function of the seed
only, the nucleus keeps what it should, eos stops, and the context is cropped to block_size."""

from __future__ import annotations

import pytest
import torch

from rewind.engine.model.model import GPT
from rewind.engine.posttrain.sampling import SamplingError, generate, nucleus
from rewind.states.config import ArchitectureSection

BLOCK_SIZE = 16
PROMPT = [72, 101, 108, 108, 111]  # "Hello"


def tiny_model(**arch) -> GPT:
    settings = {"block_size": BLOCK_SIZE, "vocab_size": 256, "num_layers": 2, "num_heads": 2, "d_model": 32}
    model = GPT(ArchitectureSection(**(settings | arch)), seed=5)
    with torch.no_grad():  # larger logits than the init's: a peaked distribution, so greedy has no near-ties
        model.head.weight.mul_(20.0)
    return model


@pytest.fixture(scope="module")
def model() -> GPT:
    return tiny_model()


def sample(model, prompt=PROMPT, **settings) -> list[int]:
    defaults = {"max_new_tokens": 12, "temperature": 1.0, "top_p": 1.0, "seed": 0}
    return generate(model, prompt, **(defaults | settings))


def argmax_chain(model: GPT, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(torch.argmax(model(torch.tensor([ids[-BLOCK_SIZE:]]))[0, -1])))
    return ids[len(prompt) :]


def test_the_same_seed_gives_the_same_tokens_and_other_seeds_others(model):
    first = sample(model, seed=1)
    assert len(first) == 12 and all(0 <= t < 256 for t in first)
    assert sample(model, seed=1) == first
    others = [sample(model, seed=s) for s in (2, 3, 4)]
    assert all(o != first for o in others)


def test_sampling_never_reads_or_moves_the_global_rng(model):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first = sample(model, seed=9)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(456)  # another global state: the same draw
    assert sample(model, seed=9) == first


def test_greedy_is_the_argmax_chain(model):
    greedy = sample(model, temperature=0.0, seed=0)
    assert greedy == argmax_chain(model, PROMPT, 12)
    assert sample(model, temperature=0.0, seed=7) == greedy  # the seed plays no part


def test_a_tiny_top_p_is_greedy(model):
    assert sample(model, temperature=1.0, top_p=1e-9, seed=3) == sample(model, temperature=0.0)
    assert sample(model, temperature=2.0, top_p=1e-9, seed=4) == sample(model, temperature=0.0)


def test_a_low_temperature_is_greedy(model):
    assert sample(model, temperature=1e-4, seed=11) == sample(model, temperature=0.0)


def test_nucleus_keeps_the_smallest_set_that_reaches_top_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    kept = nucleus(probs, 0.75)  # 0.5, then 0.3 (0.5 < 0.75 before it); 0.15 comes after 0.8
    assert torch.allclose(kept, torch.tensor([0.0, 0.625, 0.0, 0.375]))
    assert torch.equal(nucleus(probs, 1.0), probs)
    assert torch.equal(nucleus(probs, 0.01), torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # Ties go to the lower id, as torch.argmax's do.
    assert torch.equal(nucleus(torch.tensor([0.4, 0.4, 0.2]), 0.1), torch.tensor([1.0, 0.0, 0.0]))


def test_generation_stops_before_eos(model):
    greedy = sample(model, temperature=0.0)
    eos = greedy[4]
    stopped = sample(model, temperature=0.0, eos_id=eos)
    assert stopped == greedy[: greedy.index(eos)] and eos not in stopped
    sampled = sample(model, seed=5)
    assert sample(model, seed=5, eos_id=sampled[2]) == sampled[: sampled.index(sampled[2])]


def test_the_context_is_cropped_to_block_size(model):
    long_prompt = [(7 * i + 3) % 256 for i in range(BLOCK_SIZE + 9)]
    greedy = sample(model, prompt=long_prompt, temperature=0.0, max_new_tokens=BLOCK_SIZE)
    assert greedy == argmax_chain(model, long_prompt, BLOCK_SIZE)
    # Only the last block_size tokens count: the model never sees the rest.
    assert greedy == sample(model, prompt=long_prompt[-BLOCK_SIZE:], temperature=0.0, max_new_tokens=BLOCK_SIZE)
    # A prompt shorter than the block runs past it.
    assert len(sample(model, prompt=PROMPT, max_new_tokens=BLOCK_SIZE)) == BLOCK_SIZE


def test_at_most_the_models_context_is_drawn(model, monkeypatch):
    forward, calls = GPT.forward, []

    def counted(self, *args, **kwargs):  # (before the bound, this request ran for days)
        calls.append(1)
        assert len(calls) <= BLOCK_SIZE, "generation ran past the model's context"
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT, "forward", counted)
    with pytest.raises(SamplingError, match=f"max_new_tokens 1000000000: at most the model's context, {BLOCK_SIZE}"):
        sample(model, max_new_tokens=10**9)
    assert calls == []


@pytest.mark.parametrize("settings", [{"temperature": 1e-300}, {"temperature": 1e-46}, {"top_p": 1e-300}])
def test_settings_below_float32s_range_are_greedy(model, settings):
    """1e-300 is 0 in float32: logits / T were infinite and the nucleus empty, so torch.multinomial
    met NaN. Now the temperature's limit (the most likely tokens, evenly) and the top token are drawn."""
    assert sample(model, seed=3, **settings) == sample(model, temperature=0.0)


def test_the_limit_of_a_tiny_temperature_shares_tied_maxima_evenly():
    from rewind.engine.posttrain.sampling import next_token

    logits = torch.tensor([1.0, 3.0, 3.0, -2.0])
    drawn = {next_token(logits, temperature=1e-300, top_p=1.0, seed=0, position=p) for p in range(64)}
    assert drawn == {1, 2}


def test_logits_that_are_not_finite_are_one_line():
    from rewind.engine.posttrain.sampling import NonFiniteLogits, next_token

    for value in (float("nan"), float("inf")):
        with pytest.raises(NonFiniteLogits, match="logits at position 7 are not finite"):
            next_token(torch.tensor([0.0, value]), temperature=1.0, top_p=0.9, seed=0, position=7)


def test_the_model_is_left_in_the_mode_it_was_in(model):
    model.train()
    sample(model, max_new_tokens=2)
    assert model.training
    model.eval()
    sample(model, max_new_tokens=2)
    assert not model.training


def test_no_tokens_asked_gives_none(model):
    assert sample(model, max_new_tokens=0) == []


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"temperature": -1.0}, "temperature must be"),
        ({"temperature": float("nan")}, "temperature must be"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"max_new_tokens": -1}, "max_new_tokens must be"),
        ({"prompt": []}, "the prompt is empty"),
        ({"prompt": [300]}, "outside the model's vocabulary"),
    ],
)
def test_bad_requests_are_one_line(model, settings, message):
    with pytest.raises(SamplingError, match=message) as raised:
        sample(model, **settings)
    assert "\n" not in str(raised.value)


def test_a_masked_model_cannot_sample():
    model = tiny_model()
    model.causal = False  # what rewind.engine.model.layout.build_plain sets for mlm / diffusion
    with pytest.raises(SamplingError, match="masked objective"):
        sample(model)


def test_greedy_equals_transformers_greedy_generate_on_the_exported_model():
    transformers = pytest.importorskip("transformers")
    hf_llama = pytest.importorskip("rewind.engine.model.hf_llama")
    model = tiny_model(norm="rmsnorm", mlp="swiglu")
    model.eval()
    config = transformers.LlamaConfig(**hf_llama.llama_config(model.arch, num_layers=2))
    with torch.random.fork_rng(devices=[]):  # transformers initialises from the global RNG
        llama = transformers.LlamaForCausalLM(config).eval()
    llama.load_state_dict(hf_llama.to_llama(model.state_dict()), strict=True)
    num_new = BLOCK_SIZE - len(PROMPT)  # transformers does not crop: stay within the trained context
    with torch.no_grad():
        out = llama.generate(
            torch.tensor([PROMPT]), do_sample=False, max_new_tokens=num_new, min_new_tokens=num_new
        )
    assert sample(model, temperature=0.0, max_new_tokens=num_new) == out[0, len(PROMPT) :].tolist()
