"""docs/posttraining.md's "Distillation" section tells the story of examples/distill.toml with its figures:
this trains the example and checks every figure the section's example quotes.

The run's figures depend on the kind of machine (torch build, CPU capability), as the README demo's do:
on the kind that made docs/figures/ (its machine.json) the quoted table and every figure of the story
must be the run's exactly, each decimal the run's value rounded as quoted; elsewhere the story holds with
margins (as tests/docs/test_posttrain_example.py holds examples/posttrain.toml's): sort learnt, mostly
forgotten while learning reverse, recovered by the distill stage while reverse slips back, the KL falling
and the teacher's mean log-prob of the student's completions rising. The counts (steps a stage, rollout
batches, prompts x completions) and the config figures are checked on every machine."""

from __future__ import annotations

import json
import re
import tomllib

import pytest

from rewind.states.events import Evaluated, RolloutsRecorded, StepCommitted
from tests.conftest import EXAMPLES
from tests.docs.readme_figures import DOCS_DIR, FIGURES_DIR, machine_fingerprint
from tests.engine.test_loop import events_of, run_cli

PAGE = DOCS_DIR / "posttraining.md"
TABLE_HEADING = "answer-token accuracy before training and at each stage boundary"
_DECIMAL = re.compile(r"-?\d+\.\d+")


def section() -> str:
    text = PAGE.read_text()
    start = text.index("\n## Distillation\n")
    return text[start : text.index("\n## ", start + 1)]


def story() -> str:
    """The example's paragraphs: from "**The example**" to the end of the section, the table left out,
    on one line (the page wraps its prose anywhere)."""
    example = section()[section().index("**The example**") :]
    table = example[example.index("```\n$ rewind train") : example.index("```\n(from its output")]
    return " ".join(example.replace(table, "").split())


def quoted_table() -> list[str]:
    example = section()[section().index("```\n$ rewind train examples/distill.toml") :]
    block = example.split("```")[1].strip("\n").splitlines()
    assert block[0] == "$ rewind train examples/distill.toml --run-dir runs/distill"
    return block[1:]


def printed_table(out: str) -> list[str]:
    lines = out.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith(TABLE_HEADING))
    return lines[start : start + 7]


def same_machine_kind() -> bool:
    recorded, here = json.loads((FIGURES_DIR / "machine.json").read_text()), machine_fingerprint()
    return all(recorded[key] == here[key] for key in ("torch", "cpu_capability", "machine"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("distill") / "run"
    code, out, err = run_cli("train", EXAMPLES / "distill.toml", "--run-dir", run, "--no-progress")
    assert code == 0, err
    return out, events_of(run)


def figures(out: str, events: list) -> dict[str, float]:
    """The run's figures the story quotes, by name."""
    rows = [line.split() for line in printed_table(out)[2:]]
    assert [row[0] for row in rows] == ["(start)", "0", "1", "2", "3"]
    sort, reverse = ([float(row[k]) for row in rows[1:]] for k in (1, 2))  # after stages 0..3
    kl = [e.loss for e in events if isinstance(e, StepCommitted) and e.stage == 3]
    batches = [e.mean_reward for e in events if isinstance(e, RolloutsRecorded)]
    return {
        "sort after sort": sort[1], "sort after reverse": sort[2], "sort after distill": sort[3],
        "reverse after sort": reverse[1], "reverse after reverse": reverse[2], "reverse after distill": reverse[3],
        "kl first 10": sum(kl[:10]) / 10, "kl last 10": sum(kl[-10:]) / 10,
        "reward first batch": batches[0], "reward last batch": batches[-1],
    }  # fmt: skip


def sentences(f: dict[str, float]) -> list[str]:
    """The story's sentences that quote figures, written from the run's figures as the page rounds them."""
    return [
        f"Learning `reverse` ({f['reverse after sort']:.2f} -> {f['reverse after reverse']:.2f}) costs `sort` most of "
        f"what the sft stage taught it ({f['sort after sort']:.2f} -> {f['sort after reverse']:.2f})",
        f"brings `sort` back to {f['sort after distill']:.2f}, while `reverse`, which nothing trains on there, "
        f"slips back to {f['reverse after distill']:.2f}",
        f"the KL falls from {f['kl first 10']:.2f} nats per token (the mean of its first 10 steps) to "
        f"{f['kl last 10']:.2f} (its last 10)",
        f"rises from {f['reward first batch']:.2f} (the first batch) to {f['reward last batch']:.2f} (the last)",
    ]


@pytest.mark.slow
def test_the_distillation_section_quotes_the_examples_run(trained):
    out, events = trained
    f = figures(out, events)
    # The table printed is the record's (Evaluated), rounded as printed.
    scores = {e.boundary: e.scores for e in events if isinstance(e, Evaluated)}
    table = printed_table(out)
    for boundary, line in zip((-1, 0, 1, 2, 3), table[2:], strict=True):
        assert line.split()[1:] == [f"{scores[boundary]['sort']:.3f}", f"{scores[boundary]['reverse']:.3f}"]
    if same_machine_kind():
        assert quoted_table() == table
        for sentence in sentences(f):
            assert sentence in story(), sentence
    else:  # another kind of machine: other bits, the same story
        assert f["sort after sort"] > 0.6 and f["sort after reverse"] < f["sort after sort"] - 0.3
        assert f["reverse after reverse"] > f["reverse after sort"] + 0.2
        assert f["sort after distill"] > f["sort after reverse"] + 0.2
        assert f["reverse after distill"] < f["reverse after reverse"] - 0.2
        assert f["kl last 10"] < f["kl first 10"] / 2 and f["reward last batch"] > f["reward first batch"] + 2
    # every decimal the story quotes is one of the figures above (none added without a check)
    quoted = [float(x) for sentence in sentences(f) for x in _DECIMAL.findall(sentence)]
    in_story = [x for x in _DECIMAL.findall(story()) if x != "0.3"]  # (lr_scale: the next test's)
    assert len(in_story) == 10  # a figure added to the story needs its check here
    if same_machine_kind():
        assert sorted(map(float, in_story)) == sorted(quoted)


@pytest.mark.slow
def test_the_examples_counts_and_settings_are_the_sections(trained):
    out, events = trained
    config = tomllib.loads((EXAMPLES / "distill.toml").read_text())
    distill = config["stages"][3]
    steps = [sum(1 for e in events if isinstance(e, StepCommitted) and e.stage == s) for s in range(4)]
    batches = [e for e in events if isinstance(e, RolloutsRecorded)]
    per_step = config["training"]["batch_size"] * config["architecture"]["block_size"]
    said = story()
    assert steps == [50, 200, 200, 100] and "run finished: 550 steps" in out
    assert [stage["tokens"] // per_step for stage in config["stages"]] == steps
    assert (config["training"]["batch_size"], config["architecture"]["block_size"], per_step) == (32, 32, 1024)
    assert "(batch_size 32, block_size 32: 1,024 tokens a step)" in said
    for phrase in ("grammar (50 steps)", "`sort` in an sft stage (200 steps)", "`reverse` in another (200 steps)",
                   "That stage (100 steps at `lr_scale = 0.3`)"):  # fmt: skip
        assert phrase in said, phrase
    assert distill["lr_scale"] == 0.3 and distill["strategy"] == "distill"
    assert distill["distill"] == {"teacher": "reference", "group_size": 2, "max_new_tokens": 10, "num_iterations": 2}
    assert config["stages"][2]["refresh_reference"] is True  # entering `reverse` makes the sort expert the teacher
    assert len(batches) == 50 and {(b.num_prompts, b.group_size) for b in batches} == {(16, 2)}
    assert "50 rollout batches of 16 prompts x 2 completions, two updates each" in said
    # The section's figures: a distill step's loss is its KL, its one metric the completion tokens a row.
    distilling = [e for e in events if isinstance(e, StepCommitted) and e.stage == 3]
    assert all(e.loss == e.kl > 0 and set(e.metrics) == {"completion_tokens"} for e in distilling)
    assert all(0 < e.metrics["completion_tokens"] <= distill["distill"]["max_new_tokens"] for e in distilling)
