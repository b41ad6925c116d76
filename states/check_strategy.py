"""The rules for what each stage trains with (`[[stages]].strategy` and its settings table).

- `pretrain`: next-token (or the objective's) loss on any dataset.
- `sft`: prompt/response examples only (the built-in tasks but grammar, or jsonl / parquet datasets
  with prompt_field and response_field), a causal objective (the response is predicted left to right).
- `dpo`: prompt/chosen/rejected examples (the built-in tasks but grammar: a corrupted answer is the
  rejected one; or jsonl / parquet datasets with chosen_field and rejected_field), a causal objective,
  a KL reference refreshed on entering it or before (the loss compares against it), no token-level
  KL of its own (beta) and no fade into or out of it (its rows are pairs, not rows to mix).
A settings table belongs to its strategy (`[stages.sft]` on an sft stage). Problems name the record's
field (`stages[2].sft: ...`). Called by `rewind.states.config_rules.check_config`.
"""

from __future__ import annotations

from rewind.states.config import BUILTIN_DATASETS, Config, Stage

# Built-in datasets that are prompt/answer examples (grammar is running text).
BUILTIN_EXAMPLES: tuple[str, ...] = tuple(name for name in BUILTIN_DATASETS if name != "grammar")
# The strategies whose settings are a table of the stage record, by the table's field name.
SETTINGS_TABLES: tuple[str, ...] = ("sft", "dpo")


def gives_examples(config: Config, name: str) -> bool:
    """Whether dataset `name` is prompt/response examples (what an sft stage trains on)."""
    if name in config.data:
        return bool(config.data[name].response_field)
    return name in BUILTIN_EXAMPLES


def gives_preferences(config: Config, name: str) -> bool:
    """Whether dataset `name` is prompt/chosen/rejected examples (what a dpo stage trains on)."""
    if name in config.data:
        return bool(config.data[name].chosen_field)
    return name in BUILTIN_EXAMPLES


def strategy_problems(config: Config) -> list[str]:
    """Each stage's strategy against its settings, data and the run's objective, in stage order."""
    problems: list[str] = []
    for i, stage in enumerate(config.stages):
        problems += _stage_problems(config, stage, i)
    return problems


def _stage_problems(config: Config, stage: Stage, i: int) -> list[str]:
    at, problems = f"stages[{i}]", []
    for table in SETTINGS_TABLES:
        if getattr(stage, table) is not None and stage.strategy != table:
            problems.append(
                f"{at}.{table}: settings of an {table} stage, but this stage's strategy is {stage.strategy!r}"
            )
    if stage.strategy == "pretrain":
        return problems
    if config.objective.kind != "clm":
        problems.append(
            f"{at}.strategy: an {stage.strategy} stage predicts its responses left to right (objective.kind "
            f"\"clm\"), not with objective.kind {config.objective.kind!r}"
        )
    wanted = gives_examples if stage.strategy == "sft" else gives_preferences
    what = {
        "sft": "prompt/response examples; {name!r} has none (use a task, or a jsonl / parquet dataset with "
        "prompt_field and response_field)",
        "dpo": "prompt/chosen/rejected examples; {name!r} has none (use a task, or a jsonl / parquet dataset "
        "with prompt_field, chosen_field and rejected_field)",
    }[stage.strategy]
    known = config.dataset_names()
    for j, sampling in enumerate(stage.datasets):
        if sampling.name in known and not wanted(config, sampling.name):
            problems.append(
                f"{at}.datasets[{j}].name: an {stage.strategy} stage trains on " + what.format(name=sampling.name)
            )
    if stage.strategy == "dpo":
        problems += _dpo_problems(config, stage, i)
    return problems


def _dpo_problems(config: Config, stage: Stage, i: int) -> list[str]:
    at, problems, settings = f"stages[{i}]", [], stage.dpo_settings
    add = problems.append
    if not any(s.refresh_reference for s in config.stages[: i + 1]):
        add(
            f"{at}.refresh_reference: a dpo stage compares the policy with the KL reference; refresh it on "
            "entering this stage (or an earlier one)"
        )
    if stage.beta:
        add(f"{at}.beta: a dpo stage's loss is its tie to the reference; its token-level KL beta must be 0")
    fades = [(i - 1, "into")] if i > 0 else []
    fades += [(i, "out of")] if i < config.num_stages - 1 else []
    for boundary, way in fades:
        if config.fade_overlap(boundary) > 0:
            add(
                f"stages[{boundary}].overlap: no fade {way} a dpo stage (its rows are pairs), got "
                f"{config.fade_overlap(boundary):g}; set overlap = 0 on stages[{boundary}]"
            )
    if not settings.beta > 0:
        add(f"{at}.dpo.beta: must be positive, got {settings.beta}")
    if not 0.0 <= settings.label_smoothing < 0.5:
        add(f"{at}.dpo.label_smoothing: must be in [0, 0.5), got {settings.label_smoothing}")
    elif settings.label_smoothing and settings.loss in ("ipo", "hinge"):
        add(f"{at}.dpo.label_smoothing: the {settings.loss} loss has no label smoothing (sigmoid or robust do)")
    if settings.sft_weight < 0:
        add(f"{at}.dpo.sft_weight: must be >= 0, got {settings.sft_weight}")
    return problems
