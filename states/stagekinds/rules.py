"""What every stage kind's rules have in common: the interface `rewind.states.stagekinds` asks, and the
checks several kinds share (the data they read, float32 ranges, stages that are never mixed).

A kind's rules are pure functions of the config and its stage record: what it must hold, what it reads,
whether a rollout batch is due before its steps and what shapes one, and what ties it to the KL
reference. The engine's half of a kind (how it reads rows, steps, samples) is `rewind.engine.step.kinds`.
"""

from __future__ import annotations

from typing import NamedTuple

from rewind.states.config import BUILTIN_DATASETS, Config
from rewind.states.stages import Stage

# Built-in datasets that are prompt/answer examples (grammar is running text).
BUILTIN_EXAMPLES: tuple[str, ...] = tuple(name for name in BUILTIN_DATASETS if name != "grammar")
# float32's largest and smallest normal numbers: the losses and the sampler compute in float32, where a
# setting past the first is infinite (a first step's 0 times it is NaN; the clip bound 1 + epsilon_high
# cannot even be made) and a positive one below the second rounds to 0 or loses its precision.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
# A sampling temperature divides float32 logits, and its log-probs, the importance ratio exp(logp -
# old_logp) and k3's exp(-d) move 1/T times as fast as the logits: float32's exp overflows past 88.7, a
# logit change of 0.89 at T = 0.01 between a rollout and an update. Below this (vLLM's floor too) the
# sampling is argmax in all but name while one ordinary update can overflow the loss.
MIN_TEMPERATURE = 0.01


class KlTerm(NamedTuple):
    """A stage's tie to the reference: the setting that weighs it (as the config spells it), its value,
    and the weight of the KL penalty it adds to the loss (0 for none: a stage whose loss is the tie, or
    a weight of 0)."""

    setting: str  # "beta", "grpo.kl_beta", "dpo.beta" or "distill.teacher"
    value: float
    penalty: float

    def is_loss(self) -> bool:
        """Whether the stage's loss itself compares the policy with the reference (dpo, distill)."""
        return self.setting in LOSS_TIES

    def text(self) -> str:
        """'beta 0.2', 'grpo.kl_beta 0.02', 'dpo.beta 0.1 (its loss; no KL penalty added)'."""
        said = f"{self.setting} {self.value:g}"
        return f"{said} (its loss; no KL penalty added)" if self.is_loss() else said


# The settings by which a stage's loss itself is its tie to the reference.
LOSS_TIES = ("dpo.beta", "distill.teacher")


class StageRules:
    """A stage kind's rules; the defaults are a stage that trains on any dataset's rows (pretrain)."""

    # What its datasets must give: "" any rows, else "examples" (prompt/response), "preferences"
    # (prompt/chosen/rejected) or "prompts" (prompts with answers): `gives`.
    reads: str = ""
    # Whether its rows may be mixed with a neighbour's across a fade (a dpo step's rows are pairs, a
    # rollout stage's its window's batch: never mixed).
    mixes: bool = True

    def problems(self, config: Config, stage: Stage, i: int) -> list[str]:
        """What its settings and its place in the run must satisfy beyond their types."""
        return []

    def packs_documents(self, stage: Stage) -> bool:
        """Whether its rows are not whole rows of a token stream (an activation cache of a frozen trunk
        holds those alone)."""
        return not self.mixes

    def rollout_window(self, stage: Stage) -> int:
        """The steps a rollout batch serves (a batch is due before the first step of each window, counted
        from the stage's entry); 0 for a stage that samples none."""
        return 0

    def rollout_shaping(self, config: Config, stage: Stage) -> dict:
        """What shapes its rollout batches besides its datasets and the batch and context sizes (a change
        of it mid-window samples the window's batch again)."""
        return {}

    def reference_tie(self, stage: Stage) -> KlTerm:
        """What ties it to the KL reference: its token-level `beta`."""
        beta = stage.beta or 0.0
        return KlTerm("beta", beta, beta)

    def loss_label(self, stage: Stage) -> str:
        """What a step's recorded loss is, for the loss panels' label."""
        return "cross-entropy (no KL)"


def gives(config: Config, name: str, what: str) -> bool:
    """Whether dataset `name` is what a kind that reads `what` trains on: a task (but grammar), or a user
    dataset with the field that makes it so."""
    if not what:
        return True
    if name in config.data:
        source = config.data[name]
        field = {"examples": source.response_field, "preferences": source.chosen_field, "prompts": source.answer_field}
        return bool(field[what])
    return name in BUILTIN_EXAMPLES


def a_kind(strategy: str) -> str:
    return f"an {strategy}" if strategy == "sft" else f"a {strategy}"


def float32_problems(path: str, value: float, tiny: bool = True) -> list[str]:
    """A scale the stage multiplies float32 tensors by: within float32's range, and (`tiny`) a positive
    one not rounded to 0 or below float32's normal numbers (the sign rules are the caller's)."""
    if value > FLOAT32_MAX:
        return [f"{path}: must be at most 3.4e38 (the stage computes with it in float32), got {value}"]
    if tiny and 0 < value < FLOAT32_TINY:
        return [
            f"{path}: must not lie in (0, 1.2e-38), below float32's normal numbers (the stage computes with it "
            f"in float32), got {value}"
        ]
    return []


def unmixed_problems(config: Config, stage: Stage, i: int, needs_reference: bool, tie: str) -> list[str]:
    """A stage never mixed: no fade into or out of it, no token-level KL (`tie` says what ties it to the
    reference instead), a reference refreshed at it or before when it uses one."""
    at, kind, problems = f"stages[{i}]", stage.strategy, []
    if needs_reference and not any(s.refresh_reference for s in config.stages[: i + 1]):
        problems.append(
            f"{at}.refresh_reference: a {kind} stage compares the policy with the KL reference; refresh it on "
            "entering this stage (or an earlier one)"
        )
    if stage.beta:
        problems.append(f"{at}.beta: a {kind} stage's {tie}; its token-level KL beta must be 0")
    fades = [(i - 1, "into")] if i > 0 else []
    fades += [(i, "out of")] if i < config.num_stages - 1 else []
    for boundary, way in fades:
        if config.fade_overlap(boundary) > 0:
            problems.append(
                f"stages[{boundary}].overlap: no fade {way} a {kind} stage (its rows are its own), got "
                f"{config.fade_overlap(boundary):g}; set overlap = 0 on stages[{boundary}]"
            )
    return problems


def window_problems(config: Config, at: str, settings, least: int, why: str = "") -> list[str]:
    """A rollout stage's window (`settings`: its group_size, temperature, max_new_tokens, num_iterations):
    whole groups of at least `least` completions (`why` says why), a usable temperature, a completion that
    leaves the prompt room, at least one update on each batch."""
    problems, group = [], settings.group_size
    if group < least:
        problems.append(f"{at}.group_size: at least {least}{f' ({why})' if why else ''}, got {group}")
    elif config.training.batch_size % group:
        problems.append(
            f"{at}.group_size: training.batch_size {config.training.batch_size} (completions a step) is not a "
            f"multiple of group_size {group}"
        )
    problems += _sampling_problems(config, at, settings.temperature, settings.max_new_tokens)
    if settings.num_iterations < 1:
        problems.append(f"{at}.num_iterations: must be >= 1, got {settings.num_iterations}")
    return problems


def _sampling_problems(config: Config, at: str, temperature: float, max_new_tokens: int) -> list[str]:
    """A rollout stage's sampling: a usable temperature, and a completion that leaves the prompt room."""
    problems, block = [], config.architecture.block_size
    if not temperature > 0:
        problems.append(f"{at}.temperature: must be positive (the log-probs are the sampled distribution's), got {temperature}")
    elif temperature < MIN_TEMPERATURE:
        problems.append(
            f"{at}.temperature: must be at least {MIN_TEMPERATURE} (the log-probs and the importance ratio move 1/T "
            f"times as fast as the float32 logits), got {temperature}"
        )
    if not 1 <= max_new_tokens < block:
        problems.append(
            f"{at}.max_new_tokens: must be in [1, block_size - 1 = {block - 1}] (the prompt needs a token), got {max_new_tokens}"
        )
    return problems
