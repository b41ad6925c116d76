"""`rewind train` on bad input to a post-training stage: a malformed JSONL row or a parquet file without
the columns an sft, dpo or grpo dataset names, and every setting of `[stages.sft]`, `[stages.dpo]` and
`[stages.grpo]` set to nonsense with `--set`. Each is one line on stderr, exit 2 (the house's exit for
input refused before a run starts, data files included), no traceback, and no run directory written.
Valid extremes (a grpo prompt longer than the context: left-truncated) train."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.engine.test_loop import one_line, run_cli
from tests.engine.test_posttrain_adversarial import GRPO, config_text

# The fields of each strategy's user dataset, a good row, and the stage's own settings.
FIELDS = {
    "sft": ({"prompt_field": "q", "response_field": "a"}, {"q": "1+1=", "a": "2"}),
    "dpo": (
        {"prompt_field": "q", "chosen_field": "c", "rejected_field": "r"},
        {"q": "1+1=", "c": "2", "r": "3"},
    ),
    "grpo": ({"prompt_field": "q", "answer_field": "ans"}, {"q": "1+1=", "ans": "2"}),
}
SETTINGS = {"sft": "", "dpo": "", "grpo": "grpo = { group_size = 4, max_new_tokens = 8 }"}


def user_config(folder: Path, strategy: str, kind: str = "jsonl") -> Path:
    """A run whose `strategy` stage trains on the user dataset d (d.jsonl or d.parquet) alone."""
    fields = "\n".join(f'{key} = "{value}"' for key, value in FIELDS[strategy][0].items())
    text = config_text(strategy, SETTINGS[strategy]).replace(
        'datasets = [{ name = "sort", rate = 0.5 }, { name = "reverse", rate = 0.5 }]',
        'datasets = [{ name = "d", rate = 1.0 }]',
    )
    path = folder / "run.toml"
    path.write_text(f'{text}\n[data.d]\nkind = "{kind}"\npath = "{folder / f"d.{kind}"}"\n{fields}\n')
    return path


def write_rows(folder: Path, strategy: str, bad: object = None, line: int = 6) -> None:
    """40 good rows, the `line`-th (from 1) replaced by `bad` (a dict, or a raw line when a str)."""
    rows = [json.dumps(FIELDS[strategy][1])] * 40
    if bad is not None:
        rows[line - 1] = bad if isinstance(bad, str) else json.dumps(bad)
    (folder / "d.jsonl").write_text("".join(row + "\n" for row in rows))


def refused(config: Path, run: Path, *sets: str) -> str:
    """Train `config` expecting a refusal; its one line (without "rewind: ")."""
    args = [part for s in sets for part in ("--set", s)]
    code, _, err = run_cli("train", config, "--run-dir", run, "--no-progress", *args)
    assert code == 2 and "Traceback" not in err, err
    assert not run.exists() or not (run / "events").exists()  # nothing recorded
    return one_line(err).removeprefix("rewind: ")


BAD_ROWS = [
    ("sft", {"q": "x"}, "no 'a' field"),
    ("sft", {"q": "x", "a": 3}, "field 'a' is int, not a string"),
    ("sft", {"q": "x", "a": None}, "field 'a' is NoneType, not a string"),
    ("sft", {"q": "", "a": "3"}, "field 'q' is empty"),
    ("sft", "[1, 2]", "a JSON list, not an object"),
    ("sft", "{not json", "not valid JSON"),
    ("dpo", {"q": "x", "c": "1"}, "no 'r' field"),
    ("dpo", {"q": "x", "c": "1", "r": ["1"]}, "field 'r' is list, not a string"),
    ("dpo", {"q": "", "c": "1", "r": "2"}, "field 'q' is empty"),
    ("dpo", {"q": "x", "c": "same", "r": "same"}, "fields 'c' and 'r' are the same"),
    ("grpo", {"q": "x"}, "no 'ans' field"),
    ("grpo", {"q": "x", "ans": 2}, "field 'ans' is int, not a string"),
    ("grpo", {"q": "", "ans": "2"}, "field 'q' is empty"),
]


@pytest.mark.parametrize(("strategy", "bad", "said"), BAD_ROWS)
def test_a_malformed_row_is_one_line_naming_file_and_line_and_nothing_is_recorded(
    tmp_path, strategy, bad, said
):
    config = user_config(tmp_path, strategy)
    write_rows(tmp_path, strategy, bad)
    line = refused(config, tmp_path / "run")
    assert line.startswith(f"dataset 'd': {tmp_path / 'd.jsonl'}:6: ") and said in line, line


@pytest.mark.parametrize(
    ("strategy", "columns", "said"),
    [
        ("sft", {"q": ["a"] * 20, "b": ["b"] * 20}, "no column 'a' (columns: q, b)"),
        ("dpo", {"q": ["a"] * 20, "c": ["b"] * 20, "r": [1] * 20}, "column 'r' holds int64, not strings"),
        ("grpo", {"question": ["a"] * 20}, "no column 'q' (columns: question)"),
        ("grpo", {"q": [None] * 20, "ans": ["x"] * 20}, "column 'q' holds null, not strings"),
    ],
)
def test_a_parquet_file_without_the_columns_is_one_line(tmp_path, strategy, columns, said):
    config = user_config(tmp_path, strategy, "parquet")
    pq.write_table(pa.table(columns), tmp_path / "d.parquet")
    line = refused(config, tmp_path / "run")
    assert line == f"dataset 'd': {tmp_path / 'd.parquet'}: {said}"


def test_a_grpo_prompt_longer_than_the_context_is_left_truncated_and_trains(tmp_path):
    config = user_config(tmp_path, "grpo")
    row = json.dumps({"q": "x" * 500 + "1+1=", "ans": "2"})
    (tmp_path / "d.jsonl").write_text((row + "\n") * 40)  # every prompt 504 bytes, the context 64
    code, _, err = run_cli("train", config, "--run-dir", tmp_path / "run", "--no-progress")
    assert code == 0, err
    code, out, err = run_cli("rollouts", tmp_path / "run", "--step", 2, "--json")
    assert code == 0, err
    prompts = [p["text"] for p in json.loads(out)["prompts"]]
    assert prompts and all(p == "x" * (64 - 8 - 4) + "1+1=" for p in prompts)  # room left for 8 new tokens


@pytest.mark.parametrize(
    ("strategy", "bad"),
    [
        ("sft", {"q": "x", "a": "line one\nline two"}),
        ("dpo", {"q": "x", "c": "a\nb", "r": "c"}),
        ("grpo", {"q": "x", "ans": "a\nb"}),
    ],
)
def test_a_response_holding_the_end_token_is_refused_in_one_line(tmp_path, strategy, bad):
    config = user_config(tmp_path, strategy)
    write_rows(tmp_path, strategy, bad)
    line = refused(config, tmp_path / "run")
    assert f"{tmp_path / 'd.jsonl'}:6" in line


NONSENSE = [
    ("sft", "stages[1].sft.packing=yes", "stages[1].sft.packing: expected `bool`, got `str`"),
    ("sft", "stages[1].sft=[]", "stages[1].sft: expected a table, got a list"),
    ("sft", "stages[1].sft.pack=true", "stages[1].sft.pack: unknown key"),
    (
        "sft",
        "stages[1].strategy=rl",
        "stages[1].strategy: expected one of distill, dpo, grpo, pretrain, sft, got 'rl'",
    ),
    ("sft", "stages[1].dpo.beta=0.1", "stages[1].dpo: settings of "),
    (
        "grpo",
        "stages[1].sft.packing=true",
        "stages[1].sft: settings of an sft stage, but this stage's strategy is",
    ),
    ("dpo", "stages[1].dpo.beta=0", "stages[1].dpo.beta: must be positive"),
    ("dpo", "stages[1].dpo.beta=inf", "stages[1].dpo.beta: must be a finite number, got inf"),
    ("dpo", "stages[1].dpo.beta=nan", "stages[1].dpo.beta: must be a finite number, got nan"),
    ("dpo", "stages[1].dpo.loss=foo", "stages[1].dpo.loss: expected one of hinge, ipo, robust, sigmoid"),
    ("dpo", "stages[1].dpo.label_smoothing=0.5", "stages[1].dpo.label_smoothing: must be in [0, 0.5)"),
    ("dpo", "stages[1].dpo.sft_weight=-1", "stages[1].dpo.sft_weight: must be >= 0"),
    ("dpo", "stages[1].dpo=5", "stages[1].dpo: expected a table, got an integer"),
    ("dpo", "stages[1].refresh_reference=false", "stages[1].refresh_reference: a dpo stage compares"),
    ("grpo", "stages[1].grpo.group_size=0", "stages[1].grpo.group_size: at least 2"),
    ("grpo", "stages[1].grpo.group_size=3", "is not a multiple of group_size 3"),
    ("grpo", "stages[1].grpo.group_size=x", "stages[1].grpo.group_size: expected `int`, got `str`"),
    ("grpo", "stages[1].grpo.temperature=0", "stages[1].grpo.temperature: must be positive"),
    (
        "grpo",
        "stages[1].grpo.temperature=inf",
        "stages[1].grpo.temperature: must be a finite number, got inf",
    ),
    (
        "grpo",
        "stages[1].grpo.max_new_tokens=64",
        "stages[1].grpo.max_new_tokens: must be in [1, block_size - 1",
    ),
    (
        "grpo",
        "stages[1].grpo.max_new_tokens=0",
        "stages[1].grpo.max_new_tokens: must be in [1, block_size - 1",
    ),
    ("grpo", "stages[1].grpo.num_iterations=0", "stages[1].grpo.num_iterations: must be >= 1"),
    (
        "grpo",
        "stages[1].grpo.loss_type=ppo",
        "stages[1].grpo.loss_type: expected one of bnpo, dapo, dr_grpo, grpo",
    ),
    ("grpo", "stages[1].grpo.epsilon_low=2", "stages[1].grpo.epsilon_low: must be in [0, 1]"),
    ("grpo", "stages[1].grpo.epsilon_high=-1", "stages[1].grpo.epsilon_high: must be >= 0"),
    ("grpo", "stages[1].grpo.kl_beta=-1", "stages[1].grpo.kl_beta: must be >= 0"),
    ("grpo", "stages[1].grpo.kl_beta=nan", "stages[1].grpo.kl_beta: must be a finite number, got nan"),
    ("grpo", "stages[1].grpo.kl_estimator=k9", "stages[1].grpo.kl_estimator: expected one of k1, k2, k3"),
    (
        "grpo",
        "stages[1].grpo.scale_rewards=x",
        "stages[1].grpo.scale_rewards: expected one of batch, group, none",
    ),
    ("grpo", "stages[1].grpo.mask_truncated_completions=maybe", "expected `bool`, got `str`"),
    ("grpo", "stages[1].grpo.rewards=[]", "stages[1].grpo.rewards: at least one reward function"),
    (
        "grpo",
        'stages[1].grpo.rewards=[{function="foo"}]',
        "stages[1].grpo.rewards[0].function: 'foo' is neither a built-in reward",
    ),
    ("grpo", "stages[1].grpo.rewards=[{weight=0}]", "stages[1].grpo.rewards[0].weight: must be positive"),
    (
        "grpo",
        "stages[1].grpo.rewards=[{weight=inf}]",
        "stages[1].grpo.rewards[0].weight: must be a finite number",
    ),
    ("grpo", "stages[1].grpo.rewards=5", "stages[1].grpo.rewards: expected a list, got an integer"),
    ("grpo", "stages[1].grpo.top_k=5", "stages[1].grpo.top_k: unknown key"),
    ("grpo", "stages[1].overlap=0.5", "no fade out of"),
    ("grpo", "stages[1].beta=0.1", "stages[1].beta: a grpo stage's KL to the reference is grpo.kl_beta"),
]


@pytest.mark.parametrize(("strategy", "setting", "said"), NONSENSE, ids=[s for _, s, _ in NONSENSE])
def test_a_nonsense_setting_is_one_line_with_its_path_and_nothing_is_recorded(
    tmp_path, strategy, setting, said
):
    text = GRPO if strategy == "grpo" else config_text(strategy)
    if strategy == "grpo" and "overlap" in setting:  # (a fade needs a stage after it)
        text += '\n[[stages]]\ntokens = 512\ndatasets = [{ name = "grammar", rate = 1.0 }]\n'
    config = tmp_path / "run.toml"
    config.write_text(text)
    line = refused(config, tmp_path / "run", setting)
    assert said in line, line


@pytest.mark.parametrize("table", ["dpo", "grpo"])
def test_a_settings_table_on_another_strategy_reads_a_dpo_or_a_grpo_stage(tmp_path, table):
    config = tmp_path / "run.toml"
    config.write_text(config_text("sft"))
    line = refused(
        config,
        tmp_path / "run",
        f"stages[1].{table}.num_iterations=1" if table == "grpo" else "stages[1].dpo.beta=0.1",
    )
    assert f"stages[1].{table}: settings of a {table} stage, but this stage's strategy is 'sft'" in line, line


# --- your own reward functions ("module:function") -----------------------------------------------------

REWARDS_MODULE = """__version__ = "1.0"
def raises(prompts, completions, completion_ids, **fields):
    return [1.0 / 0 for _ in completions]
def huge(prompts, completions, completion_ids, **fields):
    return [1e39 * (i % 2) for i, _ in enumerate(completions)]
def generator(prompts, completions, completion_ids, **fields):
    return (1.0 for _ in completions)
def length(prompts, completions, completion_ids, **fields):
    return [float(len(c)) for c in completions]
"""


def cli_in(folder: Path, *args: str) -> subprocess.CompletedProcess:
    """`rewind ARGS` run from `folder` (a reward module is imported from the directory rewind runs from)."""
    return subprocess.run(
        [sys.executable, "-m", "rewind.tools.cli", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )


def train_with_reward(folder: Path, function: str, *extra: str) -> subprocess.CompletedProcess:
    """`rewind train` of the grpo config scored by `function`, run from `folder` (where my_rewards.py is)."""
    (folder / "my_rewards.py").write_text(REWARDS_MODULE)
    (folder / "grpo.toml").write_text(GRPO)
    sets = ["--set", f'stages[1].grpo.rewards=[{{function="{function}"}}]']
    return cli_in(folder, "train", "grpo.toml", "--run-dir", "run", "--no-progress", *sets, *extra)


@pytest.mark.parametrize(
    "function", ["nosuchmodule:f", "my_rewards:raises", "my_rewards:generator", "os:getcwd"]
)
def test_a_reward_function_that_cannot_score_is_one_line(tmp_path, function):
    result = train_with_reward(tmp_path, function)
    assert result.returncode in (1, 2) and "Traceback" not in result.stderr, result.stderr
    assert function in one_line(result.stderr)


def test_a_reward_module_that_does_not_import_is_refused_before_anything_is_recorded(tmp_path):
    result = train_with_reward(tmp_path, "nosuchmodule:f")
    assert result.returncode != 0
    assert not (tmp_path / "run" / "events").exists()


def test_a_reward_beyond_float32_is_refused_naming_its_function(tmp_path):
    result = train_with_reward(tmp_path, "my_rewards:huge")
    assert result.returncode != 0 and "my_rewards:huge" in one_line(result.stderr), result.stderr


def test_a_resume_under_changed_reward_code_is_refused_and_records_nothing(tmp_path):
    result = train_with_reward(tmp_path, "my_rewards:length", "--max-steps", "3")  # stopped inside a window
    assert result.returncode == 0, result.stderr
    before = {p.name: p.read_bytes() for p in (tmp_path / "run" / "events").iterdir()}
    (tmp_path / "my_rewards.py").write_text(REWARDS_MODULE + "# changed\n")
    result = cli_in(tmp_path, "resume", "run", "--no-progress")
    assert result.returncode == 1
    assert "reward function my_rewards:length changed since the run scored with it" in one_line(result.stderr)
    assert {p.name: p.read_bytes() for p in (tmp_path / "run" / "events").iterdir()} == before


@pytest.mark.parametrize("command", ["resume", "replay"])
def test_a_resume_or_replay_whose_reward_module_is_gone_is_one_line(tmp_path, command):
    result = train_with_reward(tmp_path, "my_rewards:length", "--max-steps", "3")
    assert result.returncode == 0, result.stderr
    before = {p.name: p.read_bytes() for p in (tmp_path / "run" / "events").iterdir()}
    (tmp_path / "my_rewards.py").unlink()
    result = cli_in(tmp_path, command, "run", *(["--no-progress"] if command == "resume" else []))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "my_rewards" in result.stderr.replace("\r", "\n").splitlines()[-1]
    assert {p.name: p.read_bytes() for p in (tmp_path / "run" / "events").iterdir()} == before
