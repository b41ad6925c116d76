"""The step of a pretrain or sft stage: the rows of every stage the fade mixes into it (each stage's
share read its own way: a token stream's rows, or an sft stage's examples), the objective's loss plus
beta x the KL to the reference, one update (rewind.engine.step.step)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rewind.engine.data.example_batches import step_rows
from rewind.engine.step.kinds import KindSpec
from rewind.engine.step.step import StepResult, train_step
from rewind.states.growth import current_layout, depth_of_training

if TYPE_CHECKING:
    from rewind.engine.step.live import Parts
    from rewind.states.schedule import StepPlan
    from rewind.states.state import State


class MixedSpec(KindSpec):
    def train(self, parts: Parts, state: State, plan: StepPlan, lr: float) -> tuple[StepResult, dict[str, int]]:
        config = parts.config
        stack_index, num_stacks = depth_of_training(config, current_layout(state))
        rows = step_rows(config, plan.rows, state.cursors, parts.datasets)
        result = train_step(
            parts.model,
            parts.optimizer,
            rows.tokens,
            rows.loss_mask,
            documents=rows.documents,
            config=config,
            lr=lr,
            beta=plan.beta,
            reference=parts.reference,
            step=state.step,
            trunk_rows=parts.trunk_reader.rows(parts.run_dir, state, state.step),
            stack_index=stack_index,
            num_stacks=num_stacks,
        )
        return result, rows.cursors


SPEC = MixedSpec()
