"""What ties each stage to the KL reference, and at what weight: one answer for every display of it.

A `pretrain` or `sft` stage adds `beta` x the token-level KL to the reference (optimization.kl.kind) to its
loss. A `grpo` stage's loss carries its own KL penalty, `grpo.kl_beta` x the estimate `grpo.kl_estimator`;
a `dpo` stage has none added: its loss itself compares the policy with the reference, at the scale
`dpo.beta`. The token-level `beta` of a dpo or grpo stage must be 0 (rewind.states.check_strategy), so a
step record's `beta` says nothing there; `rewind schedule`, `rewind log` and `rewind timeline --plot` show
the setting this module names instead.
"""

from __future__ import annotations

from typing import NamedTuple

from rewind.states.config import Stage


class KlTerm(NamedTuple):
    """A stage's tie to the reference: the setting that weighs it (as the config spells it), its value,
    and the weight of the KL penalty it adds to the loss (0 for none: a dpo stage, or a weight of 0)."""

    setting: str  # "beta", "grpo.kl_beta" or "dpo.beta"
    value: float
    penalty: float

    def text(self) -> str:
        """'beta 0.2', 'grpo.kl_beta 0.02', 'dpo.beta 0.1 (its loss; no KL penalty added)'."""
        said = f"{self.setting} {self.value:g}"
        return f"{said} (its loss; no KL penalty added)" if self.setting == "dpo.beta" else said


def kl_term(stage: Stage) -> KlTerm:
    if stage.strategy == "grpo":
        weight = stage.grpo_settings.kl_beta
        return KlTerm("grpo.kl_beta", weight, weight)
    if stage.strategy == "dpo":
        return KlTerm("dpo.beta", stage.dpo_settings.beta, 0.0)
    beta = stage.beta or 0.0
    return KlTerm("beta", beta, beta)


def has_own_kl(stage: Stage) -> bool:
    """Whether the stage's tie to the reference is a setting of its strategy (dpo, grpo), not `beta`."""
    return kl_term(stage).setting != "beta"


class RunKl:
    """The KL terms of a run's stages together, as the timeline's panels draw them."""

    def __init__(self, stages: list[Stage]):
        self.terms = [kl_term(stage) for stage in stages]
        self.penalties = [term.penalty for term in self.terms]
        self.own = [term.setting != "beta" for term in self.terms]  # dpo or grpo: their beta is 0 by rule
        self.dpo = [term.setting == "dpo.beta" for term in self.terms]
        self.grpo = [term.setting == "grpo.kl_beta" for term in self.terms]

    @property
    def has_penalty(self) -> bool:
        return any(weight > 0 for weight in self.penalties)

    def weight_name(self) -> str:
        return "KL weight: beta, grpo.kl_beta" if any(self.grpo) else "KL weight beta"

    def no_penalty_text(self) -> str:
        """For a run without a KL penalty, precisely: which settings are 0, and that a dpo stage's loss
        ties it to the reference without one."""
        zero = "every beta and grpo.kl_beta is 0" if any(self.grpo) else "every beta is 0"
        dpo = "; a dpo stage's loss is its tie to the reference (dpo.beta)" if any(self.dpo) else ""
        return f"no KL penalty in this run ({zero}){dpo}"
