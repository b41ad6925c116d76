"""The rules for what each stage trains with (`[[stages]].strategy` and its settings table).

- `pretrain`: next-token (or the objective's) loss on any dataset.
- `sft`: prompt/response examples only (the built-in tasks but grammar, or jsonl / parquet datasets
  with prompt_field and response_field), a causal objective (the response is predicted left to right).
- `dpo`: prompt/chosen/rejected examples (the built-in tasks but grammar: a corrupted answer is the
  rejected one; or jsonl / parquet datasets with chosen_field and rejected_field), a causal objective,
  a KL reference refreshed on entering it or before (the loss compares against it), no token-level
  KL of its own (beta) and no fade into or out of it (its rows are pairs, not rows to mix).
- `grpo`: prompts with answers (the built-in tasks but grammar, or jsonl / parquet datasets with
  prompt_field and answer_field), a causal objective, no fade into or out of it and no token-level KL
  (its own kl_beta, with a reference refreshed at it or before); a rollout batch of whole groups
  (training.batch_size a multiple of group_size) whose prompt and completion fit the context.
Every number of a settings table is checked at the range the stage computes with it: the scales and
weights (dpo.beta, dpo.sft_weight, grpo.kl_beta, grpo.epsilon_high, a reward's weight) multiply float32
tensors, so each is a float32 number (a positive one not so small that float32 rounds it to 0), and
grpo.temperature is at least `MIN_TEMPERATURE`.
A settings table belongs to its strategy (`[stages.sft]` on an sft stage). Problems name the record's
field (`stages[2].sft: ...`). Called by `rewind.states.config_rules.check_config`.
"""

from __future__ import annotations

import re

from rewind.states.config import BUILTIN_DATASETS, Config, Stage

# Built-in datasets that are prompt/answer examples (grammar is running text).
BUILTIN_EXAMPLES: tuple[str, ...] = tuple(name for name in BUILTIN_DATASETS if name != "grammar")
# The reward functions rewind has (rewind.engine.posttrain.rewards); others are named "module:function".
BUILTIN_REWARDS: tuple[str, ...] = ("exact_match",)
_ENTRY_POINT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*", re.ASCII)
# The strategies whose settings are a table of the stage record, by the table's field name.
SETTINGS_TABLES: tuple[str, ...] = ("sft", "dpo", "grpo")
# float32's largest and smallest normal numbers: the losses and the sampler compute in float32, where a
# setting past the first is infinite (a first step's 0 times it is NaN; the clip bound 1 + epsilon_high
# cannot even be made) and a positive one below the second rounds to 0 or loses its precision.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
# A grpo stage's temperature divides float32 logits, and its log-probs, the importance ratio exp(logp -
# old_logp) and k3's exp(-d) move 1/T times as fast as the logits: float32's exp overflows past 88.7, a
# logit change of 0.89 at T = 0.01 between a rollout and an update. Below this (vLLM's floor too) the
# sampling is argmax in all but name while one ordinary update can overflow the loss.
MIN_TEMPERATURE = 0.01
# The ipo loss is (h - 1 / (2 beta)) ** 2, h = 0 at a stage's first step: finite in float32 from here up.
IPO_MIN_BETA = 2.8e-20


def gives_examples(config: Config, name: str) -> bool:
    """Whether dataset `name` is prompt/response examples (what an sft stage trains on)."""
    if name in config.data:
        return bool(config.data[name].response_field)
    return name in BUILTIN_EXAMPLES


def gives_prompts(config: Config, name: str) -> bool:
    """Whether dataset `name` is prompts with answers (what a grpo stage samples from and rewards)."""
    if name in config.data:
        return bool(config.data[name].answer_field)
    return name in BUILTIN_EXAMPLES


def gives_preferences(config: Config, name: str) -> bool:
    """Whether dataset `name` is prompt/chosen/rejected examples (what a dpo stage trains on)."""
    if name in config.data:
        return bool(config.data[name].chosen_field)
    return name in BUILTIN_EXAMPLES


def _a(strategy: str) -> str:
    return f"an {strategy}" if strategy == "sft" else f"a {strategy}"


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
                f"{at}.{table}: settings of {_a(table)} stage, but this stage's strategy is {stage.strategy!r}"
            )
    if stage.strategy == "pretrain":
        return problems
    if config.objective.kind != "clm":
        problems.append(
            f"{at}.strategy: {_a(stage.strategy)} stage predicts its responses left to right (objective.kind "
            f"\"clm\"), not with objective.kind {config.objective.kind!r}"
        )
    wanted = {"sft": gives_examples, "dpo": gives_preferences, "grpo": gives_prompts}[stage.strategy]
    what = {
        "sft": "prompt/response examples; {name!r} has none (use a task, or a jsonl / parquet dataset with "
        "prompt_field and response_field)",
        "dpo": "prompt/chosen/rejected examples; {name!r} has none (use a task, or a jsonl / parquet dataset "
        "with prompt_field, chosen_field and rejected_field)",
        "grpo": "prompts with answers; {name!r} has none (use a task, or a jsonl / parquet dataset with "
        "prompt_field and answer_field)",
    }[stage.strategy]
    known = config.dataset_names()
    for j, sampling in enumerate(stage.datasets):
        if sampling.name in known and not wanted(config, sampling.name):
            problems.append(
                f"{at}.datasets[{j}].name: {_a(stage.strategy)} stage trains on " + what.format(name=sampling.name)
            )
    if stage.strategy == "dpo":
        problems += _dpo_problems(config, stage, i)
    if stage.strategy == "grpo":
        problems += _grpo_problems(config, stage, i)
    return problems


def _unmixed_problems(config: Config, stage: Stage, i: int, needs_reference: bool) -> list[str]:
    """A dpo or grpo stage: no fade into or out of it, no token-level KL, a reference when it uses one."""
    at, kind, problems = f"stages[{i}]", stage.strategy, []
    if needs_reference and not any(s.refresh_reference for s in config.stages[: i + 1]):
        problems.append(
            f"{at}.refresh_reference: a {kind} stage compares the policy with the KL reference; refresh it on "
            "entering this stage (or an earlier one)"
        )
    if stage.beta:
        tie = "loss is its tie to the reference" if kind == "dpo" else "KL to the reference is grpo.kl_beta"
        problems.append(f"{at}.beta: a {kind} stage's {tie}; its token-level KL beta must be 0")
    fades = [(i - 1, "into")] if i > 0 else []
    fades += [(i, "out of")] if i < config.num_stages - 1 else []
    for boundary, way in fades:
        if config.fade_overlap(boundary) > 0:
            problems.append(
                f"stages[{boundary}].overlap: no fade {way} a {kind} stage (its rows are its own), got "
                f"{config.fade_overlap(boundary):g}; set overlap = 0 on stages[{boundary}]"
            )
    return problems


def _dpo_problems(config: Config, stage: Stage, i: int) -> list[str]:
    at, settings = f"stages[{i}]", stage.dpo_settings
    problems = _unmixed_problems(config, stage, i, needs_reference=True)
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
        problems += _float32_problems(f"{at}.dpo.{name}", getattr(settings, name))
    if settings.loss == "ipo" and FLOAT32_TINY <= settings.beta < IPO_MIN_BETA:
        add(
            f"{at}.dpo.beta: the ipo loss needs at least {IPO_MIN_BETA} (its target 1 / (2 beta), squared, is a "
            f"float32), got {settings.beta}"
        )
    return problems


def _float32_problems(path: str, value: float, tiny: bool = True) -> list[str]:
    """A scale the stage multiplies float32 tensors by: within float32's range, and (`tiny`) a positive
    one not rounded to 0 or below float32's normal numbers (the sign rules are the caller's)."""
    if value > FLOAT32_MAX:
        return [f"{path}: must be at most 3.4e38 (the stage computes with it in float32), got {value}"]
    if tiny and 0 < value < FLOAT32_TINY:
        return [
            f"{path}: must not lie in (0, 1.2e-38), below float32's normal numbers (the stage computes with it "
            f"in float32), got {value}"
        ]
    return []


def _grpo_problems(config: Config, stage: Stage, i: int) -> list[str]:
    at, settings, block = f"stages[{i}].grpo", stage.grpo_settings, config.architecture.block_size
    problems = _unmixed_problems(config, stage, i, needs_reference=settings.kl_beta > 0)
    add = problems.append
    if settings.group_size < 2:
        add(f"{at}.group_size: at least 2 (an advantage compares a completion with its group), got {settings.group_size}")
    elif config.training.batch_size % settings.group_size:
        add(
            f"{at}.group_size: training.batch_size {config.training.batch_size} (completions a step) is not a "
            f"multiple of group_size {settings.group_size}"
        )
    if not settings.temperature > 0:
        add(f"{at}.temperature: must be positive (the log-probs are the sampled distribution's), got {settings.temperature}")
    elif settings.temperature < MIN_TEMPERATURE:
        add(
            f"{at}.temperature: must be at least {MIN_TEMPERATURE} (the log-probs and the importance ratio move 1/T "
            f"times as fast as the float32 logits), got {settings.temperature}"
        )
    if not 1 <= settings.max_new_tokens < block:
        add(f"{at}.max_new_tokens: must be in [1, block_size - 1 = {block - 1}] (the prompt needs a token), got {settings.max_new_tokens}")
    if settings.num_iterations < 1:
        add(f"{at}.num_iterations: must be >= 1, got {settings.num_iterations}")
    if not 0.0 <= settings.epsilon_low <= 1.0:
        add(f"{at}.epsilon_low: must be in [0, 1], got {settings.epsilon_low}")
    if settings.epsilon_high < 0:
        add(f"{at}.epsilon_high: must be >= 0, got {settings.epsilon_high}")
    problems += _float32_problems(f"{at}.epsilon_high", settings.epsilon_high, tiny=False)
    if settings.kl_beta < 0:
        add(f"{at}.kl_beta: must be >= 0, got {settings.kl_beta}")
    problems += _float32_problems(f"{at}.kl_beta", settings.kl_beta)
    if not settings.rewards:
        add(f"{at}.rewards: at least one reward function")
    for j, reward in enumerate(settings.rewards):
        if reward.function not in BUILTIN_REWARDS and not _ENTRY_POINT.fullmatch(reward.function):
            add(
                f"{at}.rewards[{j}].function: {reward.function!r} is neither a built-in reward "
                f"({', '.join(BUILTIN_REWARDS)}) nor \"module:function\""
            )
        if not reward.weight > 0:
            add(f"{at}.rewards[{j}].weight: must be positive, got {reward.weight}")
        problems += _float32_problems(f"{at}.rewards[{j}].weight", reward.weight)
    return problems
