"""What a boundary evaluation of a post-training run records beside its task scores
(Evaluated.posttraining): for each evaluated dataset with prompts and answers, on its held-out prompts,

- `pass@1`: the share answered exactly right by the greedy completion;
- `pass@G`, `reward`: over G completions sampled at temperature T, the share of prompts with one right,
  and the mean exact-match reward;
- `win_rate`: against the reference the run holds at the boundary (the stage's: the boundary is
  evaluated before the next stage refreshes it), greedy on both sides, (wins + ties / 2) / prompts;
- after a dpo stage, `dpo_accuracy` and `dpo_margin`: the stage's implicit rewards (its beta, against
  that reference) on held-out preference pairs, the figures its steps record on their training pairs.

G, T and the new-token limit are the run's first grpo stage's (GrpoSettings' defaults when it has none),
the same at every boundary, and every draw is keyed by (seed, "rollout", "eval", 0, row, sample,
position) (docs/sampling.md), so each boundary answers the same questions with the same randomness and the rows compare. A run with
only pretrain stages records none of this. The prompts are the first training.eval_samples validation
rows, never trained on; the judge is rewind.engine.data.examples.exact_match_reward, as a grpo stage's.
"""

from __future__ import annotations

from statistics import fmean
from typing import TYPE_CHECKING

import torch

from rewind.engine.data.example_batches import preference_batch
from rewind.engine.data.example_sources import ExampleSources
from rewind.engine.data.examples import POSTTRAIN_TASKS
from rewind.engine.model.layout import evaluating
from rewind.engine.model.placement import placement_for
from rewind.engine.posttrain.dpo_losses import dpo_loss
from rewind.engine.posttrain.posttrain_eval import completion_rewards, greedy_correct, win_share
from rewind.engine.posttrain.response_logprobs import sequence_logprobs
from rewind.engine.step.evaluation import evaluation_tasks, rows_per_forward
from rewind.engine.step.step import compute_precision
from rewind.states.config import Config, DistillSettings, GrpoSettings, Stage
from rewind.states.stagekinds import rules_of

if TYPE_CHECKING:
    from rewind.engine.step.live import Parts

Figures = dict[str, dict[str, float]]  # dataset -> figure name -> value


def sampling_settings(config: Config) -> GrpoSettings | DistillSettings | None:
    """The G, T and new-token limit the figures are measured with; None for a run without post-training."""
    if not any(rules_of(stage).reads for stage in config.stages):
        return None
    # the first stage that samples (grpo, distill: each settings table has G, T and the new-token limit)
    return next((s.settings for s in config.stages if rules_of(s).rollout_window(s)), GrpoSettings())


def boundary_figures(parts: Parts, boundary: int) -> Figures:
    """The figures (module doc) at the end of stage `boundary` (-1: before training); {} for a run
    without post-training stages."""
    config = parts.config
    settings = sampling_settings(config)
    if settings is None:
        return {}
    stage = config.stages[boundary] if boundary >= 0 else None
    figures: Figures = {}
    for name in _answered(config, "prompts"):
        figures[name] = _sampled(parts, name, settings)
    if stage is not None and rules_of(stage).reads == "preferences" and parts.reference is not None:
        for name in _answered(config, "preferences"):
            figures.setdefault(name, {}).update(_preferences(parts, name, stage))
    return figures


def _answered(config: Config, reads: str) -> list[str]:
    """The evaluated datasets whose examples a stage that `reads` them can read (rewind.states.stagekinds:
    "prompts", "preferences"): the embedded tasks with answers, and the user's datasets such a stage
    reads (their fields are the ones it names)."""
    used = {d.name for s in config.stages if rules_of(s).reads == reads for d in s.datasets}
    return [n for n in evaluation_tasks(config) if n in used or (n in POSTTRAIN_TASKS and n not in config.data)]


def _rows(examples: ExampleSources, name: str, kind: str, count: int) -> list:
    source = examples.rows_of(name, kind)  # type: ignore[arg-type]
    return [source.row("validation", i) for i in range(min(count, source.num_rows("validation")))]


def _sampled(parts: Parts, name: str, settings: GrpoSettings) -> dict[str, float]:
    config, examples = parts.config, parts.datasets.examples
    rows = _rows(examples, name, "prompt", config.training.eval_samples)
    if not rows:
        return {}
    limit = min(settings.max_new_tokens, config.architecture.block_size // 2)
    completing = {  # what every completion is sampled up to and judged against
        "answers": [examples.answer(name, row) for row in rows], "max_new_tokens": limit,
        "end_id": examples.end_id, "decode": parts.datasets.home.tokenizer.decode,
    }  # fmt: skip

    mine = greedy_correct(parts.model, rows, **completing)
    group = settings.group_size
    sampled = completion_rewards(
        parts.model, rows, samples=group, temperature=settings.temperature, seed=config.run.seed, **completing
    )
    figures = {
        "pass@1": fmean(mine),
        f"pass@{group}": fmean([max(r) == 1.0 for r in sampled]),
        "reward": fmean([x for r in sampled for x in r]),
    }
    if parts.reference is not None:
        figures["win_rate"] = win_share(mine, greedy_correct(parts.reference, rows, **completing))
    return figures


@torch.inference_mode()
def _preferences(parts: Parts, name: str, stage: Stage) -> dict[str, float]:
    """The dpo stage's implicit-reward accuracy (chosen strictly above rejected) and mean margin."""
    config, examples = parts.config, parts.datasets.examples
    rows = _rows(examples, name, "preference", config.training.eval_samples)
    if not rows:
        return {}
    batch = preference_batch(rows, config.architecture.block_size, examples.end_id, examples.pad_id)
    device = placement_for(config).device
    inputs, targets = batch.tokens[:, :-1].to(device), batch.tokens[:, 1:].to(device)
    mask = batch.loss_mask.to(device)
    chunk = rows_per_forward(config)
    logps = []
    for model in (parts.model, parts.reference):
        with evaluating(model), compute_precision(config, device):
            chunks = [
                sequence_logprobs(model(inputs[i : i + chunk]), targets[i : i + chunk], mask[i : i + chunk])
                for i in range(0, inputs.shape[0], chunk)
            ]
        logps.append(torch.cat(chunks))
    (policy, reference), n = logps, len(rows)
    out = dpo_loss(policy[:n], policy[n:], reference[:n], reference[n:], beta=stage.dpo.beta)
    margins = (out.chosen_rewards - out.rejected_rewards).tolist()
    return {"dpo_accuracy": fmean([m > 0 for m in margins]), "dpo_margin": fmean(margins)}
