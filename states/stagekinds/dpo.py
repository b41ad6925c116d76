"""The dpo stage kind: prompt/chosen/rejected pairs against the KL reference, never mixed."""

from __future__ import annotations

from rewind.states.config import Config
from rewind.states.stagekinds.rules import (
    FLOAT32_TINY,
    KlTerm,
    StageRules,
    float32_problems,
    unmixed_problems,
)
from rewind.states.stages import DpoStage

# The ipo loss is (h - 1 / (2 beta)) ** 2, h = 0 at a stage's first step: finite in float32 from here up.
IPO_MIN_BETA = 2.8e-20


class DpoRules(StageRules):
    reads = "preferences"
    mixes = False

    def problems(self, config: Config, stage: DpoStage, i: int) -> list[str]:
        at, settings = f"stages[{i}]", stage.dpo
        problems = unmixed_problems(config, stage, i, needs_reference=True, tie="loss is its tie to the reference")
        add = problems.append
        if not settings.beta > 0:
            add(f"{at}.dpo.beta: must be positive, got {settings.beta}")
        if not 0.0 <= settings.label_smoothing < 0.5:
            add(f"{at}.dpo.label_smoothing: must be in [0, 0.5), got {settings.label_smoothing}")
        elif settings.label_smoothing and settings.loss in ("ipo", "hinge"):
            add(f"{at}.dpo.label_smoothing: the {settings.loss} loss has no label smoothing (sigmoid or robust do)")
        if settings.sft_weight < 0:
            add(f"{at}.dpo.sft_weight: must be >= 0, got {settings.sft_weight}")
        for name in ("beta", "sft_weight"):
            problems += float32_problems(f"{at}.dpo.{name}", getattr(settings, name))
        if settings.loss == "ipo" and FLOAT32_TINY <= settings.beta < IPO_MIN_BETA:
            add(
                f"{at}.dpo.beta: the ipo loss needs at least {IPO_MIN_BETA} (its target 1 / (2 beta), squared, is a "
                f"float32), got {settings.beta}"
            )
        return problems

    def reference_tie(self, stage: DpoStage) -> KlTerm:
        return KlTerm("dpo.beta", stage.dpo.beta, 0.0)

    def loss_label(self, stage: DpoStage) -> str:
        return "DPO"


RULES = DpoRules()
