"""The grpo stage kind: rollouts the policy samples and reward functions score, kept on record before
any step uses them; updates on them for a window of num_iterations steps; never mixed."""

from __future__ import annotations

import re

from rewind.states.config import Config
from rewind.states.config_identity import canonical
from rewind.states.stagekinds.rules import (
    KlTerm,
    StageRules,
    float32_problems,
    unmixed_problems,
    window_problems,
)
from rewind.states.stages import GrpoStage

# The reward functions rewind has (rewind.engine.posttrain.rewards); others are named "module:function".
BUILTIN_REWARDS: tuple[str, ...] = ("exact_match",)
_ENTRY_POINT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*", re.ASCII)


class GrpoRules(StageRules):
    reads = "prompts"
    mixes = False

    def problems(self, config: Config, stage: GrpoStage, i: int) -> list[str]:
        at, settings = f"stages[{i}].grpo", stage.grpo
        tie = "KL to the reference is grpo.kl_beta"
        problems = unmixed_problems(config, stage, i, needs_reference=settings.kl_beta > 0, tie=tie)
        add = problems.append
        problems += window_problems(config, at, settings, 2, "an advantage compares a completion with its group")
        if not 0.0 <= settings.epsilon_low <= 1.0:
            add(f"{at}.epsilon_low: must be in [0, 1], got {settings.epsilon_low}")
        if settings.epsilon_high < 0:
            add(f"{at}.epsilon_high: must be >= 0, got {settings.epsilon_high}")
        problems += float32_problems(f"{at}.epsilon_high", settings.epsilon_high, tiny=False)
        if settings.kl_beta < 0:
            add(f"{at}.kl_beta: must be >= 0, got {settings.kl_beta}")
        problems += float32_problems(f"{at}.kl_beta", settings.kl_beta)
        if not settings.rewards:
            add(f"{at}.rewards: at least one reward function")
        for j, reward in enumerate(settings.rewards):
            if reward.function not in BUILTIN_REWARDS and not _ENTRY_POINT.fullmatch(reward.function):
                add(
                    f"{at}.rewards[{j}].function: {reward.function!r} is neither a built-in reward "
                    f"({', '.join(BUILTIN_REWARDS)}) nor \"module:function\""
                )
            if not reward.weight > 0:
                add(f"{at}.rewards[{j}].weight: must be positive, got {reward.weight}")
            problems += float32_problems(f"{at}.rewards[{j}].weight", reward.weight)
        return problems

    def rollout_window(self, stage: GrpoStage) -> int:
        return stage.grpo.num_iterations

    def rollout_shaping(self, config: Config, stage: GrpoStage) -> dict:
        # How a batch is sampled and scored (and whether reference log-probs are kept); a change of only
        # the updates (their number, loss, clip, KL weight) trains on the batch held.
        grpo = stage.grpo
        return {
            "grpo": [grpo.group_size, grpo.temperature, grpo.max_new_tokens, canonical(grpo.rewards),
                     grpo.scale_rewards, grpo.kl_beta > 0],
        }  # fmt: skip

    def reference_tie(self, stage: GrpoStage) -> KlTerm:
        return KlTerm("grpo.kl_beta", stage.grpo.kl_beta, stage.grpo.kl_beta)

    def loss_label(self, stage: GrpoStage) -> str:
        return "GRPO policy + KL" if stage.grpo.kl_beta > 0 else "GRPO policy"


RULES = GrpoRules()
