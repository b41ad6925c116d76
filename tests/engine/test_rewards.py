"""Reward functions: the built-in exact_match and your own "module:function", each completion's reward a
finite number or None (NaN on record), anything else one line; the code's identity on every rollout
record, and a resume inside the stage under changed code refused before anything is recorded."""

from __future__ import annotations

import math

import pytest

from rewind.engine.rewards import RewardError, reward_identity, score
from rewind.states.events import RolloutsRecorded
from rewind.stores.runs import read_seq_events
from tests.conftest import EXAMPLES
from tests.engine.test_loop import run_cli

MODULE = '''
__version__ = "1.0"


def by_length(prompts, completions, completion_ids, *, answer, **fields):
    return [None if not text else len(text) / 10 for text in completions]


def broken(prompts, completions, completion_ids, **fields):
    return [float("nan")] * len(completions)


def short(prompts, completions, completion_ids, **fields):
    return [1.0]
'''


@pytest.fixture
def module(tmp_path, monkeypatch, request):
    """A reward module of its own name (modules are cached by name) on the Python path."""
    name = f"rewards_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_rewards_are_scored_per_function_with_none_as_nan(module):
    scores = score(
        ["exact_match", f"{module}:by_length"], ["p", "p"], ["42", ""], [[52, 50], []], {"answer": ["42", "7"]}
    )
    assert scores[0].tolist() == [1.0, 0.0]
    assert scores[1, 0].item() == pytest.approx(0.2) and math.isnan(scores[1, 1].item())


@pytest.mark.parametrize(
    ("function", "said"),
    [
        ("broken", "returned nan, not a finite number or None"),
        ("short", "returned list of 1 values for 2 completions"),
        ("missing", "has no function 'missing'"),
    ],
)
def test_a_reward_that_is_no_reward_is_one_line(module, function, said):
    with pytest.raises(RewardError, match=said):
        score([f"{module}:{function}"], ["p", "q"], ["a", "b"], [[1], [2]], {"answer": ["a", "b"]})


def test_an_unimportable_module_is_one_line():
    with pytest.raises(RewardError, match="cannot import no_such_rewards_module: ModuleNotFoundError"):
        score(["no_such_rewards_module:f"], ["p"], ["a"], [[1]], {"answer": ["a"]})


def test_the_identity_is_the_module_file_s_hash_and_version(module, tmp_path):
    first = reward_identity(f"{module}:by_length")
    assert first.startswith("sha256:") and first.endswith(";version=1.0")
    assert reward_identity("exact_match") == "builtin"
    (tmp_path / f"{module}.py").write_text(MODULE + "\n# edited\n")
    assert reward_identity(f"{module}:by_length") != first


def test_a_resume_inside_the_stage_under_changed_reward_code_is_refused(module, tmp_path):
    tiny = (EXAMPLES / "tiny.toml").read_text()
    config = tiny[: tiny.index("[[stages]]")] + (
        '[[stages]]\ntokens = 2_560\ndatasets = [{ name = "reverse", rate = 1.0 }]\noverlap = 0.0\n\n'
        '[[stages]]\nstrategy = "grpo"\ntokens = 2_048\ndatasets = [{ name = "reverse", rate = 1.0 }]\n'
        f'grpo = {{ group_size = 4, max_new_tokens = 6, rewards = [{{ function = "{module}:by_length" }}] }}\n'
    )
    path, run = tmp_path / "grpo.toml", tmp_path / "run"
    path.write_text(config)
    code, _, err = run_cli("train", path, "--run-dir", run, "--no-progress", "--max-steps", "13")
    assert code == 0, err
    records = [e for _, e in read_seq_events(run) if isinstance(e, RolloutsRecorded)]
    assert records and all(r.reward_code == {f"{module}:by_length": reward_identity(f"{module}:by_length")} for r in records)
    assert any(r.mean_reward > 0 for r in records)  # the module's rewards, not the built-in's
    source = tmp_path / f"{module}.py"
    source.write_text(MODULE.replace('"1.0"', '"1.1"'))
    before = read_seq_events(run)
    code, _, err = run_cli("train", path, "--run-dir", run, "--no-progress")
    assert code == 1 and err.count("\n") == 1 and f"reward function {module}:by_length changed" in err, err
    assert read_seq_events(run) == before
    source.write_text(MODULE)
    code, _, err = run_cli("train", path, "--run-dir", run, "--no-progress")
    assert code == 0, err
