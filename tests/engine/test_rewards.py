"""Reward functions: the built-in exact_match and your own "module:function", each completion's reward a
finite number or None (NaN on record), anything else one line; the code's identity on every rollout
record, and a resume inside the stage under changed code refused before anything is recorded."""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import pytest

from rewind.engine.data.example_sources import ExampleSources
from rewind.engine.data.examples import task_texts
from rewind.engine.data.userdata import DataHome
from rewind.engine.posttrain.rewards import TRIAL_GARBAGE, RewardError, reward_identity, score, try_rewards
from rewind.states.config_reading import loads_config
from rewind.states.events import RolloutsRecorded, StepCommitted
from rewind.stores.runs import read_seq_events
from tests.conftest import EXAMPLES
from tests.engine.test_loop import one_line, run_cli

MODULE = '''
__version__ = "1.0"


def by_length(prompts, completions, completion_ids, *, answer, **fields):
    return [None if not text else len(text) / 10 for text in completions]


def broken(prompts, completions, completion_ids, **fields):
    return [float("nan")] * len(completions)


def short(prompts, completions, completion_ids, **fields):
    return [1.0]


def every_other(prompts, completions, completion_ids, **fields):
    return [None if n % 2 else 1.0 for n in range(len(completions))]


def mapping(prompts, completions, completion_ids, **fields):
    return {text: 1.0 for text in completions}


def lazy(prompts, completions, completion_ids, **fields):
    return (1.0 for _ in completions)


def long(prompts, completions, completion_ids, **fields):
    return [1.0] * (len(completions) + 1)
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
        ("broken", "returned nan, not a finite number ("),
        ("short", "returned a list of 1 reward for 2 completions"),
        ("long", "returned a list of more than 2 rewards for 2 completions"),
        ("mapping", "returned a dict, not a list or tuple of 2 rewards"),
        ("lazy", "returned a generator, not a list or tuple of 2 rewards"),
        ("missing", "has no function 'missing'"),
    ],
    ids=["nan", "short", "too_many", "keyed", "generated", "missing"],  # not the expected text: the module's name is made of the test's id
)
def test_a_reward_that_is_no_reward_is_one_line(module, function, said):
    with pytest.raises(RewardError, match=re.escape(said)):
        score([f"{module}:{function}"], ["p", "q"], ["a", "b"], [[1], [2]], {"answer": ["a", "b"]})


def test_an_unimportable_module_is_one_line_naming_where_it_looked(tmp_path):
    said = f"cannot import no_such_rewards_module: no no_such_rewards_module.py nor no_such_rewards_module/ beside the config ({tmp_path}) or in the working directory ({Path.cwd()}), and no installed module"
    with pytest.raises(RewardError, match=re.escape(said)):
        score(["no_such_rewards_module:f"], ["p"], ["a"], [[1]], {"answer": ["a"]}, beside=str(tmp_path))
    (tmp_path / "no_such_rewards_module.py").write_text("import no_such_dependency_either\n")
    with pytest.raises(RewardError, match="ModuleNotFoundError: No module named 'no_such_dependency_either'"):
        score(["no_such_rewards_module:f"], ["p"], ["a"], [[1]], {"answer": ["a"]}, beside=str(tmp_path))


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


# A run small enough to reach its grpo stage in seconds: 2 pretraining steps (8 rows of 32 tokens each),
# then the grpo stage given, no evaluations (no boundary figures to sample).
BASE = """[run]
name = "rewards"
seed = 7

[architecture]
block_size = 32
vocab_size = 256
num_layers = 1
num_heads = 2
d_model = 32

[training]
batch_size = 8

[training.fade]
overlap = 0.0

[optimization]
lr = 3e-3

[[stages]]
tokens = 512
datasets = [{ name = "grammar", rate = 1.0 }]
"""


def grpo_config(function: str, stage: str = "") -> str:
    """BASE and a grpo stage on `reverse` scored by `function` (or the stage text given)."""
    return BASE + (
        stage
        or '\n[[stages]]\nstrategy = "grpo"\ntokens = 4_096\ndatasets = [{ name = "reverse", rate = 1.0 }]\n'
        f'grpo = {{ group_size = 4, max_new_tokens = 6, rewards = [{{ function = "{function}" }}] }}\n'
    )


def unique(request, stem: str) -> str:
    """A module name of the test's own (modules are cached by name)."""
    return f"{stem}_{re.sub(r'[^0-9a-zA-Z_]', '_', request.node.name)}"


def test_a_module_beside_the_config_is_found_from_another_directory(tmp_path, monkeypatch, request):
    name = unique(request, "beside")
    (tmp_path / "sub").mkdir()
    (tmp_path / "elsewhere").mkdir()
    source = tmp_path / "sub" / f"{name}.py"
    source.write_text(MODULE)
    (tmp_path / "sub" / "post.toml").write_text(grpo_config(f"{name}:by_length"))
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, _, err = run_cli("train", "../sub/post.toml", "--run-dir", "run", "--no-progress", "--max-steps", "4")
    assert code == 0, err
    records = [e for _, e in read_seq_events(tmp_path / "elsewhere" / "run") if isinstance(e, RolloutsRecorded)]
    identity = "sha256:" + hashlib.sha256(source.read_bytes()).hexdigest() + ";version=1.0"
    assert records and all(r.reward_code == {f"{name}:by_length": identity} for r in records)
    assert reward_identity(f"{name}:by_length", str(tmp_path / "sub")) == identity


def test_a_module_found_nowhere_is_one_line_naming_where_it_looked(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "sub" / "post.toml").write_text(grpo_config("no_such_rewards_module:f"))
    monkeypatch.chdir(tmp_path / "elsewhere")
    code, _, err = run_cli("train", "../sub/post.toml", "--run-dir", "run", "--no-progress")
    assert code == 2 and "Traceback" not in err, err
    line = one_line(err)
    assert f"beside the config ({tmp_path / 'sub'})" in line and f"working directory ({tmp_path / 'elsewhere'})" in line
    assert not (tmp_path / "elsewhere" / "run").exists()


# Reward functions that import but are no reward function, each with what its one line says.
UNFIT = {
    # written for one string in `answer` (a list arrives)
    "strict": ("return [float(text == answer.strip()) for text in completions]", "failed: AttributeError: 'list'"),
    # breaks on a completion that is no number, as early samples are
    "numeric": ("return [float(text) for text in completions]", "failed: ValueError: could not convert"),
    "per_prompt": ("return [1.0 for _ in set(prompts)]", "returned a list of 2 rewards for 6 completions"),
    "nothing": ("pass", "returned None, not a list or tuple of 6 rewards"),
    "text": ("return ['1'] * len(completions)", "returned '1', not a finite number"),
}


@pytest.mark.parametrize("function", sorted(UNFIT))
def test_a_reward_function_is_tried_before_the_run_records_anything(tmp_path, request, function):
    body, said = UNFIT[function]
    name = unique(request, "unfit")
    (tmp_path / f"{name}.py").write_text(f"def {function}(prompts, completions, completion_ids, *, answer, **fields):\n    {body}\n")
    (tmp_path / "post.toml").write_text(grpo_config(f"{name}:{function}"))
    code, _, err = run_cli("train", tmp_path / "post.toml", "--run-dir", tmp_path / "run", "--no-progress")
    assert code == 2 and "Traceback" not in err, err
    line = one_line(err)
    assert f"reward function {name}:{function}" in line and said in line, line
    assert "tried before the run records anything, on 2 rows of 'reverse'" in line, line
    assert not (tmp_path / "run").exists()  # the pretraining stage before it never started


def test_a_resume_tries_them_before_it_records_anything(tmp_path, request):
    name = unique(request, "resumed")
    source = tmp_path / f"{name}.py"
    source.write_text(MODULE)
    (tmp_path / "post.toml").write_text(grpo_config(f"{name}:by_length"))
    run = tmp_path / "run"
    code, _, err = run_cli("train", tmp_path / "post.toml", "--run-dir", run, "--no-progress", "--max-steps", "1")
    assert code == 0, err
    before = read_seq_events(run)
    source.write_text(MODULE.replace("len(text) / 10", "len(text) / 10 if text.isalpha() else answer.strip()"))
    code, _, err = run_cli("train", tmp_path / "post.toml", "--run-dir", run, "--no-progress")
    assert code == 1 and "Traceback" not in err, err
    assert f"reward function {name}:by_length failed: AttributeError" in one_line(err)
    assert read_seq_events(run) == before  # no RunResumed, no step of the pretraining stage


def test_the_trial_calls_each_function_as_a_rollout_does(tmp_path, request):
    """On the first two train rows of each dataset, three made-up completions each, every argument a
    list aligned with the completions (the docs' promise)."""
    name = unique(request, "recorder")
    (tmp_path / f"{name}.py").write_text(
        "import json, pathlib\n\n"
        "def record(prompts, completions, completion_ids, **fields):\n"
        "    with (pathlib.Path(__file__).parent / 'calls.jsonl').open('a') as out:\n"
        "        out.write(json.dumps([prompts, completions, completion_ids, fields]) + '\\n')\n"
        "    return [0.0] * len(completions)\n"
    )
    config = loads_config(grpo_config(f"{name}:record").replace('"reverse", rate = 1.0', '"reverse", rate = 0.5 }, { name = "add", rate = 0.5'))
    try_rewards(config.stages[1], ExampleSources(config, DataHome()), str(tmp_path))
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 2  # once per dataset
    for call, task in zip(calls, ("reverse", "add"), strict=True):
        rows = [task_texts(task, "train", i) for i in (0, 1)]
        made_up = [text for row in rows for text in (row.answer.removesuffix("\n"), "", TRIAL_GARBAGE)]
        assert call == [
            [row.prompt for row in rows for _ in range(3)],
            made_up,
            [list(text.encode()) for text in made_up],
            {"answer": [row.answer.removesuffix("\n") for row in rows for _ in range(3)]},
        ]


def test_the_logged_mean_reward_is_over_the_scored_completions(tmp_path, request):
    """Half the completions unscored: the record's and the steps' mean reward is the scored half's (1.0,
    not 0.5), and the unscored ones are counted."""
    name = unique(request, "half")
    (tmp_path / f"{name}.py").write_text(MODULE)
    (tmp_path / "post.toml").write_text(grpo_config(f"{name}:every_other"))
    run = tmp_path / "run"
    code, _, err = run_cli("train", tmp_path / "post.toml", "--run-dir", run, "--no-progress", "--max-steps", "4")
    assert code == 0, err
    events = [e for _, e in read_seq_events(run)]
    records = [e for e in events if isinstance(e, RolloutsRecorded)]
    assert records and all((r.mean_reward, r.unscored) == (1.0, 4) for r in records)  # 2 prompts x 4
    steps = [e for e in events if isinstance(e, StepCommitted) and e.stage == 1]
    assert steps and all((e.metrics["reward"], e.metrics["unscored"]) == (1.0, 4.0) for e in steps)
