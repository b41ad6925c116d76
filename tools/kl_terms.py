"""What ties each stage to the KL reference, and at what weight: one answer for every display of it.

A `pretrain` or `sft` stage adds `beta` x the token-level KL to the reference (optimization.kl.kind) to its
loss. A `grpo` stage's loss carries its own KL penalty, `grpo.kl_beta` x the estimate `grpo.kl_estimator`;
a `dpo` stage has none added: its loss itself compares the policy with the reference, at the scale
`dpo.beta`. The token-level `beta` of a dpo or grpo stage must be 0 (rewind.states.stagekinds), so a
step record's `beta` says nothing there; `rewind schedule`, `rewind log` and `rewind timeline --plot` show
the setting this module names instead.
"""

from __future__ import annotations

from rewind.states.config import Stage
from rewind.states.stagekinds import rules_of
from rewind.states.stagekinds.rules import KlTerm, StageRules


def kl_term(stage: Stage) -> KlTerm:
    """What ties the stage to the reference, and at what weight (its kind's rules say)."""
    return rules_of(stage).reference_tie(stage)


def has_own_kl(stage: Stage) -> bool:
    """Whether the stage's tie to the reference is a setting of its strategy (dpo, grpo), not `beta`."""
    return kl_term(stage).setting != "beta"


def kl_kinds(stages: list[Stage], kind: str) -> str:
    """What the KL terms of these stages are, as `rewind schedule`'s KL line heads them: 'beta: token_kl'
    (optimization.kl.kind, which beta weighs), 'grpo.kl_estimator: k3' where only grpo stages add a KL term
    (the kind does not apply to them), both where both do; the kind alone where no stage adds one."""
    terms = [kl_term(stage) for stage in stages]
    said = [f"beta: {kind}"] if any(t.setting == "beta" and t.penalty > 0 for t in terms) else []
    grpo = [s for s, t in zip(stages, terms, strict=True) if t.setting == "grpo.kl_beta" and t.penalty > 0]
    if estimators := [stage.grpo.kl_estimator for stage in grpo]:
        said.append(f"grpo.kl_estimator: {', '.join(dict.fromkeys(estimators))}")
    return "; ".join(said) or f"beta: {kind}"


class RunKl:
    """The KL terms of a run's stages together, as the timeline's panels draw them."""

    def __init__(self, stages: list[Stage]):
        self.terms = [kl_term(stage) for stage in stages]
        self.penalties = [term.penalty for term in self.terms]
        self.own = [term.setting != "beta" for term in self.terms]  # dpo or grpo: their beta is 0 by rule
        self.dpo = [term.setting == "dpo.beta" for term in self.terms]
        self.grpo = [term.setting == "grpo.kl_beta" for term in self.terms]
        self.labels = [rules_of(stage).loss_label(stage) for stage in stages]

    @property
    def has_penalty(self) -> bool:
        return any(weight > 0 for weight in self.penalties)

    def weight_name(self) -> str:
        return "KL weight: beta, grpo.kl_beta" if any(self.grpo) else "KL weight beta"

    def loss_meaning(self) -> str:
        """What a step's recorded loss is in these stages, for the loss panels' label: its stage's own (its
        kind's `loss_label`), each said once in stage order. A pretrain or sft stage's is the cross-entropy
        without the beta x KL it trains with (drawn apart); a dpo stage's the DPO loss (its sft term left
        out); a grpo stage's the clipped policy loss with its kl_beta x KL term in (it can be negative); a
        distill stage's the reverse KL to its teacher."""
        said = list(dict.fromkeys(self.labels))
        if said == [StageRules().loss_label(None)]:
            return "cross-entropy, without KL"
        return f"each stage's own:\n{', '.join(said)}"

    def no_penalty_text(self) -> str:
        """For a run without a KL penalty, precisely: which settings are 0, and that a dpo stage's loss
        ties it to the reference without one."""
        zero = "every beta and grpo.kl_beta is 0" if any(self.grpo) else "every beta is 0"
        dpo = "; a dpo stage's loss is its tie to the reference (dpo.beta)" if any(self.dpo) else ""
        return f"no KL penalty in this run ({zero}){dpo}"
