"""The engine's half of a stage kind: how a stage of that kind is checked on entry, steps, samples its
rollouts and measures its figures. The loop, entry and replay ask `spec_of(stage)`; nothing else in the
engine compares strategy names.

Each kind registers its spec here by its tag, as the module that holds it: a spec module is imported
the first time a stage of its kind asks, so a pretraining run never imports a sampler. The pure rules
of a kind (what it must hold, when a rollout batch is due) are `rewind.states.stagekinds`.

    spec_of(stage).check(stage, datasets, base_dir)       before anything is recorded (start, resume, fork)
    spec_of(stage).check_held(parts, state)                a resume into a window holding a rollout batch
    spec_of(stage).train(parts, state, plan, lr)           one step: (StepResult, cursors after it)
    spec_of(stage).sample(parts, state, index, keep=...)   a rollout batch (rollout kinds)
    spec_of(stage).resampled(parts, state, logged)         replay: the batch sampled again, to compare
    spec_of(stage).batch_problem(run_dir, record, ...)     a rollout file a record names: a batch the kind writes?
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from rewind.states.stagekinds import rules_of
from rewind.states.stages import STAGE_KINDS, Stage

if TYPE_CHECKING:
    from rewind.engine.data.registry import DatasetRegistry
    from rewind.engine.step.live import Parts
    from rewind.engine.step.step import StepResult
    from rewind.states.config import Config
    from rewind.states.events import RolloutsRecorded
    from rewind.states.features import Features
    from rewind.states.schedule import StepPlan
    from rewind.states.state import State

# Each kind's spec, by the module that holds it (its `SPEC`).
_SPECS: dict[str, str] = {
    "pretrain": "rewind.engine.step.mixed_step",
    "sft": "rewind.engine.step.mixed_step",
    "dpo": "rewind.engine.posttrain.dpo_step",
    "grpo": "rewind.engine.posttrain.grpo_kind",
    "distill": "rewind.engine.posttrain.distill",
}
assert _SPECS.keys() == STAGE_KINDS.keys(), "every stage kind has its engine spec"
# The figures a boundary evaluation adds for a run that post-trains (its `boundary_figures`).
_FIGURES = "rewind.engine.posttrain.posttrain_figures"


class KindError(Exception):
    """A stage cannot be entered or replayed as its kind requires (one line). exit_code: 2 the config names
    something wrong, 1 the run's own inputs changed since."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class KindSpec:
    """What a kind does in the engine; the defaults are a kind with nothing to check and no rollouts."""

    def check(self, stage: Stage, datasets: DatasetRegistry, base_dir: str | None) -> None:
        """Read what the stage will train on now (a malformed example says so before anything is
        recorded): its datasets' examples of the kind its rules read."""
        reads = rules_of(stage).reads
        for sampling in stage.datasets if reads else []:
            datasets.examples.of_kind(reads, sampling.name)

    def check_held(self, parts: Parts, state: State) -> None:
        """A resume or fork whose state holds a rollout batch of this stage: it still reads as its record says."""

    def train(self, parts: Parts, state: State, plan: StepPlan, lr: float) -> tuple[StepResult, dict[str, int]]:
        raise NotImplementedError

    def sample(self, parts: Parts, state: State, stage_index: int, *, keep: bool = True) -> RolloutsRecorded:
        raise NotImplementedError(f"a {self} stage samples no rollouts")

    def resampled(self, parts: Parts, state: State, logged: RolloutsRecorded) -> RolloutsRecorded:
        """The logged batch sampled again from the same weights and keys (`rewind replay` compares them)."""
        return self.sample(parts, state, logged.stage, keep=False)

    def batch_problem(
        self, run_dir: str, record: RolloutsRecorded, config: Config, end_id: int | None, features: Features | None
    ) -> str:
        """Why the rollout file `record` names is not a batch a stage of this kind writes ("" if it is): the
        check a resume makes of the batch it holds, which `rewind verify` and `rewind rollouts` make too."""
        return f"{record.path}: not a batch a run writes: its record names stage {record.stage}, which samples none"


def spec_of(stage: Stage) -> KindSpec:
    return import_module(_SPECS[stage.strategy]).SPEC


def batch_problem(
    run_dir: str, record: RolloutsRecorded, config: Config, end_id: int | None = None, features: Features | None = None
) -> str:
    """Why the rollout file a RolloutsRecorded names is not a batch a run writes ("" if it is), asked of its
    stage's kind (`KindSpec.batch_problem`) under `config`, the config in force at the record. `end_id`:
    the run's end token (None: read from the run); `features`: the run's behaviours (None: read too)."""
    if not 0 <= record.stage < len(config.stages):
        return f"{record.path}: not a batch a run writes: its record names stage {record.stage}, not a stage of the run's config"
    return spec_of(config.stages[record.stage]).batch_problem(run_dir, record, config, end_id, features)


def posttraining_figures(parts: Parts, boundary: int) -> dict[str, Any]:
    """The post-training figures of a boundary evaluation (rewind.engine.posttrain.posttrain_figures): {}
    for a run whose stages all read plain rows (imported only for a run that post-trains)."""
    if not posttrains(parts.config):
        return {}
    return import_module(_FIGURES).boundary_figures(parts, boundary)


def posttrains(config: Config) -> bool:
    """Whether any stage reads examples rather than plain rows."""
    return any(rules_of(stage).reads for stage in config.stages)
