"""Post-training figures of a model on an embedded task's held-out prompts: greedy pass@1, pass@k, the
mean exact-match reward of sampled completions, and the win rate of one model against another.

The prompts are the task's validation split (rewind.engine.data.examples.task_prompt_row), never trained on;
a completion is judged by rewind.engine.data.examples.exact_match_reward on its text without the end token
(`decode`: the run's tokenizer's decode, or UTF-8 bytes when None), as a grpo stage scores its rollouts.
Completions come from the rollout sampler (rewind.engine.posttrain.generation), each draw keyed by (seed, stage
EVAL_STAGE, step 0, prompt id, sample index, position) and never by global RNG state, so every figure is
a function of the model, the prompts and the seed. Prompts are left-truncated to leave max_new_tokens in
the model's context, as a grpo stage does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from torch import nn

from rewind.engine.data.example_batches import prompt_tokens
from rewind.engine.data.examples import ANSWER_FIELD, PromptRow, exact_match_reward, task_prompt_row
from rewind.engine.data.tasks import Encoder, num_task_samples
from rewind.engine.posttrain.generation import Completion, sample_completions

EVAL_STAGE = "eval"  # the stage part of the draws' keys: no training stage (an index) draws these
NEWLINE = 10  # the end token of UTF-8 bytes (rewind.engine.data.examples.end_token)
Decoder = Callable[[Iterable[int]], str]


def held_out_rows(task: str, count: int, encode: Encoder | None = None) -> list[PromptRow]:
    """The first `count` validation prompt rows of `task` ("reverse", "sort", "add")."""
    if not 0 < count <= num_task_samples(task, "validation"):
        raise ValueError(f"{task}: count {count} outside [1, {num_task_samples(task, 'validation')}]")
    return [task_prompt_row(task, "validation", index, encode) for index in range(count)]


def completion_rewards(
    model: nn.Module,
    rows: Sequence[PromptRow],
    *,
    samples: int,
    temperature: float,
    seed: int,
    max_new_tokens: int,
    end_id: int = NEWLINE,
    decode: Decoder | None = None,
    answers: Sequence[str] | None = None,
) -> list[list[float]]:
    """The exact-match reward of each of `samples` completions of each row (row by row, sample index
    0..samples-1) against its answer (`answers`, or each row's "answer" field). temperature 0: greedy
    (the same completion for every sample index)."""
    block_size = model.arch.block_size  # type: ignore[union-attr]
    completions = sample_completions(
        model, prompt_tokens(rows, block_size - max_new_tokens), samples_per_prompt=samples,
        max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, stage=EVAL_STAGE, step=0,
        prompt_ids=[row.prompt_id for row in rows], eos_id=end_id,
    )  # fmt: skip
    if answers is None:
        answers = [row.fields[ANSWER_FIELD] for row in rows]
    if len(answers) != len(rows):
        raise ValueError(f"{len(answers)} answers for {len(rows)} rows")
    pairs = zip(completions, _repeated(answers, samples), strict=True)
    rewards = [_reward(completion, answer, end_id, decode) for completion, answer in pairs]
    return [rewards[n * samples : (n + 1) * samples] for n in range(len(rows))]


def pass_at_1(model: nn.Module, rows: Sequence[PromptRow], *, max_new_tokens: int, end_id: int = NEWLINE,
              decode: Decoder | None = None) -> float:  # fmt: skip
    """The share of rows whose greedy (temperature 0) completion is exactly right."""
    return _mean(greedy_correct(model, rows, max_new_tokens=max_new_tokens, end_id=end_id, decode=decode))


def pass_at_k(model: nn.Module, rows: Sequence[PromptRow], *, k: int, temperature: float, seed: int,
              max_new_tokens: int, end_id: int = NEWLINE, decode: Decoder | None = None) -> float:  # fmt: skip
    """The share of rows of which at least one of k completions sampled at `temperature` is exactly right
    (k samples drawn, any correct: not the unbiased estimator from n > k samples)."""
    rewards = completion_rewards(
        model, rows, samples=k, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens,
        end_id=end_id, decode=decode,
    )  # fmt: skip
    return _mean([max(row) == 1.0 for row in rewards])


def mean_reward(model: nn.Module, rows: Sequence[PromptRow], *, samples: int, temperature: float, seed: int,
                max_new_tokens: int, end_id: int = NEWLINE, decode: Decoder | None = None) -> float:  # fmt: skip
    """The mean exact-match reward over `samples` completions of every row sampled at `temperature`."""
    rewards = completion_rewards(
        model, rows, samples=samples, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens,
        end_id=end_id, decode=decode,
    )  # fmt: skip
    return _mean([r for row in rewards for r in row])


def win_rate(model: nn.Module, reference: nn.Module, rows: Sequence[PromptRow], *, max_new_tokens: int,
             end_id: int = NEWLINE, decode: Decoder | None = None) -> float:  # fmt: skip
    """The win rate (`win_share`) of `model` against `reference`, both answering greedily."""
    mine = greedy_correct(model, rows, max_new_tokens=max_new_tokens, end_id=end_id, decode=decode)
    theirs = greedy_correct(reference, rows, max_new_tokens=max_new_tokens, end_id=end_id, decode=decode)
    return win_share(mine, theirs)


def win_share(mine: Sequence[bool], theirs: Sequence[bool]) -> float:
    """(wins + ties / 2) / rows, as the exact-match judge decided each row: a win is `mine` right and
    `theirs` wrong, a loss the reverse, a tie both right or both wrong. 0.5: no better and no worse;
    1.0: right wherever the other is wrong and never the reverse."""
    return _mean([1.0 if a > b else 0.0 if a < b else 0.5 for a, b in zip(mine, theirs, strict=True)])


def greedy_correct(model: nn.Module, rows: Sequence[PromptRow], *, max_new_tokens: int, end_id: int = NEWLINE,
                   decode: Decoder | None = None, answers: Sequence[str] | None = None) -> list[bool]:  # fmt: skip
    """Whether each row's greedy completion is exactly right."""
    rewards = completion_rewards(
        model, rows, samples=1, temperature=0.0, seed=0, max_new_tokens=max_new_tokens, end_id=end_id,
        decode=decode, answers=answers,
    )  # fmt: skip
    return [row[0] == 1.0 for row in rewards]


def _reward(completion: Completion, answer: str, end_id: int, decode: Decoder | None) -> float:
    tokens = [t for t in completion.tokens if t != end_id]  # (the end token can only come last)
    text = bytes(tokens).decode("utf-8", errors="replace") if decode is None else decode(tokens)
    return exact_match_reward(text, answer)


def _repeated(items: Sequence[str], times: int) -> list[str]:
    return [item for item in items for _ in range(times)]


def _mean(values: Sequence[float | bool]) -> float:
    if not values:
        raise ValueError("no rows to measure")
    return sum(float(v) for v in values) / len(values)
