"""What the rollout kinds (grpo, distill) share: a window's batch sampled by the policy, the slicing of
its rows into each rank's micro-batches, and per-token log-probs of its rows through the one forward the
updates compute with.

Before the first step of each window (rewind.states.plan.rollouts_due) the stage reads
training.batch_size / group_size prompts at its datasets' cursors (each dataset its share, through the
keyed permutation), left-truncated to leave max_new_tokens in the context, and samples group_size
completions of each with the batched sampler (rewind.engine.posttrain.generation: every draw keyed by
seed, stage, step, prompt id "<dataset>:<row>", sample index and position, so a resumed run that
samples this window again draws the same tokens). What a kind adds (grpo: rewards and advantages;
distill: the teacher's log-probs) goes into the same content-addressed file (rewind.stores.rollouts),
written before the RolloutsRecorded that names it (`kept`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from rewind.engine.data.example_batches import prompt_tokens
from rewind.engine.data.example_sources import mixture_rows
from rewind.engine.model.layout import evaluating
from rewind.engine.model.placement import placement_for
from rewind.engine.model.ranks import gathered_rows, is_writer
from rewind.engine.posttrain.generation import Completion, sample_completions
from rewind.engine.posttrain.response_logprobs import token_logprobs
from rewind.engine.step.step import compute_precision, micro_batches
from rewind.states.config import Config
from rewind.states.state import State
from rewind.stores.rollouts import rollout_name, write_rollouts

if TYPE_CHECKING:
    from rewind.engine.step.live import Parts


@dataclass(frozen=True)
class Sampled:
    """A window's prompts and completions: `tensors` in the rollout file's format (rewind.stores.rollouts:
    the prompts' and completions' tensors), the cursors after the prompts, and what a kind scores with."""

    tensors: dict[str, torch.Tensor]
    cursors: dict[str, int]
    names: list[str]  # each prompt's dataset
    prompt_rows: list  # each prompt's example (its text, its fields)
    completions: list[Completion]
    num_prompts: int


def sample_window(
    parts: Parts, state: State, stage_index: int, *, group: int, max_new_tokens: int, temperature: float
) -> Sampled:
    """The prompts at the cursors and `group` completions of each, sampled by the policy (module doc)."""
    config, examples = parts.config, parts.datasets.examples
    stage = config.stages[stage_index]
    read, cursors = mixture_rows(config.run.seed, stage, config.training.batch_size // group, state.cursors, examples, "prompt")
    sources, rows, prompt_rows = (list(column) for column in zip(*read, strict=True))
    prompts = prompt_tokens(prompt_rows, config.architecture.block_size - max_new_tokens)
    names = [stage.datasets[s].name for s in sources]
    completions = sample_completions(
        parts.model, prompts, samples_per_prompt=group, max_new_tokens=max_new_tokens,
        temperature=temperature, seed=config.run.seed, stage=stage_index, step=state.step,
        prompt_ids=[f"{name}:{row}" for name, row in zip(names, rows, strict=True)], eos_id=examples.end_id,
    )  # fmt: skip
    width = max_new_tokens
    tensors = {
        "prompt_sources": torch.tensor(sources, dtype=torch.int64),
        "prompt_rows": torch.tensor(rows, dtype=torch.int64),
        "prompts": padded(prompts, max(map(len, prompts)), 0, torch.int64),
        "prompt_lengths": torch.tensor([len(p) for p in prompts], dtype=torch.int64),
        "completions": padded([c.tokens for c in completions], width, 0, torch.int64),
        "completion_lengths": torch.tensor([len(c.tokens) for c in completions], dtype=torch.int64),
        "finished": torch.tensor([c.finish_reason == "eos" for c in completions], dtype=torch.int8),
        "sample_logprobs": padded([c.log_probs for c in completions], width, 0.0, torch.float32),
    }
    return Sampled(tensors, cursors, names, prompt_rows, completions, len(prompts))


def kept(parts: Parts, tensors: dict[str, torch.Tensor], metadata: dict[str, str], keep: bool) -> tuple[str, str]:
    """(path, sha256) of the batch's file: written by rank 0 when `keep` (every rank sampled the same batch;
    the others, and a replay comparing with the record, name it by its content alone)."""
    if keep and is_writer():
        return write_rollouts(parts.run_dir, tensors, metadata)
    return rollout_name(tensors, metadata)


def rank_slices(num_rows: int, config: Config) -> list[list[slice]]:
    """Each rank's micro-batches of a batch of `num_rows` rows (one rank in one process): the slicing the
    updates compute in, and the old log-probs too, so a window's first update sees its own bits."""
    placement = placement_for(config)
    share = num_rows // placement.world_size
    per_rank = micro_batches(share, config.training.per_device_batch_size)
    return [[slice(rank * share + s.start, rank * share + s.stop) for s in per_rank] for rank in range(placement.world_size)]


def slice_logprobs(
    model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, rows: slice, config: Config,
    temperature: float,
) -> torch.Tensor:
    """The per-token log-probs of one micro-batch's masked targets: the one forward the old log-probs (at
    sampling) and the updates both read, so a window's first update sees the old ones' very bits."""
    with compute_precision(config, inputs.device):
        logits = model(inputs[rows])
    return token_logprobs(logits, targets[rows], mask[rows], temperature)


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


def padded(rows: list, width: int, fill, dtype: torch.dtype) -> torch.Tensor:
    """`rows` of unequal lengths as one (len(rows), width) tensor, `fill` past each row's end."""
    out = torch.full((len(rows), width), fill, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out
