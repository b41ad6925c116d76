"""The pretrain stage kind: the objective's loss on any dataset's rows, mixed across fades."""

from __future__ import annotations

from rewind.states.stagekinds.rules import StageRules


class PretrainRules(StageRules):
    """Every default: any rows, mixed across fades, tied to the reference by `beta`."""


RULES = PretrainRules()
