"""The distill stage kind (on-policy distillation): the student samples completions, kept on record like
a grpo stage's rollouts; each update is the per-token reverse KL from the student to a teacher over the
vocabulary at every completion token. Never mixed."""

from __future__ import annotations

from rewind.states.config import Config
from rewind.states.stagekinds.rules import KlTerm, StageRules, unmixed_problems, window_problems
from rewind.states.stages import DistillStage

REFERENCE_TEACHER = "reference"  # distill.teacher naming the run's KL reference


class DistillRules(StageRules):
    reads = "prompts"
    mixes = False

    def problems(self, config: Config, stage: DistillStage, i: int) -> list[str]:
        at, settings = f"stages[{i}].distill", stage.distill
        on_reference = settings.teacher == REFERENCE_TEACHER
        tie = "loss is the KL to its teacher" if on_reference else "teacher is distill.teacher"
        problems = unmixed_problems(config, stage, i, needs_reference=on_reference, tie=tie)
        add = problems.append
        if not settings.teacher.strip():
            add(f'{at}.teacher: "reference" or the directory of a model.safetensors of this architecture')
        problems += window_problems(config, at, settings, 1)
        return problems

    def rollout_window(self, stage: DistillStage) -> int:
        return stage.distill.num_iterations

    def rollout_shaping(self, config: Config, stage: DistillStage) -> dict:
        # How a batch is sampled and scored: the teacher too (its log-probs and the rewards row are the
        # teacher's), so a fork that names another teacher mid-window samples the window's batch again;
        # a change of only the updates (their number) trains on the batch held.
        d = stage.distill
        return {"distill": [d.group_size, d.temperature, d.max_new_tokens, d.teacher]}

    def reference_tie(self, stage: DistillStage) -> KlTerm:
        if stage.distill.teacher == REFERENCE_TEACHER:
            return KlTerm("distill.teacher", 1.0, 0.0)
        return KlTerm("beta", 0.0, 0.0)

    def loss_label(self, stage: DistillStage) -> str:
        return "reverse KL to the teacher"


RULES = DistillRules()
