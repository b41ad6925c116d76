"""Hypothesis strategies for rewind configs, schedules and event logs, for your own property tests.

Needs hypothesis (the `test` extra: `pip install 'rewind[test]'`). Nothing in `rewind.states` imports
this module, so the library itself never depends on hypothesis.

- `configs()`: valid, small `Config`s (N stays within `max_steps`) that vary what shapes a schedule:
  overlaps (0, 1 and in between, per boundary too), curves, LR schedules, KL betas, reference stages
  and stages shorter than one step.
- `config_variants(config)`: your config with its schedule knobs turned (overlaps, curve, batch size,
  LR schedule), to see that a tweak cannot break what you rely on.
- `token_positions(config)`, `steps(config)`: positions and step indices, biased towards the places
  where things change (boundaries, ramp edges, entry steps).
- `cut_points(events)`: where to cut a log to resume from.
- `simulate_run(config, crash_after=...)` and `engine_logs(config)`: the log a training engine writes,
  crashes and resumes included, with made-up losses.

Example: a property test of your own config.

    from hypothesis import given
    from rewind.states.check_schedule import schedule_warnings
    from rewind.states.config_reading import loads_config
    from rewind.states.schedule import Schedule
    from rewind.states.strategies import config_variants, token_positions

    MY_CONFIG = loads_config(open("configs/my_run.toml").read())

    @given(token_positions(MY_CONFIG))
    def test_my_weights_sum_to_one(x):
        assert abs(sum(Schedule(MY_CONFIG).weights_at(x)) - 1.0) < 1e-9

    @given(config_variants(MY_CONFIG))
    def test_my_tweaks_raise_no_warning(config):
        assert schedule_warnings(config) == []
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
from hypothesis import strategies as st

from rewind.states.config import BUILTIN_DATASETS, Config
from rewind.states.config_identity import config_hash
from rewind.states.config_reading import config_from_dict
from rewind.states.events import (
    CheckpointCommitted,
    CheckpointDeleted,
    Evaluated,
    Event,
    RolloutsRecorded,
    RunResumed,
    StepCommitted,
    Validated,
)
from rewind.states.fold import apply
from rewind.states.history import restore_point
from rewind.states.plan import (
    CacheTrunk,
    Control,
    DeleteCheckpoints,
    Evaluate,
    RunStep,
    SampleRollouts,
    TakeCheckpoint,
    Validate,
    decide,
    dry_run_event,
    started_state,
    step_lr,
)
from rewind.states.schedule import Schedule
from rewind.states.state import State

CURVES: tuple[str, ...] = ("linear", "cosine", "sigmoid")
LR_SCHEDULES: tuple[str, ...] = ("wsds", "wsd", "cosine", "sgdr", "constant", "cosine_rewarm")

# Small token blocks keep N small for realistic-looking budgets; the engine is not involved here.
_BLOCK_SIZES = (4, 8, 16, 32)
# Mixture rates that are exact in binary, so `rates must sum to 1` holds without rounding luck.
_MIXTURE_RATES = ((1.0,), (0.5, 0.5), (0.25, 0.75))
_NAME_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789_-"


def unit_floats() -> st.SearchStrategy[float]:
    """Floats in [0, 1], with the edges and simple values drawn often (overlaps, LR multipliers)."""
    return st.one_of(st.sampled_from((0.0, 0.25, 0.5, 1.0)), st.floats(0.0, 1.0))


@st.composite
def _config_dicts(
    draw: st.DrawFn,
    min_stages: int,
    max_stages: int,
    max_steps: int,
    tiny_stages: bool,
    curves: Sequence[str],
    lr_schedules: Sequence[str],
    kl: bool,
) -> dict[str, Any]:
    num_stages = draw(st.integers(min_stages, max_stages))
    batch_size = draw(st.integers(1, 8))
    block_size = draw(st.sampled_from(_BLOCK_SIZES))
    tokens_per_step = batch_size * block_size
    # Each stage gets at most its share of `max_steps`, so N <= max_steps whatever is drawn.
    steps_per_stage = max(1, max_steps // num_stages)
    budgets = []
    for _ in range(num_stages):
        tiny = tiny_stages and draw(st.integers(0, 4)) == 0
        low, high = (1, tokens_per_step - 1) if tiny else (tokens_per_step, steps_per_stage * tokens_per_step)
        budgets.append(draw(st.integers(low, high)))

    user_names = [f"corpus{i}" for i in range(draw(st.integers(0, 2)))]
    data = {
        name: {
            "kind": draw(st.sampled_from(("tokens", "jsonl"))),
            "path": f"data/{name}.bin",
            "validation_fraction": draw(st.sampled_from((0.05, 0.1, 0.5))),
        }
        for name in user_names
    }
    names = [*BUILTIN_DATASETS, *user_names]
    datasets = []
    for _ in range(num_stages):
        rates = draw(st.sampled_from(_MIXTURE_RATES))
        chosen = draw(st.lists(st.sampled_from(names), min_size=len(rates), max_size=len(rates), unique=True))
        datasets.append([{"name": n, "rate": r} for n, r in zip(chosen, rates, strict=True)])

    num_boundaries = num_stages - 1
    per_boundary = draw(
        st.one_of(st.just([]), st.lists(unit_floats(), min_size=num_boundaries, max_size=num_boundaries))
    )
    fade = {
        "overlap": draw(unit_floats()),
        "curve": draw(st.sampled_from(curves)),
        "steepness": draw(st.one_of(st.just(10.0), st.floats(0.5, 40.0))),
        "per_boundary_overlap": per_boundary,
    }
    optimization: dict[str, Any] = {
        "lr": draw(st.sampled_from((1.0, 3e-4, 1e-3))),
        "schedule": draw(st.sampled_from(lr_schedules)),
        # Maxima sum to 1, the most check_config allows.
        "warmup_pct": draw(st.one_of(st.just(0.0), st.floats(0.0, 0.3))),
        "decay_pct": draw(st.one_of(st.just(0.0), st.floats(0.0, 0.5))),
        "constant_pct": draw(st.one_of(st.just(0.0), st.floats(0.0, 0.2))),
        "warmup_lr_mult": draw(unit_floats()),
        "decay_lr_mult": draw(unit_floats()),
        "min_lr_ratio": draw(unit_floats()),
        "sgdr_period": draw(st.integers(1, max(1, max_steps // 4))),
        "rewarm_lr": draw(st.sampled_from((1e-4, 3e-4, 2e-3))),
        "reset_optimizer_stages": draw(st.lists(st.integers(1, max(num_stages - 1, 1)), unique=True))
        if num_stages > 1
        else [],
        "reset_restarts_lr": draw(st.booleans()),
    }
    if kl:
        betas = st.lists(st.sampled_from((0.0, 0.1, 0.5)), min_size=num_stages, max_size=num_stages)
        optimization["kl"] = {
            "betas": draw(st.one_of(st.just([]), betas)),
            "reference_update_stages": draw(st.lists(st.integers(0, num_stages - 1), unique=True)),
        }
    divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
    return {
        "run": {"seed": draw(st.integers(0, 2**31 - 1)), "name": draw(st.text(_NAME_ALPHABET, min_size=1))},
        "architecture": {"block_size": block_size},
        "training": {
            "batch_size": batch_size,
            "per_device_batch_size": draw(st.sampled_from((-1, *divisors))),
            "tokens": budgets,
            "datasets": datasets,
            "evaluations": draw(st.lists(st.sampled_from(names), unique=True, max_size=2)),
            "fade": fade,
        },
        "optimization": optimization,
        "logging": {
            "report_interval": draw(st.integers(1, 50)),
            "validation_interval": draw(st.integers(0, 20)),
            "checkpoint_interval": draw(st.integers(0, 50)),
            "keep_last_checkpoints": draw(st.integers(1, 4)),
        },
        "data": data,
    }


def configs(
    *,
    min_stages: int = 1,
    max_stages: int = 5,
    max_steps: int = 2_000,
    tiny_stages: bool = True,
    curves: Sequence[str] = CURVES,
    lr_schedules: Sequence[str] = LR_SCHEDULES,
    kl: bool = True,
) -> st.SearchStrategy[Config]:
    """Valid configs with `min_stages..max_stages` stages and at most `max_steps` optimizer steps.

    `tiny_stages` lets some stages be shorter than one step (they are entered together with the next).
    Configs go through `config_from_dict`, so a generated config that fails validation is a bug here
    and raises `ConfigError` instead of being filtered away."""
    if not 1 <= min_stages <= max_stages:
        raise ValueError(f"need 1 <= min_stages <= max_stages, got {min_stages}, {max_stages}")
    raw = _config_dicts(
        min_stages, max_stages, max_steps, tiny_stages, tuple(curves), tuple(lr_schedules), kl
    )
    return raw.map(config_from_dict)


@st.composite
def _variant(draw: st.DrawFn, config: Config) -> Config:
    raw = msgspec.to_builtins(config)
    num_boundaries = max(config.num_stages - 1, 0)
    fade = raw["training"]["fade"]
    fade["overlap"] = draw(unit_floats())
    fade["curve"] = draw(st.sampled_from(CURVES))
    fade["steepness"] = draw(st.floats(0.5, 40.0))
    overlaps = draw(
        st.one_of(st.just([]), st.lists(unit_floats(), min_size=num_boundaries, max_size=num_boundaries))
    )
    for stage in raw["stages"]:
        stage.pop("overlap", None)
    for stage, overlap in zip(raw["stages"], overlaps, strict=False):
        stage["overlap"] = overlap
    if draw(st.booleans()):
        # A batch size change keeps the token budgets, so N and every entry step move.
        raw["training"]["batch_size"] = draw(st.integers(1, 2 * config.training.batch_size))
        raw["training"]["per_device_batch_size"] = -1
    opt = raw["optimization"]
    opt["schedule"] = draw(st.sampled_from(LR_SCHEDULES))
    opt["warmup_pct"] = draw(st.floats(0.0, 0.3))
    opt["decay_pct"] = draw(st.floats(0.0, 0.5))
    opt["constant_pct"] = draw(st.floats(0.0, 0.2))
    return config_from_dict(raw)


def config_variants(config: Config) -> st.SearchStrategy[Config]:
    """`config` with its fade, batch size and LR schedule knobs redrawn (stages and data untouched)."""
    return _variant(config)


def token_positions(config: Config) -> st.SearchStrategy[float]:
    """Token positions in [0, total + one step]: anywhere, or exactly at (and one token either side of)
    a boundary, a ramp edge or the end, where off-by-one mistakes live."""
    schedule = Schedule(config)
    landmarks = {0.0, float(schedule.total_tokens)}
    for edge in (*schedule.boundaries, *(r.start for r in schedule.ramps), *(r.end for r in schedule.ramps)):
        landmarks.update((edge - 1.0, float(edge), edge + 1.0))
    upper = float(schedule.total_tokens + schedule.tokens_per_step)
    return st.one_of(
        st.integers(0, int(upper)).map(float),
        st.sampled_from(sorted(x for x in landmarks if 0.0 <= x <= upper)),
        st.floats(0.0, upper),
    )


def steps(config: Config) -> st.SearchStrategy[int]:
    """Step indices in [0, N]: anywhere, or next to a stage entry, a fade edge or the end."""
    schedule = Schedule(config)
    n = schedule.num_steps
    landmarks = {0, n, *schedule.entry_steps}
    for ramp in schedule.fades:
        landmarks.update((schedule.fade_start_step(ramp), schedule.fade_end_step(ramp)))
    near = sorted({k + d for k in landmarks for d in (-1, 0, 1) if 0 <= k + d <= n})
    return st.one_of(st.integers(0, n), st.sampled_from(near))


def cut_points(events: Sequence[Event]) -> st.SearchStrategy[int]:
    """Where to cut an event list: `events[:cut]` happened, `events[cut:]` is still to come."""
    return st.integers(0, len(events))


def engine_logs(config: Config, max_crashes: int = 3) -> st.SearchStrategy[list[Event]]:
    """Logs of `simulate_run(config, crash_after=...)` with up to `max_crashes` drawn crash points."""
    n = Schedule(config).num_steps
    crashes = st.lists(st.integers(0, n), max_size=max_crashes)
    return crashes.map(lambda crash_after: simulate_run(config, crash_after=crash_after))


def simulate_run(config: Config, crash_after: Iterable[int] = ()) -> list[Event]:
    """The log an engine writes for `config`, as `rewind.engine.run.loop` drives it, without a model.

    Losses and cursors are functions of the step, so a replayed stretch repeats the first attempt
    exactly. For each `c` in `crash_after` the process dies once `c` steps are committed (with their
    duties) and a new one resumes where `history.restore_point` says: from the last checkpoint, or from
    the start when there is none. Its `RunResumed` supersedes every record after that point.

    Every event is applied as it is written, so an illegal transition raises `IllegalTransition`."""
    schedule = Schedule(config)
    started, state = started_state(config)
    log: list[Event] = [started]
    identity = config_hash(config)
    pending_crashes = sorted(set(crash_after), reverse=True)

    def emit(event: Event) -> None:
        nonlocal state
        state = apply(state, event)
        log.append(event)

    while (intent := decide(state, schedule)) is not None:
        if (
            isinstance(intent, Control | RunStep)
            and state.step
            and pending_crashes
            and pending_crashes[-1] <= state.step
        ):
            pending_crashes.pop()  # the process dies with every duty of the step done; a new one resumes
            point = restore_point(list(enumerate(log)), state)
            emit(
                RunResumed(
                    step=point.state.step,
                    tokens=point.state.tokens,
                    checkpoint=point.checkpoint,
                    superseded_first_seq=point.seq + 1,
                    superseded_last_seq=len(log) - 1,
                    config_hash=identity,
                )
            )
            continue
        at = {"step": state.step, "tokens": state.tokens}
        match intent:
            case RunStep():
                _commit_step(schedule, state, emit)
            case Validate():
                emit(Validated(**at, losses={"grammar": _loss(state.step)}))
            case Evaluate(boundary=boundary):
                emit(Evaluated(**at, boundary=boundary, scores={"grammar": 1.0 / (1.0 + _loss(state.step))}))
            case TakeCheckpoint(reason=reason):
                name = (
                    f"{state.step:08d}-{hashlib.sha256(f'{identity}:{state.step}'.encode()).hexdigest()[:8]}"
                )
                manifest = hashlib.sha256(name.encode()).hexdigest()
                emit(CheckpointCommitted(**at, checkpoint=name, manifest_sha256=manifest, reason=reason))
            case DeleteCheckpoints(names=names):
                for doomed in names:
                    emit(CheckpointDeleted(**at, checkpoint=doomed))
            case CacheTrunk():
                emit(dry_run_event(intent, state.step, state.tokens))
            case SampleRollouts(stage=stage):  # a made-up file name: nothing is written
                digest = hashlib.sha256(f"{identity}:rollouts:{state.step}".encode()).hexdigest()
                emit(RolloutsRecorded(**at, stage=stage, path=f"rollouts/{digest}.safetensors", sha256=digest,
                                      num_prompts=1, group_size=2, cursors=state.cursors))
            case _:
                emit(intent)  # a control transition that is its event
    return log


def _commit_step(schedule: Schedule, state: State, emit: Any) -> None:
    k = state.step
    plan = schedule.step_plan(k)
    cursors = dict(state.cursors)
    for stage, num_rows in enumerate(plan.rows):
        if num_rows:
            name = schedule.config.stages[stage].datasets[0].name
            cursors[name] = cursors.get(name, 0) + num_rows
    emit(
        StepCommitted(
            step=k + 1,
            tokens=schedule.tokens_of(k + 1),
            stage=plan.stage,
            lr=step_lr(state, schedule, k),  # what the engine trains at: the run's features and resets
            beta=plan.beta,
            loss=_loss(k + 1),
            rows=list(plan.rows),
            cursors=cursors,
        )
    )


def _loss(step: int) -> float:
    """A made-up loss curve: a pure function of the step so that replayed steps agree."""
    return 4.0 / math.sqrt(1.0 + step)
