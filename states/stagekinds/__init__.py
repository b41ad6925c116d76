"""The stage kinds' rules, one module per kind, asked by the stage record's type: nothing else in
rewind compares strategy names.

    rules_of(stage).problems(config, stage, i)   what it must hold (config_rules runs them all)
    rules_of(stage).rollout_window(stage)        > 0: a rollout batch is due before each window (plan)
    rules_of(stage).reference_tie(stage)         what ties it to the KL reference, at what weight

Adding a kind: its record in `rewind.states.stages`, its rules module here (registered in `_RULES`), its
engine half in `rewind.engine.step.kinds` (docs/architecture.md, "Adding a strategy").
"""

from __future__ import annotations

from rewind.states.config import Config
from rewind.states.stagekinds import distill, dpo, grpo, pretrain, sft
from rewind.states.stagekinds.rules import StageRules, a_kind, gives
from rewind.states.stages import STAGE_KINDS, Stage

_RULES: dict[str, StageRules] = {
    "pretrain": pretrain.RULES,
    "sft": sft.RULES,
    "dpo": dpo.RULES,
    "grpo": grpo.RULES,
    "distill": distill.RULES,
}
assert _RULES.keys() == STAGE_KINDS.keys(), "every stage kind has its rules"

_READS = {
    "examples": "prompt/response examples; {name!r} has none (use a task, or a jsonl / parquet dataset with "
    "prompt_field and response_field)",
    "preferences": "prompt/chosen/rejected examples; {name!r} has none (use a task, or a jsonl / parquet "
    "dataset with prompt_field, chosen_field and rejected_field)",
    "prompts": "prompts with answers; {name!r} has none (use a task, or a jsonl / parquet dataset with "
    "prompt_field and answer_field)",
}


def rules_of(stage: Stage) -> StageRules:
    return _RULES[stage.strategy]


def strategy_problems(config: Config) -> list[str]:
    """Each stage's strategy against its settings, data and the run's objective, in stage order."""
    problems: list[str] = []
    for i, stage in enumerate(config.stages):
        rules, at = rules_of(stage), f"stages[{i}]"
        if rules.reads and config.objective.kind != "clm":
            problems.append(
                f"{at}.strategy: {a_kind(stage.strategy)} stage predicts its responses left to right "
                f'(objective.kind "clm"), not with objective.kind {config.objective.kind!r}'
            )
        known = config.dataset_names()
        for j, sampling in enumerate(stage.datasets):
            if rules.reads and sampling.name in known and not gives(config, sampling.name, rules.reads):
                what = _READS[rules.reads].format(name=sampling.name)
                problems.append(f"{at}.datasets[{j}].name: {a_kind(stage.strategy)} stage trains on {what}")
        problems += rules.problems(config, stage, i)
    return problems
