"""A grpo stage's rollout batch as its updates read it: from the file the state's RolloutsRecorded names
(checked against its sha256 by rewind.stores.rollouts), once per window, turned into training rows.

The file keeps what was sampled in the completions' own coordinates (rewind.stores.rollouts: completion
n's tokens and per-token values in row n, its first completion_lengths[n]); the updates compute on
training rows, prompt + completion (rewind.engine.data.example_batches.completion_batch), whose completion mask
covers exactly those tokens in the same order. `on_rows` and `off_rows` move per-token values between
the two, exactly (a copy, no arithmetic), so old log-probs computed on training rows and kept in the file
come back bit for bit.

A file's hash only says it is the one its record names; `rollout_problems` says it is a batch a run could
have written, by the rules the sampler follows (rewind.engine.posttrain.grpo_rollouts): its shape the record's and
the stage's, every token id within the vocabulary, every row within the context, finish flags that agree
with the end token and max_new_tokens, finite rewards (NaN: unscored), advantages and the record's mean
reward / unscored count exactly what `reward_outcome`, the sampler's own computation, makes of the
rewards. A resume checks it before it records anything, `rewind verify` reports it. The sampling,
old-policy and reference log-probs cannot be checked without the models' forwards: the record vouches for
them through the file's sha256 (a log edited consistently is the record; these checks refuse what no run
could have written).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rewind.engine.data.example_batches import completion_batch
from rewind.engine.posttrain.grpo_losses import (
    group_advantages,
    mask_truncated,
    reward_figures,
    weighted_rewards,
)
from rewind.states.config import Config, GrpoSettings
from rewind.states.events import RolloutsRecorded, RunStarted
from rewind.states.features import Features
from rewind.states.stages import GrpoStage
from rewind.states.state import State
from rewind.stores.rollouts import RolloutError, read_rollouts


@dataclass(frozen=True)
class TrainingRows:
    """tokens (N, block + 1); mask (N, block) over the completion tokens the loss counts; the per-token
    tensors laid on the mask (0 elsewhere); advantages (N,); rewards (F, N)."""

    tokens: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    reference_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    rewards: torch.Tensor


def completions_of(tensors: dict[str, torch.Tensor]) -> tuple[list[list[int]], list[list[int]]]:
    """(each completion's prompt, each completion): the token lists of a rollout batch's rows."""
    group = tensors["completions"].shape[0] // tensors["prompts"].shape[0]
    prompts = [row[:n].tolist() for row, n in zip(tensors["prompts"], tensors["prompt_lengths"], strict=True)]
    completions = [
        row[:n].tolist() for row, n in zip(tensors["completions"], tensors["completion_lengths"], strict=True)
    ]
    return [prompts[i // group] for i in range(len(completions))], completions


def training_rows(
    tensors: dict[str, torch.Tensor], *, end_id: int, pad_id: int, block_size: int, drop_truncated: bool
) -> TrainingRows:
    """The updates' rows of a rollout batch (its old and reference log-probs when it has them)."""
    prompts, completions = completions_of(tensors)
    batch = completion_batch(prompts, completions, end_id, pad_id, block_size)
    mask = mask_truncated(batch.completion_mask, batch.truncated) if drop_truncated else batch.completion_mask
    lengths = tensors["completion_lengths"]

    def laid(name: str) -> torch.Tensor | None:
        values = tensors.get(name)
        return None if values is None else on_rows(values, lengths, batch.completion_mask).masked_fill(~mask, 0.0)

    return TrainingRows(
        batch.tokens, mask, laid("old_logprobs"), laid("reference_logprobs"), tensors["advantages"], tensors["rewards"]
    )


def on_rows(values: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N, Lc) per-completion-token values -> (N, block) on the training rows' completion positions."""
    out = torch.zeros(mask.shape, dtype=values.dtype)
    within = torch.arange(values.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    out[mask] = values[within]
    return out


def off_rows(values: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
    """(N, block) values on the completion positions -> (N, width) in the completions' coordinates."""
    out = torch.zeros((mask.shape[0], width), dtype=values.dtype)
    lengths = mask.sum(dim=1)
    within = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    out[within] = values[mask]
    return out


def reward_outcome(
    scores: torch.Tensor, settings: GrpoSettings, *, scored_figures: bool = True
) -> tuple[torch.Tensor, float, int]:
    """(advantages (N,) float32, mean reward, unscored) of a batch's (F, N) per-function rewards under the
    stage's weights and scale_rewards: what the sampler records, and what a reader recomputes bit for bit.
    `scored_figures`: the run's feature of that name (False: the figures of a run started before it)."""
    rewards = weighted_rewards(scores, [r.weight for r in settings.rewards])
    mean_reward, unscored = reward_figures(rewards, scored_figures=scored_figures)
    grouped = rewards.view(-1, settings.group_size)
    return group_advantages(grouped, scale_rewards=settings.scale_rewards).reshape(-1).float(), mean_reward, unscored


def rollout_problems(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str],
    record: RolloutsRecorded,
    config: Config,
    end_id: int | None,
    *,
    scored_figures: bool = True,
) -> list[str]:
    """Every rule of the module doc the batch (tensors and metadata as rewind.stores.rollouts read them,
    its format already checked) breaks, given its record and the config in force when it was recorded
    ([] if none). `end_id`: the run's end token (None: the rules about it are not checked).
    `scored_figures`: the run's feature of that name (its record's figures are reward_outcome's under it)."""
    stages = config.stages
    if not 0 <= record.stage < len(stages) or not isinstance(stages[record.stage], GrpoStage):
        return [f"its record names stage {record.stage}, not a grpo stage of the run's config"]
    settings = stages[record.stage].grpo
    names = ",".join(r.function for r in settings.rewards)
    problems = shape_problems(tensors, metadata, record, config, settings.group_size, settings.max_new_tokens, names)
    if ("reference_logprobs" in tensors) != (settings.kl_beta > 0):
        problems.append(
            "it holds reference_logprobs, but the stage has no KL reference" if settings.kl_beta <= 0
            else "no reference_logprobs, but the stage has a KL reference"
        )
    if problems:
        return problems  # the rules below read the batch as the stage shapes it
    problems += content_problems(tensors, config, settings.max_new_tokens, end_id)
    scores = tensors["rewards"]
    if bool(torch.isinf(scores).any()):
        problems.append("rewards hold an infinite value (a reward is a finite number, or NaN where unscored)")
        return problems
    advantages, mean_reward, unscored = reward_outcome(scores, settings, scored_figures=scored_figures)
    stored = tensors["advantages"]
    if not torch.equal(advantages.view(torch.int32), stored.view(torch.int32)):
        differ = advantages != stored
        n = int(torch.nonzero(differ if bool(differ.any()) else advantages.view(torch.int32) != stored.view(torch.int32))[0])
        problems.append(
            f"its advantages do not follow from the rewards (scale_rewards = {settings.scale_rewards!r}, the "
            f"stage's weights): completion {n} holds {float(stored[n])!r}, its rewards give {float(advantages[n])!r}"
        )
    if unscored != record.unscored or not same_float(mean_reward, record.mean_reward):
        problems.append(
            f"its record's mean_reward {record.mean_reward!r} ({record.unscored} unscored) is not its rewards' "
            f"{mean_reward!r} ({unscored} unscored)"
        )
    return problems


def shape_problems(
    tensors: dict[str, torch.Tensor], metadata: dict[str, str], record: RolloutsRecorded, config: Config,
    group_size: int, max_new_tokens: int, row_names: str,
) -> list[str]:
    """What any rollout stage's batch must hold as its record and its stage shape it: its prompts and
    group, the rows of its rewards (`row_names`: its metadata's reward_functions), the weights that sampled
    it, its completions' width."""
    prompts, completions = tensors["prompts"], tensors["completions"]
    num_prompts, group = prompts.shape[0], completions.shape[0] // prompts.shape[0]
    problems = []
    if (num_prompts, group) != (record.num_prompts, record.group_size):
        problems.append(
            f"it holds {num_prompts} prompts x {group} completions, but its record says "
            f"{record.num_prompts} x {record.group_size}"
        )
    if (num_prompts, group) != (config.training.batch_size // group_size, group_size):
        problems.append(
            f"it holds {num_prompts} prompts x {group} completions, not the stage's "
            f"{config.training.batch_size // group_size} x {group_size}"
        )
    if metadata["reward_functions"] != row_names:
        problems.append(f"its reward functions {metadata['reward_functions']!r} are not the stage's {row_names!r}")
    if metadata["policy_step"] != str(record.step):
        problems.append(f"sampled by the weights of step {metadata['policy_step']}, not of its record's {record.step}")
    if completions.shape[1] != max_new_tokens:
        problems.append(f"completions are {completions.shape[1]} wide, not max_new_tokens = {max_new_tokens}")
    return problems


def content_problems(
    tensors: dict[str, torch.Tensor], config: Config, max_new_tokens: int, end_id: int | None
) -> list[str]:
    """What any rollout batch's tokens must be: prompts that leave the completions room, ids within the
    vocabulary, completions that end as the sampler ends them (`end_id` None: not checked)."""
    arch, problems = config.architecture, []
    room = arch.block_size - max_new_tokens
    longest = int(tensors["prompt_lengths"].max())
    if longest > room or int(tensors["prompt_lengths"].min()) < 1:
        problems.append(
            f"a prompt holds {longest} tokens, more than block_size - max_new_tokens = {room}" if longest > room
            else "a prompt holds no token"
        )
    for name, lengths in (("prompts", "prompt_lengths"), ("completions", "completion_lengths")):
        ids = tensors[name][torch.arange(tensors[name].shape[1]) < tensors[lengths].unsqueeze(1)]
        if ids.numel() and int(ids.max()) >= arch.vocab_size:
            problems.append(f"{name} hold token id {int(ids.max())}, outside the vocabulary ({arch.vocab_size} ids)")
    if end_id is not None:
        problems += finish_problems(tensors, max_new_tokens, end_id)
    return problems


def batch_problem(
    run_dir: str, record: RolloutsRecorded, config: Config, end_id: int | None, features: Features | None = None
) -> str:
    """Why the rollout file `record` names is not a batch a run writes ("" if it is): missing, damaged or
    not in the format (rewind.stores.rollouts), or a rule of `rollout_problems` broken. `end_id`: the
    run's end token (None: `run_end_id`); `features`: the run's behaviours (None: `run_behaviours`)."""
    try:
        tensors, metadata = read_rollouts(run_dir, record.path, record.sha256)
    except RolloutError as exc:
        return str(exc)
    end = run_end_id(run_dir) if end_id is None else end_id
    scored = (run_behaviours(run_dir) if features is None else features).scored_reward_figures
    if problems := rollout_problems(tensors, metadata, record, config, end, scored_figures=scored):
        return f"{record.path}: not a batch a run writes: {first_problem(problems)}"
    return ""


def run_end_id(run_dir: str) -> int | None:
    """The end token of the run's tokenizer (what its completions end with); None when it does not load."""
    from rewind.engine.data.examples import end_token
    from rewind.engine.data.tokenizer import TokenizerError, load_run_tokenizer

    try:
        return end_token(load_run_tokenizer(run_dir))
    except (TokenizerError, OSError):
        return None


def run_behaviours(run_dir: str) -> Features:
    """The behaviours the run's first record (RunStarted) was started with (none where it has none)."""
    from rewind.stores.runs import iter_records

    first = next((event for _, event in iter_records(run_dir, limit=1)), None)
    return first.behaviours if isinstance(first, RunStarted) else Features()


def finish_problems(tensors: dict[str, torch.Tensor], max_new_tokens: int, end_id: int) -> list[str]:
    """A completion ends at its first end token (finished 1) or at max_new_tokens without one (finished 0)."""
    completions, lengths, finished = tensors["completions"], tensors["completion_lengths"], tensors["finished"]
    positions = torch.arange(completions.shape[1]).unsqueeze(0)
    ends = (completions == end_id) & (positions < lengths.unsqueeze(1))
    last = (positions == (lengths - 1).clamp(min=0).unsqueeze(1)) & (lengths > 0).unsqueeze(1)
    checks = (
        ((ends & ~last).any(dim=1), "goes on after its end token"),
        ((finished == 1) & ~(ends & last).any(dim=1), "is marked finished but does not end with the end token"),
        ((finished == 0) & (lengths != max_new_tokens), f"is cut before max_new_tokens = {max_new_tokens} without an end token"),
        ((finished == 0) & ends.any(dim=1), "ends with the end token but is marked cut at max_new_tokens"),
    )  # fmt: skip
    return [f"completion {int(torch.nonzero(broken)[0])} {what}" for broken, what in checks if bool(broken.any())]


def first_problem(problems: list[str]) -> str:
    return problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


def same_float(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)  # NaN is the same NaN


class RolloutReader:
    """The training rows of the rollout batch the state names, read once per window (a live object like
    the trunk reader: built from what the state records, never written to)."""

    def __init__(self) -> None:
        self._held: tuple[str, TrainingRows] | None = None

    def rows(self, run_dir: str, state: State, config: Config, **layout) -> TrainingRows:
        """`layout`: training_rows' keywords (the run's end and pad ids, block size, drop_truncated). The
        batch is checked first (`rollout_problems`): RolloutError, one line with the way forward."""
        record = state.rollouts
        if record is None:  # the plan samples before any step of a window: unreachable in a run
            raise RuntimeError(f"step {state.step} of a grpo stage has no rollout batch on record")
        if self._held is None or self._held[0] != record.sha256:
            tensors, metadata = read_rollouts(run_dir, record.path, record.sha256)
            scored = state.behaviours.scored_reward_figures
            if problems := rollout_problems(tensors, metadata, record, config, layout["end_id"], scored_figures=scored):
                raise RolloutError(
                    f"{run_dir}: {record.path}: not a batch a run writes: {first_problem(problems)}; nothing trains on "
                    f"it: go on in a fork from before its window, `rewind fork {run_dir} --at-step {record.step} NEW_RUN`"
                )
            self._held = (record.sha256, training_rows(tensors, **layout))
        return self._held[1]
