"""docs/posttraining.md's "Your own data" as a user follows it: the page's jsonl rows (more of them, in
the same shape), its reward module and its config written from the page's text into a folder, and its
commands run there: the schedule checks, the run trains both stages on the file, its grpo batches are
scored by the page's functions, and `rewind rollouts` shows them."""

from __future__ import annotations

import json
import re
import shlex
import sys

import pytest

from rewind.states.events import RolloutsRecorded, StageEntered, StepCommitted
from rewind.stores.runs import read_seq_events
from tests.conftest import REPO
from tests.engine.test_loop import one_line, run_cli

PAGE = (REPO / "docs" / "posttraining.md").read_text()
_START = PAGE.index("## Your own data")
SECTION = PAGE[_START : PAGE.index("\n## ", _START + 1)]  # to the next section


def block(language: str, text: str = SECTION) -> str:
    (found,) = re.findall(rf"```{language}\n(.*?)```", text, re.S)
    return found


def rows() -> list[dict]:
    """The page's rows, then more of the same shape (a file of three rows has too few to hold out any)."""
    shown = [json.loads(line) for line in block("json").splitlines()]
    assert [sorted(r) for r in shown] == [["answer", "question"]] * 3
    more = [{"question": f"{a} + {b} =", "answer": str(a + b)} for a in range(8) for b in range(8)]
    return shown + more


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    (tmp_path / "my_rewards.py").write_text(block("python", PAGE))  # the module the page shows above
    (tmp_path / "post.toml").write_text(block("toml"))
    sys.modules.pop("my_rewards", None)
    yield tmp_path
    sys.modules.pop("my_rewards", None)


@pytest.mark.slow  # trains 28 steps, grpo sampling included (about 10 s)
def test_the_page_s_files_and_commands_train_an_sft_then_grpo_run(folder, monkeypatch):
    monkeypatch.chdir(folder)
    commands = [shlex.split(line) for line in block("bash").splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["rewind", "schedule"], ["rewind", "train"], ["rewind", "rollouts"]]
    # The page's three rows alone, copied as they are: refused in the one line the page quotes, which
    # says how many rows it takes, nothing recorded.
    full = (folder / "qa.jsonl").read_text()
    (folder / "qa.jsonl").write_text(block("json"))
    code, _, err = run_cli(*commands[1][1:], "--no-progress")
    quoted = re.search(r"`(too small: 3 rows .*?), \.\.\.`", " ".join(SECTION.split())).group(1)
    assert code == 2 and one_line(err) == (
        f"rewind: dataset 'qa_sft': {folder / 'qa.jsonl'}: {quoted}, or a validation_path, "
        "or a validation_fraction of at least 0.34"
    ), err
    assert not (folder / "runs").exists()
    (folder / "qa.jsonl").write_text(full)
    outputs = []
    for words in commands:
        extra = ["--no-progress"] if words[1] == "train" else []
        code, out, err = run_cli(*words[1:], *extra)
        assert code == 0, (words, err)
        outputs.append(out + err)
    assert "grpo" in outputs[0] and "sft" in outputs[0]
    events = [e for _, e in read_seq_events(folder / "runs" / "qa")]
    entered = [e.stage for e in events if isinstance(e, StageEntered)]
    steps = [e for e in events if isinstance(e, StepCommitted)]
    assert entered == [0, 1] and len(steps) == 28  # 20 sft steps, 8 grpo steps: the page's arithmetic
    batches = [e for e in events if isinstance(e, RolloutsRecorded)]
    assert batches and all(set(b.reward_code) == {"exact_match", "my_rewards:first_letter"} for b in batches)
    assert all(s.metrics for s in steps[20:]) and "reward" in steps[-1].metrics
    assert "mean reward" in outputs[2] and "(qa_grpo, row " in outputs[2]  # the batch shown, its prompts named
