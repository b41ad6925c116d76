"""User code is a guest: a reward function receives its own copies of the arguments, runs with the working
directory restored and SystemExit caught (one line naming it), and whatever it returns is said in a short
line (never a traceback)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from rewind.engine.rewards import RewardError, score
from rewind.states.events import RolloutsRecorded
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import one_line, run_cli
from tests.engine.test_rewards import grpo_config, unique


def scored(function: str, count: int = 2) -> torch.Tensor:
    return score([function], ["p"] * count, ["a"] * count, [[1]] * count, {"answer": ["a"] * count})


# --- what a function receives and may do ---------------------------------------------------------------

MUTATING = """
def mutate(prompts, completions, completion_ids, *, answer, **fields):
    prompts.reverse()
    completions.sort()
    for ids in completion_ids:
        ids.append(0)
    completion_ids.reverse()
    answer.clear()
    return [0.0] * len(prompts)


def aligned(prompts, completions, completion_ids, *, answer, **fields):
    return [float(len(c) == len(i)) + (p == "p0") + 10 * (c == a)
            for p, c, i, a in zip(prompts, completions, completion_ids, answer, strict=True)]
"""


def test_each_function_receives_its_own_copies(tmp_path, request, monkeypatch):
    name = unique(request, "mutating")
    (tmp_path / f"{name}.py").write_text(MUTATING)
    monkeypatch.syspath_prepend(str(tmp_path))
    prompts, completions, ids = ["p0", "p1", "p1"], ["zz", "a", "b"], [[122, 122], [97], [98]]
    answers = {"answer": ["zz", "b", "b"]}
    arguments = (prompts, completions, ids, answers)
    copied = ([*prompts], [*completions], [[*i] for i in ids], {"answer": [*answers["answer"]]})
    alone = score([f"{name}:aligned"], *arguments)
    both = score([f"{name}:mutate", f"{name}:aligned"], *arguments)
    assert alone.tolist() == [[12.0, 1.0, 11.0]]
    assert both[1].tolist() == alone[0].tolist()
    assert (prompts, completions, ids, answers) == copied  # the caller's lists too


def test_the_working_directory_is_restored_after_every_call_and_import(tmp_path, request, monkeypatch):
    name = unique(request, "wanders")
    away = tmp_path / "away"
    away.mkdir()
    (tmp_path / f"{name}.py").write_text(
        f"import os\nos.chdir({str(away)!r})\n\n"
        f"def f(prompts, completions, completion_ids, **fields):\n    os.chdir({str(away)!r})\n"
        "    return [1.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    here = Path.cwd()
    assert scored(f"{name}:f").tolist() == [[1.0, 1.0]]
    assert Path.cwd() == here


def test_a_run_whose_reward_function_changes_directory_stays_whole(tmp_path, request, monkeypatch):
    """The run directory given relative to where rewind started: every file lands in it."""
    name = unique(request, "chdir")
    (tmp_path / "work").mkdir()
    (tmp_path / "away").mkdir()
    (tmp_path / f"{name}.py").write_text(
        f"import os\n\ndef f(prompts, completions, completion_ids, **fields):\n"
        f"    os.chdir({str(tmp_path / 'away')!r})\n    return [1.0] * len(completions)\n"
    )
    (tmp_path / "post.toml").write_text(grpo_config(f"{name}:f"))
    monkeypatch.chdir(tmp_path / "work")
    code, _, err = run_cli("train", "../post.toml", "--run-dir", "run", "--no-progress", "--max-steps", "4")
    assert code == 0, err
    assert Path.cwd() == tmp_path / "work" and list((tmp_path / "away").iterdir()) == []
    assert [e for _, e in read_seq_events("run") if isinstance(e, RolloutsRecorded)]
    code, _, err = run_cli("train", "../post.toml", "--run-dir", "run", "--no-progress", "--max-steps", "2")
    assert code == 0, err
    code, out, err = run_cli("verify", "run")
    assert code == 0, out + err


def test_sys_exit_in_a_function_or_its_import_is_one_line_naming_it(tmp_path, request, monkeypatch):
    name, importing = unique(request, "exits"), unique(request, "exitsatimport")
    (tmp_path / f"{name}.py").write_text(
        "import sys\n\ndef f(prompts, completions, completion_ids, **fields):\n    sys.exit(3)\n"
    )
    (tmp_path / f"{importing}.py").write_text("import sys\nsys.exit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match=rf"^reward function {name}:f failed: SystemExit: 3 \(sys.exit: a reward function returns"):
        scored(f"{name}:f")
    with pytest.raises(RewardError, match=rf"^reward function {importing}:f: cannot import {importing}: SystemExit"):
        scored(f"{importing}:f")


def test_keyboard_interrupt_still_stops(tmp_path, request, monkeypatch):
    name = unique(request, "interrupted")
    (tmp_path / f"{name}.py").write_text("def f(prompts, completions, completion_ids, **fields):\n    raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        scored(f"{name}:f")


def test_rewind_train_whose_function_exits_mid_run_fails_in_one_line(tmp_path):
    """sys.exit(0) once the trial is over (its made-up completions are recognisable): exit 1, one line
    naming the function, where `rewind train` ended with 0 and no word, the run unfinished."""
    (tmp_path / "quits.py").write_text(
        "import sys\n\ndef f(prompts, completions, completion_ids, **fields):\n"
        "    if '' not in completions:\n        sys.exit(0)\n    return [1.0] * len(completions)\n"
    )
    (tmp_path / "post.toml").write_text(grpo_config("quits:f"))
    result = subprocess.run(
        [sys.executable, "-m", "rewind.tools.cli", "train", "post.toml", "--run-dir", "run", "--no-progress"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "reward function quits:f failed: SystemExit: 0 (sys.exit: a reward function returns" in one_line(result.stderr)


# --- what it returns, said in a short line ---------------------------------------------------------------

RETURNS = '''
import numpy as np
import torch
from decimal import Decimal
from fractions import Fraction


class Lying(list):
    def __len__(self):
        return 2


class Raising(list):
    def __len__(self):
        raise RuntimeError("no length")


class Posing:
    @property
    def __class__(self):
        return list


def lying(prompts, completions, completion_ids, **fields):
    return Lying([1.0])


def raising(prompts, completions, completion_ids, **fields):
    return Raising([1.0, 1.0])


def posing(prompts, completions, completion_ids, **fields):
    return Posing()


def enormous(prompts, completions, completion_ids, **fields):
    return [10**5000, 1.0]


def long_repr(prompts, completions, completion_ids, **fields):
    return ["x" * 10_000_000, 1.0]


def long_error(prompts, completions, completion_ids, **fields):
    raise ValueError("first line\\n" + "y" * 10_000_000)


def numpy_and_fractions(prompts, completions, completion_ids, **fields):
    return [np.float32(1.0), np.int64(2), np.float64(0.5), Fraction(1, 4)]


def a_bool(prompts, completions, completion_ids, **fields):
    return [True, 1.0, 1.0, 1.0]


def numpy_bool(prompts, completions, completion_ids, **fields):
    return [np.bool_(True), 1.0, 1.0, 1.0]


def decimal(prompts, completions, completion_ids, **fields):
    return [Decimal("0.5"), 1.0, 1.0, 1.0]


def tensor(prompts, completions, completion_ids, **fields):
    return [torch.tensor(0.5), 1.0, 1.0, 1.0]


def numpy_infinity(prompts, completions, completion_ids, **fields):
    return [np.float32("inf"), 1.0, 1.0, 1.0]


def beyond_float32(prompts, completions, completion_ids, **fields):
    return [Fraction(10**39), 1.0, 1.0, 1.0]
'''


@pytest.fixture
def returns(tmp_path, request, monkeypatch) -> str:
    name = unique(request, "returns")
    (tmp_path / f"{name}.py").write_text(RETURNS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


# What each of RETURNS' functions that returns no reward is said as (the test's name, and so its
# module's, is the function's: never the text looked for).
SAID = {
    "lying": "returned Lying of 1 values for 2 completions",
    "posing": "returned Posing that does not read: TypeError: 'Posing' object is not iterable",
    "enormous": "returned an int of about 5001 digits, not a finite number",
    "long_repr": "returned 'xxxxxxxx",
    "long_error": "failed: ValueError: first line\\nyyyy",
}


@pytest.mark.parametrize("function", sorted(SAID))
def test_what_no_reward_is_is_said_in_a_short_line(returns, function):
    said = SAID[function]
    with pytest.raises(RewardError) as raised:
        scored(f"{returns}:{function}")
    message = str(raised.value)
    assert said in message and "\n" not in message and len(message) < 500, message[:1000]


def test_a_raising_len_is_still_scored_by_its_items(returns):
    """Raising's len() raises, its items are two numbers: nothing asks its len()."""
    assert scored(f"{returns}:raising").tolist() == [[1.0, 1.0]]


def test_real_numbers_are_rewards_bools_and_others_are_not(returns):
    assert scored(f"{returns}:numpy_and_fractions", 4).tolist() == [[1.0, 2.0, 0.5, 0.25]]
    for function, shown in [
        ("a_bool", "True"),
        ("numpy_bool", repr(np.bool_(True))),
        ("decimal", "Decimal('0.5')"),
        ("tensor", "tensor(0.5000)"),
        ("numpy_infinity", repr(np.float32("inf"))),
        ("beyond_float32", repr(Fraction(10**39))),
    ]:
        with pytest.raises(RewardError, match=re.escape(f"reward function {returns}:{function}: returned {shown}, not a finite number")):
            scored(f"{returns}:{function}", 4)
