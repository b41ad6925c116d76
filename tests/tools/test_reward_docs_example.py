"""docs/posttraining.md's reward functions as a user meets them: its ```python module and its ```toml
stage, written from the page's text into a folder of their own, train from another working directory
(the module is found beside the config); what the page says arrives at a reward function (its ```text
block) is what a rollout passes, and each function returns what the page says. Also the page's
arithmetic of a stage's token budget (rows x context) against examples/posttrain.toml's schedule."""

from __future__ import annotations

import ast
import hashlib
import math
import re
import sys
import tomllib

import pytest

from rewind.engine.data.examples import task_prompt_row
from rewind.engine.data.tokenizer import ByteTokenizer
from rewind.engine.posttrain.grpo_losses import weighted_rewards
from rewind.engine.posttrain.rewards import score_groups
from rewind.engine.posttrain.rolloutreader import completions_of
from rewind.states.config_reading import loads_config
from rewind.states.events import RolloutsRecorded
from rewind.states.schedule import Schedule
from rewind.stores.rollouts import read_rollouts
from rewind.stores.runs import read_seq_events
from tests.conftest import EXAMPLES, REPO
from tests.engine.test_loop import run_cli
from tests.engine.test_rewards import BASE

PAGE = (REPO / "docs" / "posttraining.md").read_text()
FLAT = " ".join(PAGE.split())  # its prose, line breaks aside


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", PAGE, re.S)


def module_text() -> str:
    (text,) = blocks("python")  # the one module the page shows
    assert text.startswith("# my_rewards.py")
    return text


def stage_text() -> str:
    """The stage the worked example shows (the first block naming the module; "Your own data" has its own
    test: tests/docs/test_own_data_example.py)."""
    return next(b for b in blocks("toml") if "my_rewards:" in b)


def arrivals() -> dict[str, object]:
    """The ```text block that shows one call: each `name = value` and `name -> value` line, evaluated."""
    (text,) = [b for b in blocks("text") if b.startswith("prompts ")]
    found = {}
    for line in text.splitlines():
        name, value = re.match(r"(\w+)\s+(?:=|->)\s+(\[.*?\])(?:\s|$)", line).groups()
        found[name] = ast.literal_eval(value)
    return found


def rewards_of(row) -> list[float | None]:
    """A rollout file's (or a score's) row of rewards, None where the function gave None."""
    return [None if math.isnan(v) else v for v in row.tolist()]


def same(got: list, want: list) -> bool:
    """Equal lists of rewards: None where None, float32's rounding of the others."""
    return len(got) == len(want) and all(
        (a is None) == (b is None) and (a is None or math.isclose(a, b, rel_tol=1e-6))
        for a, b in zip(got, want, strict=True)
    )


@pytest.fixture
def my_rewards(tmp_path):
    """The page's module and stage in tmp/sub (the module by the name the page gives it), and a fresh
    import of it when this test imports it."""
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "my_rewards.py").write_text(module_text())
    (sub / "post.toml").write_text(BASE + "\n" + stage_text())
    sys.modules.pop("my_rewards", None)
    yield sub
    sys.modules.pop("my_rewards", None)


def test_the_page_s_module_and_stage_train_from_another_directory(my_rewards, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    code, _, err = run_cli(
        "train", "../sub/post.toml", "--run-dir", "run", "--no-progress", "--max-steps", "5"
    )
    assert code == 0, err
    records = [e for _, e in read_seq_events(elsewhere / "run") if isinstance(e, RolloutsRecorded)]
    identity = (
        "sha256:" + hashlib.sha256((my_rewards / "my_rewards.py").read_bytes()).hexdigest() + ";version=1.0"
    )
    assert records and all(
        r.reward_code
        == {"exact_match": "builtin", "my_rewards:brevity": identity, "my_rewards:first_letter": identity}
        for r in records
    )
    # The rewards on record are the page's functions of what the page says arrives: prompts, completions
    # and answers as lists aligned with the completions.
    module = sys.modules["my_rewards"]
    decode = ByteTokenizer().decode
    for record in records:
        tensors, _ = read_rollouts(str(elsewhere / "run"), record.path, record.sha256)
        prompts, completions = completions_of(tensors)
        texts = [decode(c[:-1] if c and c[-1] == 10 else c) for c in completions]  # without the end token
        rows = [task_prompt_row("reverse", "train", int(r)) for r in tensors["prompt_rows"]]
        group = len(completions) // len(rows)
        answer = [rows[n // group].fields["answer"] for n in range(len(completions))]
        assert [decode(p) for p in prompts] == [rows[n // group].text for n in range(len(completions))]
        for f, function in ((1, module.brevity), (2, module.first_letter)):
            want = function([decode(p) for p in prompts], texts, [], answer=answer)
            assert same(rewards_of(tensors["rewards"][f]), want), f


def test_what_arrives_is_what_the_page_shows(my_rewards):
    shown = arrivals()
    rows = [task_prompt_row("reverse", "train", i) for i in (1, 2)]
    assert shown["prompts"] == [row.text for row in rows for _ in range(2)]
    assert shown["answer"] == [row.fields["answer"] for row in rows for _ in range(2)]
    assert shown["completion_ids"] == [list(text.encode()) for text in shown["completions"]]
    stage = tomllib.loads(stage_text())["stages"][0]["grpo"]
    names = [reward["function"] for reward in stage["rewards"]]
    recorder = my_rewards / "page_recorder.py"
    recorder.write_text(
        "calls = []\n\ndef record(prompts, completions, completion_ids, **fields):\n"
        "    calls.append((prompts, completions, completion_ids, fields))\n    return [0.0] * len(completions)\n"
    )
    scores = score_groups(
        [*names, "page_recorder:record"], [row.text for row in rows], [row.fields["answer"] for row in rows],
        shown["completion_ids"], ByteTokenizer().decode, str(my_rewards),
    )  # fmt: skip
    calls = sys.modules["page_recorder"].calls
    assert calls == [
        (shown["prompts"], shown["completions"], shown["completion_ids"], {"answer": shown["answer"]})
    ]
    for f, name in enumerate(names):
        assert same(rewards_of(scores[f]), shown[name.partition(":")[2] or name]), name
    weighted = weighted_rewards(scores[: len(names)], [reward["weight"] for reward in stage["rewards"]])
    assert weighted.tolist() == pytest.approx(shown["weighted"], abs=1e-4)


def test_a_stage_s_budget_counts_rows_times_context():
    config = loads_config((EXAMPLES / "posttrain.toml").read_text())
    schedule = Schedule(config)
    per_step = config.training.batch_size * config.architecture.block_size
    assert schedule.tokens_per_step == per_step == 1024
    assert (
        f"batch_size {config.training.batch_size}, block_size {config.architecture.block_size}: 1,024 tokens"
        in FLAT
    )
    said = {
        "sft": "steps of 32 examples",
        "dpo": "steps of 32 pairs",
        "grpo": "steps of 8 prompts x 4 completions",
    }
    for index, stage in enumerate(config.stages):
        if stage.strategy not in said:
            continue
        steps = (
            schedule.entry_steps[index + 1] - schedule.entry_steps[index]
            if index + 1 < len(config.stages)
            else (schedule.num_steps - schedule.entry_steps[index])
        )
        assert steps == stage.tokens // per_step
        quoted = f"{stage.strategy} {stage.tokens:,} / {per_step:,} = {steps} {said[stage.strategy]}"
        assert quoted in FLAT, quoted
    grpo = config.stages[-1].grpo
    assert config.training.batch_size // grpo.group_size == 8 and grpo.group_size == 4
