"""Upcasters: how a record written under an older event schema becomes today's event.

`rewind.stores.codec` decodes a record of schema version v < SCHEMA_VERSION into a plain dict and runs
`UPCASTERS[v]`, `UPCASTERS[v + 1]`, ... on it before converting it to an event; this module registers
them (it is imported with the package, so any reader of a log has them). A schema bump without an
upcaster leaves old logs unreadable, and tests/compat/ (run directories left by older releases) fails.
"""

from __future__ import annotations

import msgspec

from rewind.states.stageform import to_stage_form
from rewind.stores.codec import UPCASTERS

# The fields of a 0.1 `State` that a fork's seed carries (see rewind.states.state.ForkSeed). Written
# out rather than read off ForkSeed: this upgrade is of 0.1's records and must not change as the seed
# gains fields.
_SEED_FIELDS = (
    "config_hash",
    "tokens_per_step",
    "num_stages",
    "num_steps",
    "reference_update_stages",
    "stage",
    "num_stages_entered",
    "fades_started",
    "fades_ended",
    "pending_refreshes",
    "reference",
    "stacks",
    "cursors",
    "last_loss",
    "num_skipped_steps",
    "live_checkpoints",
    "last_evaluated_boundary",
)


def v1_to_v2(raw: dict) -> dict:
    """Schema 1 (rewind 0.1) -> 2: RunResumed stored the whole restored `State`. Today's fold derives an
    ordinary resume's state from the log, so the copy becomes a seed: a fork (whose log cannot derive
    it) adopts it after range checks; an ordinary resume's fold checks it against what it derived."""
    if raw.get("type") != "RunResumed" or "restored" not in raw:
        return raw
    upgraded = {k: v for k, v in raw.items() if k != "restored"}
    restored = raw["restored"]
    if isinstance(restored, dict):
        seed = {k: restored[k] for k in _SEED_FIELDS if k in restored}
        # 0.1 did not record validations in the state; its restore point is a checkpoint, which comes
        # after that step's validation: so a fork resumed from it does not validate that step again.
        seed["last_validated_step"] = restored.get("step", -1)
        upgraded["seed"] = seed
    return upgraded


def v2_to_v3(raw: dict) -> dict:
    """Schema 2 -> 3 only added an event type and fields with defaults; their absence is meaningful:
    a RunStarted without `features` is a run started before them, which keeps its old behaviours."""
    return raw


def v3_to_v4(raw: dict) -> dict:
    """Schema 3 -> 4 added model growth (StackAppended's decisions, ActivationsCached). No release
    before 4 performed growth (the engine refused it), so a v3 StackAppended exists only in hand-made
    logs; its trunk value "trainable" is today's "full"."""
    if raw.get("type") == "StackAppended" and raw.get("trunk") == "trainable":
        return {**raw, "trunk": "full"}
    return raw


def v4_to_v5(raw: dict) -> dict:
    """Schema 4 -> 5 added the data on record (fields with defaults: a run without them recorded no
    identities, which is what their absence means) and EpochStarted."""
    return raw


def v5_to_v6(raw: dict) -> dict:
    """Schema 5 -> 6 added where a run computes (RunStarted/RunResumed .device, .world_size, with
    defaults): a record without them was computed on the CPU by one process, which is what they mean."""
    return raw


def v6_to_v7(raw: dict) -> dict:
    """Schema 6 -> 7 added RunResumed.num_threads (default 0): a resume that did not record it computed
    with the count the run had, which is what 0 means."""
    return raw


def v7_to_v8(raw: dict) -> dict:
    """Schema 7 -> 8 made a stage a record (`Config.stages`): the configs that RunStarted and
    ConfigChanged carry held the flat per-stage lists, which become the stages they describe, as a
    flat config file does when it is read (`rewind.states.stageform`). The identity is unchanged:
    `config_hash` hashes the stages as those lists."""
    config = raw.get("config")
    if not isinstance(config, dict):
        return raw
    translated, problems, _ = to_stage_form(config)
    if problems:  # no release logged such a config: said like any record that is not an event
        raise msgspec.ValidationError(f"its config cannot be read as stages: {'; '.join(problems[:3])}")
    return {**raw, "config": translated}


def v8_to_v9(raw: dict) -> dict:
    """Schema 8 -> 9 added post-training: RolloutsRecorded (a grpo stage's rollout batch),
    StepCommitted.metrics and Evaluated.posttraining (defaults {}). A schema 8 record holds none of them,
    which is what their absence means."""
    return raw


def v9_to_v10(raw: dict) -> dict:
    """Schema 9 -> 10 made a stage's record its kind's (`rewind.states.stages`): a logged stage held every
    kind's settings table, null where it was not its own (a rule refused a table on another kind), and
    always its strategy. The nulls go; the tables and the identity are unchanged."""
    config = raw.get("config")
    stages = config.get("stages") if isinstance(config, dict) else None
    if not isinstance(stages, list):
        return raw
    records = [
        {"strategy": "pretrain", **{k: v for k, v in s.items() if not (k in _OLD_TABLES and v is None)}}
        if isinstance(s, dict)
        else s
        for s in stages
    ]
    return {**raw, "config": {**config, "stages": records}}


# The settings tables a schema 9 stage held (null unless its strategy's).
_OLD_TABLES = ("sft", "dpo", "grpo")

UPCASTERS[1] = v1_to_v2
UPCASTERS[2] = v2_to_v3
UPCASTERS[3] = v3_to_v4
UPCASTERS[4] = v4_to_v5
UPCASTERS[5] = v5_to_v6
UPCASTERS[6] = v6_to_v7
UPCASTERS[7] = v7_to_v8
UPCASTERS[8] = v8_to_v9
UPCASTERS[9] = v9_to_v10
