"""User code is a guest: a reward function receives its own copies of the arguments, runs with the working
directory restored and SystemExit caught (one line naming it), whatever it returns is said in a short
line (never a traceback), and its identity covers the modules of yours it imports; a resume or replay
under changed code says what changed and the way forward."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from rewind.engine.data.example_sources import ExampleSources
from rewind.engine.data.userdata import DataHome
from rewind.engine.posttrain import reward_code
from rewind.engine.posttrain.reward_code import IMPORT_DIGITS
from rewind.engine.posttrain.rewards import (
    QUOTE_LIMIT,
    RewardError,
    reward_code_changes,
    reward_identity,
    score,
    try_rewards,
)
from rewind.states.config_reading import loads_config
from rewind.states.events import RolloutsRecorded, StageEntered
from rewind.stores.runs import read_seq_events
from tests.conftest import REPO
from tests.engine.test_loop import one_line, run_cli
from tests.engine.test_rewards import grpo_config, unique


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tried(function: str, beside: Path) -> None:
    """The trial a run makes before it records anything, of a grpo stage scored by `function` alone."""
    config = loads_config(grpo_config(function))
    try_rewards(config.stages[1], ExampleSources(config, DataHome()), str(beside))


def scored(function: str, count: int = 2) -> torch.Tensor:
    return score([function], ["p"] * count, ["a"] * count, [[1]] * count, {"answer": ["a"] * count})


# --- identity: the modules it imports ----------------------------------------------------------------


def test_the_identity_covers_the_modules_it_imports_at_its_top_and_inside_a_function(tmp_path, request):
    """A package reward module: a helper imported at its top (through a module of its own), a module
    its function imports on its first call (the trial's), one it loads through importlib; each is on
    record by name, and a change to any of them changes the identity."""
    name = unique(request, "pkg")
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text("from .scoring import f\n")
    (package / "scoring.py").write_text(
        "import importlib\nfrom . import helper\n\n"
        "def f(prompts, completions, completion_ids, **fields):\n"
        "    from . import lazy\n"
        f"    importlib.import_module('{name}.loaded')\n"
        "    return [helper.weight(c) * lazy.scale() for c in completions]\n"
    )
    (package / "helper.py").write_text("def weight(text):\n    return float(len(text))\n")
    (package / "lazy.py").write_text("def scale():\n    return 0.5\n")
    (package / "loaded.py").write_text("X = 1\n")
    function = f"{name}:f"
    tried(function, tmp_path)
    identity = reward_identity(function, str(tmp_path))
    covered = [f"{name}.{module}:{digest(package / (module + '.py'))[:IMPORT_DIGITS]}" for module in ("helper", "lazy", "loaded", "scoring")]
    assert identity == f"sha256:{digest(package / '__init__.py')};imports={','.join(covered)}"
    for module in ("helper", "lazy", "loaded", "scoring"):
        source = package / f"{module}.py"
        kept = source.read_text()
        source.write_text(kept + "# edited\n")
        assert reward_identity(function, str(tmp_path)) != identity, module
        said = reward_code_changes({function: identity}, str(tmp_path))
        assert f"{name}.{module} ({source}, changed)" in said, said
        source.write_text(kept)
    assert reward_identity(function, str(tmp_path)) == identity


def test_a_helper_two_reward_modules_import_is_covered_for_both(tmp_path, request):
    """The second module's import finds the helper already loaded: still covered."""
    helper, first, second = (unique(request, stem) for stem in ("common", "first", "second"))
    (tmp_path / f"{helper}.py").write_text("def value(text):\n    return 1.0\n")
    for module in (first, second):
        (tmp_path / f"{module}.py").write_text(
            f"import {helper}\n\ndef f(prompts, completions, completion_ids, **fields):\n"
            f"    return [{helper}.value(c) for c in completions]\n"
        )
    for module in (first, second):
        tried(f"{module}:f", tmp_path)
        assert f";imports={helper}:{digest(tmp_path / f'{helper}.py')[:16]}" in reward_identity(f"{module}:f", str(tmp_path))


def test_an_identity_recorded_before_imports_were_covered_is_compared_by_its_file(tmp_path, request):
    """A run recorded before: its identity is the module file's hash and version alone. Resumed under the
    same module file it goes on (whatever the helpers); under another, it is refused."""
    name, helper = unique(request, "old"), unique(request, "oldhelper")
    (tmp_path / f"{helper}.py").write_text("ONE = 1.0\n")
    source = tmp_path / f"{name}.py"
    source.write_text(
        f'__version__ = "2"\nfrom {helper} import ONE\n\n'
        "def f(prompts, completions, completion_ids, **fields):\n    return [ONE] * len(completions)\n"
    )
    function = f"{name}:f"
    tried(function, tmp_path)
    now = reward_identity(function, str(tmp_path))
    old = f"sha256:{digest(source)};version=2"
    assert now != old and ";imports=" in now
    assert reward_code_changes({function: old}, str(tmp_path)) == ""
    assert reward_code_changes({function: old.replace("version=2", "version=1")}, str(tmp_path)) != ""
    source.write_text(source.read_text() + "# edited\n")
    said = reward_code_changes({function: old}, str(tmp_path))
    assert f"reward function {function} changed since the run scored with it" in said
    assert f"the content of its module's file {source} changed" in said, said


def test_the_docs_give_the_identity_as_it_is_written(tmp_path, request):
    """docs/posttraining.md's template of an identity matches one with imports and a version, and one with
    neither; its quoting limit is the code's."""
    page = (REPO / "docs" / "posttraining.md").read_text()
    (template,) = [b.strip() for b in re.findall(r"```text\n(.*?)```", page, re.S) if b.startswith("sha256:")]
    meaning = {
        "<the module file's sha256>": "[0-9a-f]{64}", "<module>": r"[\w.]+", "<__version__>": ".+",
        f"<{IMPORT_DIGITS} hex digits of its file's sha256>": f"[0-9a-f]{{{IMPORT_DIGITS}}}",
        ",...": rf"(?:,[\w.]+:[0-9a-f]{{{IMPORT_DIGITS}}})*", "[": "(?:", "]": ")?",
    }  # fmt: skip
    pattern = "".join(meaning.get(part, re.escape(part)) for part in re.split(r"(<[^>]*>|,\.\.\.|\[|\])", template))
    name, helper = unique(request, "documented"), unique(request, "documentedhelper")
    (tmp_path / f"{helper}.py").write_text("X = 1.0\n")
    (tmp_path / f"{name}.py").write_text(
        f'__version__ = "0.1"\nfrom {helper} import X\n\n'
        "def f(prompts, completions, completion_ids, **fields):\n    return [X] * len(completions)\n"
        "\n\ndef g(prompts, completions, completion_ids, **fields):\n    return [1.0] * len(completions)\n"
    )
    (tmp_path / f"{name}_alone.py").write_text("def g(prompts, completions, completion_ids, **fields):\n    return [1.0]\n")
    full, bare = reward_identity(f"{name}:f", str(tmp_path)), reward_identity(f"{name}_alone:g", str(tmp_path))
    assert ";imports=" in full and ";version=0.1" in full and re.fullmatch(pattern, full), (pattern, full)
    assert re.fullmatch(pattern, bare) and ";" not in bare, (pattern, bare)
    assert f"cut at {QUOTE_LIMIT} characters" in " ".join(page.split())


def grpo_run(tmp_path: Path, function: str, *extra: str) -> Path:
    (tmp_path / "post.toml").write_text(grpo_config(function))
    run = tmp_path / "run"
    code, _, err = run_cli("train", tmp_path / "post.toml", "--run-dir", run, "--no-progress", *extra)
    assert code == 0, err
    return run


def test_a_resume_under_a_changed_helper_is_refused_saying_what_changed_and_what_to_do(tmp_path, request):
    name, helper = unique(request, "scored"), unique(request, "scoredhelper")
    helper_file = tmp_path / f"{helper}.py"
    helper_file.write_text("def reward(text):\n    return len(text) / 10\n")
    (tmp_path / f"{name}.py").write_text(
        f"import {helper}\n\ndef f(prompts, completions, completion_ids, **fields):\n"
        f"    return [{helper}.reward(c) for c in completions]\n"
    )
    run = grpo_run(tmp_path, f"{name}:f", "--max-steps", "4")
    records = [e for _, e in read_seq_events(run) if isinstance(e, RolloutsRecorded)]
    assert records and all(f";imports={helper}:" in r.reward_code[f"{name}:f"] for r in records)
    before = read_seq_events(run)
    helper_file.write_text("def reward(text):\n    return len(text) / 5\n")
    code, _, err = run_cli("train", tmp_path / "post.toml", "--run-dir", run, "--no-progress")
    line = one_line(err)
    assert code == 1 and f"reward function {name}:f changed since the run scored with it" in line, err
    assert f"the content of the modules it imports changed: {helper} ({helper_file}, changed)" in line, line
    assert "restore that code" in line and "rewind fork" in line, line
    entered = [e.step for _, e in before if isinstance(e, StageEntered) and e.stage == 1]
    assert f"--at-step {entered[0]} NEW_RUN`" in line, line  # the step its grpo stage began at, exactly
    assert read_seq_events(run) == before
    helper_file.write_text("def reward(text):\n    return len(text) / 10\n")
    code, _, err = run_cli("train", tmp_path / "post.toml", "--run-dir", run, "--no-progress", "--max-steps", "1")
    assert code == 0, err


def test_the_way_forward_names_the_fork_from_before_the_stage(tmp_path, request):
    """With the run and the step its grpo stage began at, the refusal gives the fork command; forking
    there under the changed code goes on (its batches scored by the new code)."""
    name = unique(request, "forked")
    source = tmp_path / f"{name}.py"
    source.write_text("def f(prompts, completions, completion_ids, **fields):\n    return [1.0] * len(completions)\n")
    run = grpo_run(tmp_path, f"{name}:f", "--max-steps", "4")
    held = [e for _, e in read_seq_events(run) if isinstance(e, RolloutsRecorded)][-1]
    source.write_text("def f(prompts, completions, completion_ids, **fields):\n    return [0.5] * len(completions)\n")
    said = reward_code_changes(held.reward_code, str(tmp_path), run_dir=str(run), fork_at=2)
    assert f"`rewind fork {run} --at-step 2 NEW_RUN`" in said, said
    code, _, err = run_cli("fork", run, "--at-step", "2", tmp_path / "new", "--config", tmp_path / "post.toml",
                           "--no-progress", "--max-steps", "2")  # fmt: skip
    assert code == 0, err
    forked = [e for _, e in read_seq_events(tmp_path / "new") if isinstance(e, RolloutsRecorded)]
    assert forked and all(e.mean_reward == 0.5 for e in forked)


def test_a_replay_under_changed_reward_code_says_the_code_changed_not_the_file_names(tmp_path, request, monkeypatch):
    name = unique(request, "replayed")
    source = tmp_path / f"{name}.py"
    source.write_text("def f(prompts, completions, completion_ids, **fields):\n    return [float(len(c)) for c in completions]\n")
    run = grpo_run(tmp_path, f"{name}:f", "--max-steps", "4")
    source.write_text("def f(prompts, completions, completion_ids, **fields):\n    return [2.0 * len(c) for c in completions]\n")
    monkeypatch.chdir(tmp_path)  # replay looks for the module in the working directory
    code, out, err = run_cli("replay", run, "--no-progress")
    line = one_line(err)
    assert code == 1 and "RolloutsRecorded.path" not in out, out
    assert f"reward function {name}:f changed since the run scored with it" in line, line
    assert f"the content of its module's file {source} changed" in line and "restore that code" in line, line


def test_a_run_recorded_before_imports_were_covered_resumes_and_replays(tmp_path, request, monkeypatch):
    """Its records name the module's file alone (as rewind wrote them before): under the same code, a
    resume goes on and a replay is reproducible, the identities compared by file and version."""
    name, helper = unique(request, "before"), unique(request, "beforehelper")
    (tmp_path / f"{helper}.py").write_text("def reward(text):\n    return len(text) / 10\n")
    (tmp_path / f"{name}.py").write_text(
        f"import {helper}\n\ndef f(prompts, completions, completion_ids, **fields):\n"
        f"    return [{helper}.reward(c) for c in completions]\n"
    )
    with monkeypatch.context() as before:
        before.setattr(reward_code, "imports_of", lambda module_name: {})
        run = grpo_run(tmp_path, f"{name}:f", "--max-steps", "4")
    records = [e for _, e in read_seq_events(run) if isinstance(e, RolloutsRecorded)]
    assert records and all(";" not in r.reward_code[f"{name}:f"] for r in records)
    code, _, err = run_cli("train", tmp_path / "post.toml", "--run-dir", run, "--no-progress", "--max-steps", "2")
    assert code == 0, err
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli("replay", run, "--no-progress")
    assert code == 0 and "replay: reproducible" in out, out + err


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
    "lying": "returned a Lying of 1 reward for 2 completions",
    "posing": "returned a Posing that does not read: TypeError: 'Posing' object is not iterable",
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


def test_a_function_that_imports_a_neighbour_only_on_a_later_call_finds_it(tmp_path, request):
    """An import inside the function, on its third call only (after the trial): the module's directory is on
    the Python path during every call, as while the module was imported, and off it between calls."""
    name, helper = unique(request, "lazy"), unique(request, "lazyhelper")
    (tmp_path / f"{helper}.py").write_text("def reward(text):\n    return 0.5\n")
    (tmp_path / f"{name}.py").write_text(
        "calls = 0\n\ndef f(prompts, completions, completion_ids, **fields):\n    global calls\n    calls += 1\n"
        f"    if calls < 3:\n        return [0.0] * len(completions)\n    import {helper}\n"
        f"    return [{helper}.reward(c) for c in completions]\n"
    )
    for _ in range(3):
        scores = score([f"{name}:f"], ["p"], ["a"], [[1]], {"answer": ["a"]}, beside=str(tmp_path))
    assert scores.tolist() == [[0.5]]
    assert str(tmp_path) not in sys.path
