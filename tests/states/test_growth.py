"""Growth, decided: the plan's StackAppended events, the layouts they fold to (stable identities, what
trains), the trunk cache, the reference checkpoint after a growth, and the config rules of a plan."""

from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rewind.states.config import Config, ConfigError, LoraSection
from rewind.states.config_identity import config_hash
from rewind.states.config_reading import loads_config
from rewind.states.events import (
    ActivationsCached,
    CheckpointCommitted,
    ConfigChanged,
    Evaluated,
    ReferenceRefreshed,
    StackAppended,
    StageEntered,
    StepCommitted,
)
from rewind.states.fold import IllegalTransition, apply, fold
from rewind.states.growth import caches_trunk, current_layout, growth_event, trunk_rank
from rewind.states.plan import (
    CacheTrunk,
    TakeCheckpoint,
    decide,
    plan,
    started_state,
)
from rewind.states.schedule import Schedule
from rewind.states.state import ModelLayout, State

# tps = 2 * 8 = 16 tokens, 10 steps a stage, N = 50; stage i is entered at step 10 * i (no fades).
STAGES = 5
BASE = """
[architecture]
block_size = 8
num_layers = {num_layers}

[training]
batch_size = 2
tokens = [{tokens}]
datasets = [{datasets}]
{training}

[optimization.kl]
reference_update_stages = [{refresh}]
"""


def table(header: str, fields: dict) -> str:
    values = {key: str(v).lower() if isinstance(v, bool) else json.dumps(v) for key, v in fields.items()}
    return f"\n{header}\n" + "".join(f"{key} = {v}\n" for key, v in values.items())


def config_text(growths=(), lora=None, objective=None, num_layers=2, stages=STAGES, training="") -> str:
    text = BASE.format(
        num_layers=num_layers,
        tokens=", ".join(["160"] * stages),
        datasets=", ".join(['[{ name = "grammar" }]'] * stages),
        refresh=", ".join(str(i) for i in range(1, stages)),
        training=training,
    )
    text += "".join(table("[[growth]]", g) for g in growths)
    text += table("[lora]", lora) if lora else ""
    return text + (table("[objective]", objective) if objective else "")


@st.composite
def growth_plans(draw) -> str:
    """TOML of a 5-stage run growing 1-4 times, at stage entries (at_stage) or anywhere (at_tokens)."""
    join_steps = sorted(draw(st.lists(st.integers(1, 49), min_size=1, max_size=4, unique=True)))
    growths = []
    for step in join_steps:
        if step % 10 == 0 and draw(st.booleans()):
            where = {"at_stage": step // 10}
        else:  # any token count in (16 (step - 1), 16 step] joins before step `step`
            where = {"at_tokens": 16 * step - draw(st.integers(0, 15))}
        position = draw(st.sampled_from(["append", "append", "prepend"]))
        growth = {
            **where,
            "num_blocks": draw(st.integers(1, 3)),
            "position": position,
            "init": draw(st.sampled_from(["random", "copy", "identity"])),
            "trunk": draw(st.sampled_from(["full", "frozen", "frozen", "lora", "qlora"])),
            "precision": draw(st.sampled_from(["fp32", "bf16", "nf4"])),
            "cache": draw(st.sampled_from(["auto", "auto", "off", "on"])),
        }
        if position == "prepend":
            growth["anchor"] = draw(st.booleans())
        growths.append(growth)
    pattern = draw(st.sampled_from(["fixed", "increasing", "decreasing", "linear", "table"]))
    lora = {"rank": draw(st.integers(1, 32)), "trunk_rank": draw(st.integers(1, 16)), "pattern": pattern}
    if pattern == "table":
        lora["ranks"] = draw(st.lists(st.integers(1, 64), min_size=len(growths) + 1, max_size=len(growths) + 1))
    objective = {"kind": draw(st.sampled_from(["clm", "clm", "clm", "mlm"]))}  # weighted: caching needs clm
    return config_text(growths, lora, objective, num_layers=draw(st.integers(1, 3)))


def accepted(text: str) -> Config:
    try:
        return loads_config(text)
    except ConfigError:
        assume(False)
        raise


def planned(config: Config) -> tuple[list, list[tuple[int, StackAppended]]]:
    """The dry-run's events, RunStarted first, and (index, event) of each StackAppended."""
    started, _ = started_state(config)
    events = [started, *plan(Schedule(config))]
    return events, [(i, e) for i, e in enumerate(events) if isinstance(e, StackAppended)]


def check_trainability(config: Config, before: ModelLayout, after: ModelLayout, event: StackAppended) -> None:
    """The module docstring's rules, for every stack after one growth."""
    spec = config.growth[event.growth]
    old = {s.stack: s for s in before.stacks}
    ids = [s.stack for s in after.stacks]
    # Stable identity: the stacks already there keep their ids and order; the new one goes first or last.
    expected = [*old, event.stack] if spec.position == "append" else [event.stack, *old]
    assert ids == expected and len(set(ids)) == len(ids)
    assert after.head_trains == (not spec.anchor)
    assert after.embed_trains == (spec.trunk == "full")
    assert (after.version, after.growth) == (before.version + 1, event.growth)
    for stack in after.stacks:
        if stack.stack == event.stack:  # the new stack always trains
            assert (stack.num_blocks, stack.joined_step) == (spec.num_blocks, event.step)
            assert stack.dtype == ("bf16" if spec.precision == "bf16" else "fp32")
            if spec.precision == "nf4":
                assert (stack.base, stack.adapter_rank, stack.adapters_train) == ("nf4", config.lora.rank, True)
            else:
                assert (stack.base, stack.adapter_rank, stack.adapters_train) == ("trainable", 0, False)
            continue
        was = old[stack.stack]
        assert (stack.num_blocks, stack.joined_step, stack.dtype) == (was.num_blocks, was.joined_step, was.dtype)
        if was.base == "nf4":
            assert stack.base == "nf4"  # once quantised, always
        if spec.trunk == "full":
            assert stack.base == "trainable"
            assert (stack.adapter_rank, stack.adapters_train) == (was.adapter_rank, was.adapter_rank > 0)
        elif spec.trunk == "frozen":
            assert stack.base == ("nf4" if was.base == "nf4" else "frozen")
            assert (stack.adapter_rank, stack.adapters_train) == (was.adapter_rank, False)
        else:  # lora, qlora: adapters train on every trunk stack, at the pattern's rank when new
            rank = was.adapter_rank or trunk_rank(config.lora, stack.stack)
            assert (stack.adapter_rank, stack.adapters_train) == (rank, True)
            assert stack.adapter_alpha == pytest.approx(config.lora.alpha_per_rank * rank)
            assert stack.base == ("nf4" if spec.trunk == "qlora" or was.base == "nf4" else "frozen")
            assert event.trunk_ranks.get(str(stack.stack), 0) == (0 if was.adapter_rank else rank)


# --- the dry-run's growth plan ---------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(growth_plans())
def test_the_plan_grows_in_order_with_stable_identities_and_the_documented_trainability(text):
    config = accepted(text)
    schedule = Schedule(config)
    events, appended = planned(config)
    n = len(config.growth)
    assert [e.growth for _, e in appended] == list(range(n))
    assert [e.stack for _, e in appended] == list(range(1, n + 1))
    for i, event in appended:
        spec = config.growth[event.growth]
        assert event.step == schedule.growth_steps[event.growth]
        if spec.at_stage >= 0:
            assert event.step == schedule.entry_steps[spec.at_stage]
            assert events[i - 1] == StageEntered(step=event.step, tokens=event.tokens, stage=spec.at_stage)
            refreshes = [j for j, e in enumerate(events) if isinstance(e, ReferenceRefreshed) and e.stage == spec.at_stage]
            assert len(refreshes) == 1 and refreshes[0] > i
        else:
            assert event.step == schedule.step_of(spec.at_tokens)
        # A refresh at the growth's step takes the grown model: none comes before the growth.
        assert not [e for e in events[:i] if isinstance(e, ReferenceRefreshed) and e.step == event.step]
    state = State()
    for event in events:
        before = current_layout(state) if state.started else None
        state = apply(state, event)
        if isinstance(event, StackAppended):
            check_trainability(config, before, state.layout, event)
    assert state.finished and state.num_growths == n
    final = state.layout
    assert len(final.stacks) == 1 + n and len({s.stack for s in final.stacks}) == 1 + n
    assert next(s for s in final.stacks if s.stack == 0).num_blocks == config.architecture.num_layers


@settings(max_examples=150, deadline=None)
@given(growth_plans())
def test_the_trunk_is_cached_exactly_when_it_can_be_until_the_next_growth(text):
    config = accepted(text)
    schedule = Schedule(config)
    events, appended = planned(config)
    assert not [e for e in events[: appended[0][0]] if isinstance(e, ActivationsCached)]
    for k, (i, event) in enumerate(appended):
        spec = config.growth[event.growth]
        until = appended[k + 1][0] if k + 1 < len(appended) else len(events)
        cached = [e for e in events[i + 1 : until] if isinstance(e, ActivationsCached)]
        layout = fold(events[: i + 1]).layout
        expected = (spec.position, spec.trunk, config.objective.kind) == ("append", "frozen", "clm") and spec.cache != "off"
        assert caches_trunk(config, layout) == expected
        if spec.cache == "on":
            assert expected  # the config check refuses "on" where it cannot apply
        if not expected:
            assert cached == []
            continue
        end = schedule.growth_steps[k + 1] if k + 1 < len(appended) else schedule.num_steps
        (cache,) = cached
        assert (cache.step, cache.version) == (event.step, layout.version)
        assert (cache.num_steps, cache.num_rows) == (end - event.step, (end - event.step) * 2)


@settings(max_examples=60, deadline=None)
@given(growth_plans())
def test_folding_a_growth_plan_splits_anywhere(text):
    config = accepted(text)
    events, _ = planned(config)
    whole = fold(events)
    state = State()
    for split in range(len(events) + 1):
        assert fold(events[split:], state) == whole  # `state` is the prefix, folded one event at a time
        if split < len(events):
            state = apply(state, events[split])
    assert state == whole


# --- the activation cache in the fold --------------------------------------------------------------

TWO_APPENDS = loads_config(config_text([{"at_stage": 1}, {"at_stage": 3}]))  # frozen, clm, auto


def test_a_cache_covers_the_steps_to_the_next_growth_and_a_growth_or_config_change_drops_it():
    events, appended = planned(TWO_APPENDS)
    cached = [i for i, e in enumerate(events) if isinstance(e, ActivationsCached)]
    assert len(cached) == 2
    state = fold(events[: cached[0] + 1])
    assert state.activation_cache == ActivationsCached(step=10, tokens=160, version=1, num_steps=20, num_rows=40)
    assert fold(events[: appended[1][0] + 1]).activation_cache is None
    assert fold(events[: cached[1] + 1]).activation_cache == ActivationsCached(
        step=30, tokens=480, version=2, num_steps=20, num_rows=40
    )
    same = config_hash(TWO_APPENDS)
    changed = apply(state, ConfigChanged(step=10, tokens=160, config=TWO_APPENDS, config_hash=same, previous_hash=same))
    assert changed.activation_cache is None and changed.layout == state.layout


@pytest.mark.parametrize("version", [0, 2])
def test_a_cache_of_another_trunk_version_is_illegal(version):
    events, appended = planned(TWO_APPENDS)
    state = fold(events[: appended[0][0] + 1])
    with pytest.raises(IllegalTransition, match="the trunk is at version 1"):
        apply(state, ActivationsCached(step=10, tokens=160, version=version, num_steps=20, num_rows=40))


def test_a_config_change_that_drops_performed_growths_is_refused():
    events, _ = planned(TWO_APPENDS)
    first_cache = next(i for i, e in enumerate(events) if isinstance(e, ActivationsCached))
    state = fold(events[: first_cache + 1])  # grown once, refreshed, cached (the change drops the cache)
    fewer = loads_config(config_text())
    change = ConfigChanged(step=0, tokens=0, config=fewer, config_hash=config_hash(fewer), previous_hash="x")
    with pytest.raises(IllegalTransition, match="already grew 1 times"):
        apply(state, change)


# --- a reference refresh after a growth needs a checkpoint of the grown model ----------------------


def boundary_state(config: Config) -> State:
    """By hand: stage 0's ten steps, the boundary evaluation and checkpoint, stage 1 entered."""
    started, _ = started_state(config)
    events = [started, StageEntered(step=0, tokens=0, stage=0)]
    events += [StepCommitted(step=k, tokens=16 * k, stage=0, lr=1e-3, beta=0.0, loss=1.0) for k in range(1, 11)]
    events += [
        Evaluated(step=10, tokens=160, boundary=0, scores={}),
        CheckpointCommitted(step=10, tokens=160, checkpoint="b", manifest_sha256="0" * 64, reason="boundary"),
    ]
    state = fold(events)
    assert decide(state, Schedule(config)) == StageEntered(step=10, tokens=160, stage=1)
    return apply(state, StageEntered(step=10, tokens=160, stage=1))


def test_a_refresh_after_a_growth_at_a_checkpointed_boundary_checkpoints_the_grown_model_first():
    config = loads_config(config_text([{"at_stage": 1}], stages=2))
    schedule = Schedule(config)
    state = boundary_state(config)
    intent = decide(state, schedule)
    assert intent == growth_event(config, 0, current_layout(state), 10, 160)
    state = apply(state, intent)
    assert state.grown_since_checkpoint
    assert decide(state, schedule) == TakeCheckpoint("reference")  # "b" holds the model before the growth
    reference = CheckpointCommitted(step=10, tokens=160, checkpoint="r", manifest_sha256="1" * 64, reason="reference")
    state = apply(state, reference)
    assert not state.grown_since_checkpoint
    refresh = ReferenceRefreshed(step=10, tokens=160, stage=1, checkpoint="r")  # of the grown model
    assert decide(state, schedule) == refresh
    state = apply(state, refresh)
    assert (state.reference.checkpoint, state.reference.layout) == ("r", state.layout)
    assert decide(state, schedule) == CacheTrunk(version=1, num_steps=10, num_rows=20)


def test_without_a_growth_the_boundary_checkpoint_serves_the_refresh():
    config = loads_config(config_text(stages=2))
    refresh = ReferenceRefreshed(step=10, tokens=160, stage=1, checkpoint="b")
    assert decide(boundary_state(config), Schedule(config)) == refresh


# --- the config rules of a growth plan --------------------------------------------------------------

EVALS = 'evaluations = ["sort"]'
GROWTH_RULES = {
    "both": ([{"at_stage": 1, "at_tokens": 160}], {}, "growth[0]: give exactly one of at_stage and at_tokens"),
    "neither": ([{"at_stage": 1}, {"num_blocks": 1}], {}, "growth[1]: give exactly one of at_stage and at_tokens"),
    "stage 0": ([{"at_stage": 0}], {}, "growth[0].at_stage: stage 0 is out of range 1..4"),
    "stage 5": ([{"at_stage": 1}, {"at_stage": 5}], {}, "growth[1].at_stage: stage 5 is out of range 1..4"),
    "no blocks": ([{"at_stage": 1, "num_blocks": 0}], {}, "growth[0].num_blocks: must be positive, got 0"),
    "past the end": ([{"at_stage": 1}, {"at_tokens": 800}], {}, "growth[1].at_tokens: joins at step 50, outside"),
    "one step": ([{"at_stage": 2}, {"at_tokens": 320}], {}, "growth[1].at_tokens: joins at step 20, not after"),
    "copy": ([{"at_stage": 1, "num_blocks": 3, "init": "copy"}], {}, "growth[0]: init copy needs 3 blocks"),
    "identity nf4": ([{"at_stage": 1, "init": "identity", "precision": "nf4"}], {}, "growth[0].init: identity"),
    "anchor append": ([{"at_stage": 1, "anchor": True}], {}, "growth[0].anchor: only a prepended stack"),
    "full after qlora": ([{"at_stage": 1, "trunk": "qlora"}, {"at_stage": 2, "trunk": "full"}], {}, "growth[1]: stack 0 is quantised to nf4"),
    "full after nf4": ([{"at_stage": 1, "precision": "nf4"}, {"at_stage": 2, "trunk": "full"}], {}, "growth[1]: stack 1 is quantised to nf4"),
    "cache lora": ([{"at_stage": 1, "trunk": "lora", "cache": "on"}], {}, "growth[0].cache: on, but"),
    "cache prepend": ([{"at_stage": 1, "position": "prepend", "cache": "on"}], {}, "growth[0].cache: on, but"),
    "cache mlm": ([{"at_stage": 1, "cache": "on"}], {"objective": {"kind": "mlm"}}, "growth[0].cache: on, but"),
    "rank table": ([{"at_stage": 1}], {"lora": {"pattern": "table", "ranks": [8]}}, "lora.ranks: the table needs"),
    "target": ([], {"lora": {"targets": ["attn.qkv", "mlp.gate"]}}, "lora.targets[1]: unknown layer 'mlp.gate'"),
    "masked evals": ([], {"objective": {"kind": "diffusion"}, "training": EVALS}, "training.evaluations: answer"),
}


def problems_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        loads_config(text)
    return info.value.problems


@pytest.mark.parametrize("case", list(GROWTH_RULES))
def test_each_growth_rule_is_one_problem_naming_its_field(case):
    growths, extra, expected = GROWTH_RULES[case]
    problems = problems_of(config_text(growths, **extra))
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_several_growth_problems_are_reported_at_once():
    growths = [{"at_stage": 0}, {"at_stage": 2, "anchor": True}, {"at_stage": 3, "num_blocks": 0}]
    extra = {"lora": {"targets": ["mlp.gate"]}, "objective": {"kind": "mlm"}, "training": EVALS}
    problems = problems_of(config_text(growths, **extra))
    fields = ["lora.targets[0]", "training.evaluations", "growth[0].at_stage", "growth[1].anchor", "growth[2].num_blocks"]
    assert sorted(p.split(":")[0] for p in problems) == sorted(fields), problems


def test_a_plan_problem_is_reported_beside_an_unrelated_lora_problem():
    growths = [{"at_stage": 2}, {"at_tokens": 320}]  # both join at step 20
    problems = problems_of(config_text(growths, lora={"targets": ["mlp.gate"]}))
    assert sorted(p.split(":")[0] for p in problems) == ["growth[1].at_tokens", "lora.targets[0]"], problems


# --- trunk ranks and the v3 upcaster -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "ranks", "expected"),
    [
        ("fixed", [], [8, 8, 8, 8, 8, 8]),
        ("increasing", [], [8, 16, 32, 64, 128, 256]),
        ("decreasing", [], [8, 4, 2, 1, 1, 1]),
        ("linear", [], [8, 16, 24, 32, 40, 48]),
        ("table", [5, 3, 9, 1, 2, 7], [5, 3, 9, 1, 2, 7]),
    ],
)
def test_trunk_rank_follows_the_pattern_by_stack_id(pattern, ranks, expected):
    lora = LoraSection(trunk_rank=8, pattern=pattern, ranks=ranks)
    assert [trunk_rank(lora, stack) for stack in range(6)] == expected


def test_the_v3_upcaster_renames_only_a_stack_appended_trunk_trainable():
    from rewind.stores.upcasters import v3_to_v4

    record = {"type": "StackAppended", "step": 3, "tokens": 48, "stack": 1, "num_blocks": 2, "trunk": "trainable"}
    assert v3_to_v4(dict(record)) == {**record, "trunk": "full"}
    for kept in (
        {**record, "trunk": "frozen"},
        {"type": "StackAppended", "step": 3, "tokens": 48, "stack": 1, "num_blocks": 2},
        {"type": "StageEntered", "step": 3, "tokens": 48, "stage": 1, "trunk": "trainable"},
    ):
        assert v3_to_v4(dict(kept)) == kept
