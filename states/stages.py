"""A stage of the curriculum and what it trains with: one record per stage kind.

A stage's strategy is its type. `Stage` holds what every stage has (budget, mixture, KL weight, what
entering it does, its fade); each kind (`PretrainStage`, `SftStage`, `DpoStage`, `GrpoStage`,
`DistillStage`) adds its own settings table and nothing else, so a pretrain stage cannot hold dpo
settings: there is nowhere to write them. The record is a tagged union on `strategy`, so a config and a
logged one read as they always did (`strategy = "grpo"` beside a `[stages.grpo]` table; no `strategy`:
"pretrain", `rewind.states.config_reading`). The rules of each kind: `rewind.states.stagekinds`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from rewind.states.structs import Struct

DpoLoss = Literal["sigmoid", "robust", "ipo", "hinge"]
GrpoLossType = Literal["grpo", "bnpo", "dapo", "dr_grpo"]
KlEstimator = Literal["k1", "k2", "k3"]
ScaleRewards = Literal["group", "batch", "none"]


class Sampling(Struct):
    name: str  # a built-in dataset (grammar, reverse, sort, add) or one of the config's [data.NAME]
    rate: float = 1.0  # its share of the stage's rows (a stage's rates sum to 1)


class SftSettings(Struct):
    """How an `sft` stage trains (`[stages.sft]`): on prompt/response examples, the loss on the response
    and the end of text that closes it."""

    # Several examples to a window, each attending to itself alone with its positions from 0, so a window
    # trains as its examples would one to a row (the loss: token sum over token count either way).
    packing: bool = False


class DpoSettings(Struct):
    """How a `dpo` stage trains (`[stages.dpo]`): on prompt/chosen/rejected examples against the run's KL
    reference (the stage, or one before it, refreshes it), the loss `rewind.engine.posttrain.dpo_losses` defines."""

    beta: float = 0.1  # the implicit reward's scale: beta * (log pi - log ref), summed over the response
    loss: DpoLoss = "sigmoid"  # sigmoid (DPO), robust (unbiased robust DPO), ipo (length-normalised), hinge
    label_smoothing: float = 0.0  # sigmoid / robust: the share of pairs taken to be mislabelled, in [0, 0.5)
    sft_weight: float = 0.0  # > 0: plus this times the chosen responses' NLL (token mean over the step)


class RewardSpec(Struct):
    """One reward function of a grpo stage and its weight in the completion's reward (the weighted sum
    of the functions that score it)."""

    # "exact_match" (1 when the completion's first line is the row's answer) or your own, "module:function"
    # (rewind.engine.posttrain.rewards: its signature, and its code's identity on record)
    function: str = "exact_match"
    weight: float = 1.0  # its weight in the completion's reward


class GrpoSettings(Struct):
    """How a `grpo` stage trains (`[stages.grpo]`): a rollout batch of batch_size / group_size prompts,
    group_size completions each, sampled by the policy and kept on record, then num_iterations updates on
    it (one a step), the loss `rewind.engine.posttrain.grpo_losses` defines. See docs/posttraining.md."""

    group_size: int = 4  # completions per prompt (G); training.batch_size is prompts x G
    temperature: float = 1.0  # sampling temperature (the log-probs are taken at it too)
    max_new_tokens: int = 16  # a completion's limit (the prompt is left-truncated to leave room for it)
    num_iterations: int = 1  # updates per rollout batch (> 1: the PPO clip acts from the second)
    loss_type: GrpoLossType = "dapo"  # how token losses are normalised (over the whole step in every case)
    epsilon_low: float = 0.2  # the ratio's clip: [1 - epsilon_low, 1 + epsilon_high]
    epsilon_high: float = 0.2  # the ratio's upper clip (above)
    kl_beta: float = 0.0  # > 0: a KL penalty to the reference (refreshed at this stage or before)
    kl_estimator: KlEstimator = "k3"  # the per-token KL estimate kl_beta weighs (importance-weighted)
    scale_rewards: ScaleRewards = "group"  # divide the advantage by the group's std, the batch's, or not
    mask_truncated_completions: bool = False  # completions cut at max_new_tokens train on nothing
    # Its reward functions ([[stages.grpo.rewards]]): a completion's reward is the weighted sum of those
    # that score it.
    rewards: list[RewardSpec] = msgspec.field(default_factory=lambda: [RewardSpec()])


class DistillSettings(Struct):
    """How a `distill` stage trains (`[stages.distill]`): on-policy distillation. The student (the run's
    model) samples group_size completions of each prompt, kept on record like a grpo stage's rollouts;
    then num_iterations updates on them, each the per-token reverse KL(student || teacher) over the
    vocabulary at every completion token (token mean over the step). See docs/posttraining.md."""

    # "reference": the run's KL reference (the weights a stage at or before this one refreshed it to: a
    # teacher made by an earlier stage of the same run); else a directory holding a model.safetensors of
    # the run's architecture (`rewind export`), its sha256 on record with each rollout batch.
    teacher: str = "reference"
    group_size: int = 1  # completions per prompt; training.batch_size is prompts x group_size
    temperature: float = 1.0  # the student's sampling temperature (the KL is of the untempered models)
    max_new_tokens: int = 16  # a completion's limit (the prompt is left-truncated to leave room for it)
    num_iterations: int = 1  # updates per rollout batch (> 1: off-policy from the second)


class Stage(Struct, tag_field="strategy"):
    """One stage of the curriculum (`[[stages]]`): its token budget and data mixture, the KL beta it
    trains with, what happens on entering it, and the fade into the next one. `beta` and `overlap`
    left out (None) are not the same config as 0.0 given (the flat lists they come from hash apart);
    loading gives every stage a value once any stage gives one (`rewind.states.stageform`). Never built
    itself: a stage is one of its kinds below (`strategy` names it)."""

    name: str = ""  # its name in tables and plots; [[growth]] at_stage may give it instead of the index
    # Its budget (positive): steps x training.batch_size x architecture.block_size tokens, the padding
    # included, so a post-training stage's counts its rows (examples, pairs, completions) x block_size.
    tokens: int = 0
    datasets: list[Sampling] = []  # its mixture, as [{ name = "sort", rate = 1.0 }, ...] (rates sum to 1)
    # Its KL weight; not set in any stage: no KL (not set beside others: 0.0). 0 or left out in a dpo, grpo
    # or distill stage: their own settings tie them to the reference (dpo.beta, grpo.kl_beta, the teacher).
    beta: float | None = None
    refresh_reference: bool = False  # entering it makes the current weights the KL reference
    reset_optimizer: bool = False  # entering it clears the Adam moments (an OptimizerReset event)
    overlap: float | None = None  # its fade into the next stage (not the last); not set: training.fade's
    # Its steps train at lr_scale x the LR schedule's value (post-training takes smaller steps than
    # pretraining); a step's primary stage decides.
    lr_scale: float = 1.0
    # The name of its settings table, "" for none (the kind's own field of that name holds it).
    settings_table: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if type(self) is Stage:  # its tag would be no strategy at all
            raise TypeError("a stage is one of its kinds (PretrainStage, SftStage, ...), not a bare Stage")

    @property
    def strategy(self) -> str:
        """How it trains: pretrain, sft, dpo, grpo or distill (its record's tag, for people and tables)."""
        return type(self).__struct_config__.tag

    @property
    def settings(self) -> Struct | None:
        """Its settings table (`[stages.<strategy>]`), None for a kind without one."""
        return getattr(self, self.settings_table) if self.settings_table else None


class PretrainStage(Stage, tag="pretrain"):
    """`strategy = "pretrain"` (or none given): the objective's loss on any dataset's rows."""


class SftStage(Stage, tag="sft"):
    """`strategy = "sft"`: prompt/response examples, the loss on the response."""

    sft: SftSettings = SftSettings()  # strategy "sft": its settings ([stages.sft]; not set: the defaults)
    settings_table: ClassVar[str] = "sft"


class DpoStage(Stage, tag="dpo"):
    """`strategy = "dpo"`: prompt/chosen/rejected examples against the KL reference."""

    dpo: DpoSettings = DpoSettings()  # strategy "dpo": its settings ([stages.dpo]; not set: the defaults)
    settings_table: ClassVar[str] = "dpo"


class GrpoStage(Stage, tag="grpo"):
    """`strategy = "grpo"`: rollouts sampled by the policy, scored by reward functions, kept on record."""

    grpo: GrpoSettings = GrpoSettings()  # strategy "grpo": its settings ([stages.grpo]; not set: the defaults)
    settings_table: ClassVar[str] = "grpo"


class DistillStage(Stage, tag="distill"):
    """`strategy = "distill"`: rollouts sampled by the student, each token scored by a teacher."""

    distill: DistillSettings = DistillSettings()  # strategy "distill": its settings ([stages.distill]; not set: the defaults)
    settings_table: ClassVar[str] = "distill"


AnyStage = PretrainStage | SftStage | DpoStage | GrpoStage | DistillStage
# Every kind by its `strategy` tag, in the order the docs list them.
STAGE_KINDS: dict[str, type[Stage]] = {
    kind.__struct_config__.tag: kind for kind in (PretrainStage, SftStage, DpoStage, GrpoStage, DistillStage)
}
