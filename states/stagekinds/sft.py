"""The sft stage kind: prompt/response examples, the loss on the response; mixed across fades like
pretraining rows (each stage's share read its own way)."""

from __future__ import annotations

from rewind.states.stagekinds.rules import StageRules
from rewind.states.stages import SftStage


class SftRules(StageRules):
    reads = "examples"

    def packs_documents(self, stage: SftStage) -> bool:
        return stage.sft.packing  # a packed window's examples attend each to itself


RULES = SftRules()
