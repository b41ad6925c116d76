"""The post-training figures against a straightforward computation: an oracle that always answers right
scores 1.0 everywhere; an oracle right on a known subset of prompts gives pass@1 and win rates counted
from the prompts themselves; a noisy oracle (and a randomly initialised model) give pass@k and the mean
reward a loop over the same sampler, one prompt at a time with the same keys, reproduces; every figure is
a function of its seed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from rewind.engine.data.examples import ANSWER_FIELD, exact_match_reward
from rewind.engine.model.layout import build_model
from rewind.engine.posttrain import posttrain_eval as pe
from rewind.engine.posttrain.generation import sample_completions
from rewind.states.config_reading import loads_config
from tests.conftest import EXAMPLES

NEW = 10  # max_new_tokens: sort's longest answer (8 letters) and its end fit


def _sorted(prompt: str) -> str:
    return "".join(sorted(prompt.removeprefix("sort ").removesuffix("=")))


def _right_when_even(prompt: str) -> str:
    answer = _sorted(prompt)
    return answer if len(answer) % 2 == 0 else answer[::-1] + "x"


class Oracle(nn.Module):
    """Answers a sort prompt with `answer(prompt)` + "\\n": the rows' tokens are kept in the KV cache (as one
    block's keys), each position's logits put `confidence` on the next byte of the answer and 0 on the 26
    letters (-100 elsewhere), so confidence 60 is greedy-and-sampled right, 2 right one letter in ~0.7."""

    causal = True

    def __init__(self, answer=_sorted, confidence: float = 60.0, block_size: int = 32):
        super().__init__()
        self.answer, self.confidence = answer, confidence
        self.arch = SimpleNamespace(block_size=block_size)
        self.head = nn.Identity()
        self.head.out_features = 256
        self.unused = nn.Parameter(torch.zeros(1))  # (the sampler finds the device through a parameter)

    def forward(self, tokens, *, cache, valid=None, head_fn=None):
        batch, width = tokens.shape
        write = cache.writers(0, 1, width)[0]
        stored, _ = write(tokens[:, None, :, None].float(), tokens[:, None, :, None].float())
        context = stored[:, 0, :, 0].long()
        logits = torch.full((batch, width, 256), -100.0)
        logits[:, :, ord("a") : ord("z") + 1] = 0.0
        for b in range(batch):
            for t in range(width):
                text = bytes(context[b, : int(cache.lengths[b]) + t + 1].tolist()).decode("utf-8", "replace")
                prompt, _, written = text.partition("=")
                answer = self.answer(prompt + "=") + "\n"
                logits[b, t, ord(answer[min(len(written), len(answer) - 1)])] = self.confidence
        cache.advance(torch.full_like(cache.lengths, width) if valid is None else valid)
        return logits


ROWS = pe.held_out_rows("sort", 24)


def test_an_oracle_that_is_always_right_scores_one_everywhere():
    oracle = Oracle()
    assert pe.pass_at_1(oracle, ROWS, max_new_tokens=NEW) == 1.0
    assert pe.pass_at_k(oracle, ROWS, k=3, temperature=1.0, seed=5, max_new_tokens=NEW) == 1.0
    assert pe.mean_reward(oracle, ROWS, samples=3, temperature=1.0, seed=5, max_new_tokens=NEW) == 1.0
    assert pe.win_rate(oracle, oracle, ROWS, max_new_tokens=NEW) == 0.5  # all ties


def test_pass_at_1_and_win_rate_count_the_prompts_a_model_gets_right():
    even = [len(_sorted(row.text)) % 2 == 0 for row in ROWS]
    assert 0 < sum(even) < len(ROWS)  # both kinds among the prompts: the figures below can tell them apart
    half = Oracle(_right_when_even)
    assert pe.pass_at_1(half, ROWS, max_new_tokens=NEW) == sum(even) / len(ROWS)
    # the oracle wins where `half` is wrong and ties where both are right; `half` never wins
    assert pe.win_rate(Oracle(), half, ROWS, max_new_tokens=NEW) == (
        len(ROWS) - sum(even) + 0.5 * sum(even)
    ) / len(ROWS)
    assert pe.win_rate(half, Oracle(), ROWS, max_new_tokens=NEW) == 0.5 * sum(even) / len(ROWS)


def _loop_rewards(model, k: int, temperature: float, seed: int) -> list[list[float]]:
    """Each prompt sampled alone with the keys the figures use, judged by hand."""
    out = []
    for row in ROWS:
        completions = sample_completions(
            model, [list(row.prompt)], samples_per_prompt=k, max_new_tokens=NEW, temperature=temperature,
            seed=seed, stage="eval", step=0, prompt_ids=[row.prompt_id], eos_id=10,
        )  # fmt: skip
        texts = [bytes(t for t in c.tokens if t != 10).decode("utf-8", "replace") for c in completions]
        out.append([exact_match_reward(text, row.fields[ANSWER_FIELD]) for text in texts])
    return out


@pytest.mark.parametrize("which", ["noisy oracle", "random model"])
def test_pass_at_k_and_mean_reward_are_those_of_a_loop_over_the_same_sampler(which):
    if which == "noisy oracle":
        model = Oracle(confidence=3.5)
    else:
        model = build_model(loads_config((EXAMPLES / "tiny.toml").read_text()), None)
    k, temperature, seed = 4, 1.0, 11
    rewards = _loop_rewards(model, k, temperature, seed)
    flat = [r for row in rewards for r in row]
    if which == "noisy oracle":
        assert 0 < sum(flat) < len(flat)  # some right, some wrong: a figure that cannot be 0 or 1 by default
        assert any(0 < sum(row) < k for row in rewards)  # a prompt whose samples disagree: pass@k != mean
    assert pe.mean_reward(
        model, ROWS, samples=k, temperature=temperature, seed=seed, max_new_tokens=NEW
    ) == pytest.approx(sum(flat) / len(flat), abs=1e-12)
    assert pe.pass_at_k(
        model, ROWS, k=k, temperature=temperature, seed=seed, max_new_tokens=NEW
    ) == pytest.approx(sum(max(row) for row in rewards) / len(rewards), abs=1e-12)


def test_the_figures_are_keyed_by_their_seed():
    model = Oracle(confidence=3.5)
    figures = [
        pe.mean_reward(model, ROWS, samples=4, temperature=1.0, seed=seed, max_new_tokens=NEW)
        for seed in (1, 1, 2)
    ]
    assert figures[0] == figures[1] != figures[2]
    torch.manual_seed(123)  # the global generator plays no part
    assert pe.mean_reward(model, ROWS, samples=4, temperature=1.0, seed=1, max_new_tokens=NEW) == figures[0]


def test_held_out_rows_are_the_validation_split_and_bad_counts_are_refused():
    assert [row.prompt_id for row in ROWS] == list(range(24))
    assert all(row.text.startswith("sort ") for row in ROWS)
    with pytest.raises(ValueError, match="count"):
        pe.held_out_rows("sort", 0)
    with pytest.raises(ValueError, match="no rows"):
        pe.pass_at_1(Oracle(), [], max_new_tokens=NEW)
