"""Numbers a config may hold only if every later stage can: integers the log (msgpack, 64-bit) records,
token budgets the schedule places exactly (below 2**53), and TOML that Python can read at all. Each is one
problem naming its field, never a traceback, and never a message thousands of digits long."""

from __future__ import annotations

import tomllib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rewind.states.config import ConfigError
from rewind.states.config_reading import loads_config
from rewind.states.schedule import Schedule
from tests.engine.test_loop import TINY

MAX_TOKENS = 1 << 53


def problems_of(*overrides: str, text: str | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        loads_config(TINY.read_text() if text is None else text, "tiny.toml", list(overrides))
    return caught.value.problems


def test_budgets_past_the_logs_integers_are_refused_by_path():
    # The config: it passed, was recorded, and the run could not go on.
    problems = problems_of(f"training.tokens=[{2**63}, {2**63}, 1]")
    assert problems == [
        f"training.tokens[0]: must fit a signed 64-bit integer (the log's integers), got {2**63}",
        f"training.tokens[1]: must fit a signed 64-bit integer (the log's integers), got {2**63}",
    ]


def test_a_budget_or_a_sum_past_the_schedules_exact_range_is_refused():
    assert problems_of(f"training.tokens=[{MAX_TOKENS + 1}, 1, 1]") == [
        f"training.tokens[0]: at most 2**53 tokens (the schedule's exact range), got {MAX_TOKENS + 1}"
    ]
    (problem,) = problems_of(f"training.tokens=[{MAX_TOKENS // 2}, {MAX_TOKENS // 2}, 1]")
    assert problem.startswith(f"training.tokens: the stage budgets sum to {MAX_TOKENS + 1:,} tokens")


def test_the_largest_run_allowed_builds_its_schedule():
    config = loads_config(TINY.read_text(), "tiny.toml", [f"training.tokens=[{MAX_TOKENS // 2}, {MAX_TOKENS // 2 - 1}, 1]"])
    schedule = Schedule(config)
    assert schedule.total_tokens == MAX_TOKENS
    assert schedule.num_steps == MAX_TOKENS // config.tokens_per_step
    assert list(schedule.entry_steps) == sorted(schedule.entry_steps)


def test_a_step_of_more_than_2_53_tokens_is_refused():
    (problem,) = problems_of(f"training.batch_size={MAX_TOKENS}")
    assert problem.startswith(f"training.batch_size: {MAX_TOKENS} rows of block_size 32")


def test_a_400_digit_budget_is_one_short_problem():
    """Issue 23: `--set training.tokens=[<400 digits>, ...]` raised OverflowError while the schedule was built."""
    problems = problems_of(f"training.tokens=[{'9' * 400}, -{'9' * 400}, 1]")
    assert problems == [
        "training.tokens[0]: must fit a signed 64-bit integer (the log's integers), got a number of about 401 digits",
        "training.tokens[1]: must fit a signed 64-bit integer (the log's integers), got a negative number of about "
        "401 digits",
    ]


def test_a_huge_integer_is_not_printed_by_the_rules_it_breaks_too():
    # num_heads also fails the d_model divisibility rule, which printed the value whole.
    problems = problems_of(f"architecture.num_heads={10**400}", "training.batch_size=0")
    assert problems[0].startswith("architecture.num_heads: must fit a signed 64-bit integer")
    assert "training.batch_size: must be positive, got 0" in problems  # the other problems are still said
    assert all(len(p) < 200 for p in problems), problems


@given(st.sampled_from(["run.seed", "training.batch_size", "logging.checkpoint_interval", "training.eval_samples"]),
       st.one_of(st.integers(min_value=2**64), st.integers(max_value=-(2**63) - 1)))
def test_no_integer_the_log_cannot_encode_passes(path, value):
    problems = problems_of(f"{path}={value}")
    assert any(p.startswith(f"{path}: ") for p in problems)
    assert all(len(p) < 200 for p in problems), problems


def test_the_seed_keeps_its_unsigned_range():
    config = loads_config(TINY.read_text(), "tiny.toml", [f"run.seed={2**64 - 1}"])
    assert config.run.seed == 2**64 - 1


@pytest.mark.parametrize(
    ("value", "said"),
    [("9" * 5000, "an integer of more than 4300 digits"), ("[" * 50_000 + "]" * 50_000, "arrays or tables nested too deeply")],
)
def test_toml_past_pythons_limits_is_one_problem(value, said):
    (file_problem,) = problems_of(text=f"[training]\nbatch_size = {value}\n")
    assert file_problem == f"cannot read the TOML: {said}"
    (override_problem,) = problems_of(f"training.batch_size={value}")
    assert override_problem.startswith("--set 'training.batch_size=") and override_problem.endswith(f"VALUE holds {said}")
    assert len(override_problem) < 200


def test_tomllib_itself_still_raises_for_them():
    """The control: what read_toml turns into one line really is an exception of Python's."""
    with pytest.raises(ValueError, match="4300"):
        tomllib.loads("v = " + "9" * 5000)
    with pytest.raises(RecursionError):
        tomllib.loads("v = " + "[" * 50_000 + "]" * 50_000)
