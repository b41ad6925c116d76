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

from typing import TYPE_CHECKING

from rewind.engine.posttrain.rewards import reward_identities, score_groups
from rewind.engine.posttrain.rolloutreader import off_rows, reward_outcome, training_rows
from rewind.engine.posttrain.rollouts import kept, logprobs_of, sample_window
from rewind.states.events import RolloutsRecorded
from rewind.states.plan import rollout_settings
from rewind.states.state import State

if TYPE_CHECKING:
    from rewind.engine.step.live import Parts


def sample_rollouts(parts: Parts, state: State, stage_index: int, *, keep: bool = True) -> RolloutsRecorded:
    """Sample, score and keep the rollout batch of the window starting at state.step (module doc), and
    return its record. `keep` False: nothing is written (`rewind replay` compares the record it would
    make with the logged one: the file is named by its content)."""
    config, examples = parts.config, parts.datasets.examples
    settings = config.stages[stage_index].grpo
    group = settings.group_size
    sampled = sample_window(
        parts, state, stage_index, group=group, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature
    )
    home, functions = parts.datasets.home, [r.function for r in settings.rewards]
    answers = [examples.answer(name, row) for name, row in zip(sampled.names, sampled.prompt_rows, strict=True)]
    ids = [[t for t in c.tokens if t != examples.end_id] for c in sampled.completions]
    texts = [row.text for row in sampled.prompt_rows]
    scores = score_groups(functions, texts, answers, ids, home.tokenizer.decode, home.base_dir)
    # what a reader checks, the same way (a run started before scored_reward_figures: the figures it always had)
    scored = state.behaviours.scored_reward_figures
    advantages, mean_reward, unscored = reward_outcome(scores, settings, scored_figures=scored)
    width = settings.max_new_tokens
    tensors = {**sampled.tensors, "rewards": scores, "advantages": advantages}
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
    path, sha256 = kept(parts, tensors, metadata, keep)
    return RolloutsRecorded(
        step=state.step, tokens=state.tokens, stage=stage_index, path=path, sha256=sha256,
        num_prompts=sampled.num_prompts, group_size=group, cursors=sampled.cursors, mean_reward=mean_reward,
        unscored=unscored, reward_code=reward_identities(functions, home.base_dir),
        settings=rollout_settings(config, stage_index),
    )  # fmt: skip
