"""A grpo stage's rollout batch: sampled by the policy, scored, kept on record before any step uses it.

Before the first step of each window of `num_iterations` steps (rewind.states.plan.rollouts_due), the
stage reads training.batch_size / group_size prompts at its datasets' cursors (each dataset its share,
through the keyed permutation), left-truncated to leave max_new_tokens in the context, and samples
group_size completions of each with the batched sampler (rewind.engine.posttrain.generation: every draw keyed by
seed, stage, step, prompt id "<dataset>:<row>", sample index and position, so a resumed run that
samples this window again draws the same tokens). Each completion is scored by the stage's reward
functions (rewind.engine.posttrain.rewards: on its text without the end token; their code's identity goes on the
record; the record's mean_reward is over the completions some function scored, `unscored` counts the
others: rewind.engine.posttrain.grpo_losses.reward_figures; a run started before the feature scored_reward_figures
records the mean with the unscored as 0, and no count), the weighted rewards become advantages within their
group (rewind.engine.posttrain.grpo_losses.group_advantages), and the training rows (prompt + completion) get
their old-policy log-probs now, through the forward and micro-batches the updates use, without dropout
(so the first update's ratio is exactly 1), and the reference's when the stage has a KL term.

Everything the updates need is written to one content-addressed file (rewind.stores.rollouts) before
RolloutsRecorded names it: a resume inside the window reads it back and samples nothing.
"""

from __future__ import annotations

import torch

from rewind.engine.data.example_batches import prompt_tokens
from rewind.engine.data.example_sources import mixture_rows
from rewind.engine.model.layout import evaluating
from rewind.engine.model.placement import placement_for
from rewind.engine.model.ranks import gathered_rows, is_writer
from rewind.engine.posttrain.generation import sample_completions
from rewind.engine.posttrain.grpo_step import rank_slices, slice_logprobs
from rewind.engine.posttrain.rewards import reward_identities, score_groups
from rewind.engine.posttrain.rolloutreader import off_rows, reward_outcome, training_rows
from rewind.engine.run.parts import Parts
from rewind.states.config import Config
from rewind.states.events import RolloutsRecorded
from rewind.states.plan import rollout_settings
from rewind.states.state import State
from rewind.stores.rollouts import rollout_name, write_rollouts


def sample_rollouts(parts: Parts, state: State, stage_index: int, *, keep: bool = True) -> RolloutsRecorded:
    """Sample, score and keep the rollout batch of the window starting at state.step (module doc), and
    return its record. `keep` False: nothing is written (`rewind replay` compares the record it would
    make with the logged one: the file is named by its content)."""
    config, examples = parts.config, parts.datasets.examples
    stage = config.stages[stage_index]
    settings = stage.grpo_settings
    group = settings.group_size
    read, cursors = mixture_rows(config.run.seed, stage, config.training.batch_size // group, state.cursors, examples, "prompt")
    sources, rows, prompt_rows = (list(column) for column in zip(*read, strict=True))
    prompts = prompt_tokens(prompt_rows, config.architecture.block_size - settings.max_new_tokens)
    names = [stage.datasets[s].name for s in sources]
    completions = sample_completions(
        parts.model, prompts, samples_per_prompt=group, max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature, seed=config.run.seed, stage=stage_index, step=state.step,
        prompt_ids=[f"{name}:{row}" for name, row in zip(names, rows, strict=True)], eos_id=examples.end_id,
    )  # fmt: skip
    home, functions = parts.datasets.home, [r.function for r in settings.rewards]
    answers = [examples.answer(name, row) for name, row in zip(names, prompt_rows, strict=True)]
    ids = [[t for t in c.tokens if t != examples.end_id] for c in completions]
    texts = [row.text for row in prompt_rows]
    scores = score_groups(functions, texts, answers, ids, home.tokenizer.decode, home.base_dir)
    # what a reader checks, the same way (a run started before scored_reward_figures: the figures it always had)
    scored = state.behaviours.scored_reward_figures
    advantages, mean_reward, unscored = reward_outcome(scores, settings, scored_figures=scored)
    width = settings.max_new_tokens
    tensors = {
        "prompt_sources": torch.tensor(sources, dtype=torch.int64),
        "prompt_rows": torch.tensor(rows, dtype=torch.int64),
        "prompts": _padded(prompts, max(map(len, prompts)), 0, torch.int64),
        "prompt_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
        "completions": _padded([c.tokens for c in completions], width, 0, torch.int64),
        "completion_lengths": torch.tensor([len(c.tokens) for c in completions], dtype=torch.int64),
        "finished": torch.tensor([c.finish_reason == "eos" for c in completions], dtype=torch.int8),
        "sample_logprobs": _padded([c.log_probs for c in completions], width, 0.0, torch.float32),
        "rewards": scores,
        "advantages": advantages,
    }
    # The old policy's log-probs (and the reference's) on the rows the updates compute on, kept in the
    # completions' coordinates.
    train = training_rows(
        tensors, end_id=examples.end_id, pad_id=examples.pad_id, block_size=config.architecture.block_size,
        drop_truncated=settings.mask_truncated_completions,
    )  # fmt: skip
    models = {"old_logprobs": parts.model}
    if settings.kl_beta > 0:
        assert parts.reference is not None  # the config rule: a refresh at or before the stage
        models["reference_logprobs"] = parts.reference
    for name, model in models.items():
        on_rows = logprobs_of(model, train.tokens, train.mask, config, settings.temperature)
        tensors[name] = off_rows(on_rows, train.mask, width)
    metadata = {
        "reward_functions": ",".join(r.function for r in settings.rewards),
        "group_size": str(group),
        "policy_step": str(state.step),
    }
    # Every rank sampled the same batch; rank 0 keeps it (the others name it by its content alone).
    write = keep and is_writer()
    path, sha256 = write_rollouts(parts.run_dir, tensors, metadata) if write else rollout_name(tensors, metadata)
    return RolloutsRecorded(
        step=state.step, tokens=state.tokens, stage=stage_index, path=path, sha256=sha256,
        num_prompts=len(prompts), group_size=group, cursors=cursors, mean_reward=mean_reward,
        unscored=unscored, reward_code=reward_identities(functions, home.base_dir),
        settings=rollout_settings(config, stage_index),
    )  # fmt: skip


def logprobs_of(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor, config: Config, temperature: float) -> torch.Tensor:
    """(N, block) per-token log-probs of the rows' masked targets, micro-batch by micro-batch as an update
    computes them, without dropout and without a gradient. Under torchrun each rank computes its own share
    (the micro-batches it will train on: every rank runs as many, so the sharded forwards pair up) and the
    shares are gathered, so no rank computes another's rows."""
    device = next(model.parameters()).device
    inputs, targets, mask = tokens[:, :-1].to(device), tokens[:, 1:].to(device), mask.to(device)
    mine = rank_slices(tokens.shape[0], config)[placement_for(config).rank]
    with evaluating(model), torch.no_grad():
        parts = [slice_logprobs(model, inputs, targets, mask, rows, config, temperature) for rows in mine]
    return gathered_rows(torch.cat(parts)).cpu()


def _padded(rows: list, width: int, fill, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out
