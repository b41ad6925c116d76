"""A grpo stage in the engine (rewind.engine.step.kinds): its reward functions tried before anything is
recorded, the rollout batch its window samples and scores (rewind.engine.posttrain.grpo_rollouts), the
update on it (rewind.engine.posttrain.grpo_step), and a resume's checks of the batch it holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from rewind.engine.posttrain.grpo_rollouts import sample_rollouts
from rewind.engine.posttrain.grpo_step import grpo_train_step, window_rows
from rewind.engine.posttrain.rewards import RewardError, changed_reward_code, reward_code_changes, try_rewards
from rewind.engine.posttrain.rolloutreader import batch_problem
from rewind.engine.step.kinds import KindError, KindSpec
from rewind.states.plan import rollouts_due

if TYPE_CHECKING:
    from rewind.engine.data.registry import DatasetRegistry
    from rewind.engine.step.live import Parts
    from rewind.engine.step.step import StepResult
    from rewind.states.config import Config
    from rewind.states.events import RolloutsRecorded
    from rewind.states.features import Features
    from rewind.states.schedule import StepPlan
    from rewind.states.stages import GrpoStage
    from rewind.states.state import State


class GrpoSpec(KindSpec):
    def check(self, stage: GrpoStage, datasets: DatasetRegistry, base_dir: str | None) -> None:
        super().check(stage, datasets, base_dir)
        try:  # its reward functions import and score, before anything is recorded
            try_rewards(stage, datasets.examples, base_dir)
        except RewardError as exc:  # the config names it wrongly (a start), or the run's code is gone
            raise KindError(str(exc)) from None

    def check_held(self, parts: Parts, state: State) -> None:
        held = state.rollouts
        if held is None:
            return
        if not rollouts_due(state, parts.schedule, state.step):
            window_rows(parts, state)  # the batch the next steps read: checked now, before a resume records anything
        fork_at = parts.schedule.stage_entry_step(held.stage)
        base_dir = parts.datasets.home.base_dir
        if held.stage == state.stage and (
            changed := reward_code_changes(held.reward_code, base_dir, run_dir=parts.run_dir, fork_at=fork_at)
        ):
            raise KindError(f"{parts.run_dir}: {changed}", 1)

    def train(self, parts: Parts, state: State, plan: StepPlan, lr: float) -> tuple[StepResult, dict[str, int]]:
        # On the window's rollout batch; its prompts moved the cursors when it was sampled.
        config, stage = parts.config, parts.config.stages[plan.stage]
        result = grpo_train_step(parts.model, parts.optimizer, window_rows(parts, state), config=config, stage=stage, lr=lr)
        return result, state.cursors

    def sample(self, parts: Parts, state: State, stage_index: int, *, keep: bool = True) -> RolloutsRecorded:
        return sample_rollouts(parts, state, stage_index, keep=keep)

    def resampled(self, parts: Parts, state: State, logged: RolloutsRecorded) -> RolloutsRecorded:
        # Scored by other code, a batch differs from its record by its file name at best: say why.
        if changed := changed_reward_code(logged.reward_code, parts.datasets.home.base_dir):
            raise KindError(
                f"{changed}; replay scores the batch of step {logged.step} again with the code here, which cannot "
                "reproduce the run: restore that code to replay it",
                1,
            )
        resampled = sample_rollouts(parts, state, logged.stage, keep=False)
        if resampled.reward_code.keys() == logged.reward_code.keys():
            # The same code (checked above), as the record wrote it (one made before imports were covered)
            resampled = msgspec.structs.replace(resampled, reward_code=logged.reward_code)
        return resampled

    def batch_problem(
        self, run_dir: str, record: RolloutsRecorded, config: Config, end_id: int | None, features: Features | None
    ) -> str:
        return batch_problem(run_dir, record, config, end_id, features)


SPEC = GrpoSpec()
