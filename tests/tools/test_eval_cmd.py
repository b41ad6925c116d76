"""`rewind eval` on the tiny run of test_sample_cmd.py: a checkpoint's figures are the ones the run logged
at that boundary (same rows, same model, same kernels: bit for bit), perplexity and bits per byte follow
from the loss, accuracy only where there are answers, nothing is written, and mistakes are one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from rewind.states.events import Evaluated
from rewind.stores.runs import read_seq_events
from tests.tools.test_sample_cmd import cli, committed, one_line_error, trained_run


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return trained_run(tmp_path_factory)


def evaluate(run: Path, *args) -> dict:
    code, out, err = cli("eval", run, *args, "--json")
    assert code == 0, err
    return json.loads(out)


def logged_evaluations(run: Path) -> dict[int, Evaluated]:
    return {e.step: e for _, e in read_seq_events(str(run)) if isinstance(e, Evaluated)}


@pytest.mark.parametrize("step", [3, 5])  # the boundary checkpoint (one stack) and the end (grown, NF4 + LoRA)
def test_a_checkpoint_scores_what_the_run_logged_at_that_boundary(run, step):
    logged = logged_evaluations(run)[step]
    for name in ("grammar", "add"):
        result = evaluate(run, "--dataset", name, "--at-step", step)
        assert (result["step"], result["checkpoint"]) == (step, committed(run)[step])
        assert result["samples"] == 8  # the run's eval_samples
        assert result["loss"] == logged.losses[name]  # bit for bit
        assert result["perplexity"] == math.exp(result["loss"])
        # Byte tokens: one byte per target token, bits per byte is the loss in bits.
        assert result["bytes"] == result["tokens"] > 0
        assert result["bits_per_byte"] == result["loss"] / math.log(2)
        if name == "add":
            assert result["accuracy"] == logged.scores["add"]
        else:
            assert result["accuracy"] is None  # running text: no answers to be right about


def test_samples_and_the_default_checkpoint(run):
    result = evaluate(run, "--dataset", "add", "--samples", "3")
    assert result["step"] == 5 and result["samples"] == 3
    assert 0 < result["tokens"] < evaluate(run, "--dataset", "add")["tokens"]


def test_the_report_in_words(run):
    code, out, err = cli("eval", run, "--dataset", "add")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("add at step 5 (checkpoint ") and "8 validation rows" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["loss", "perplexity", "bits", "accuracy"]
    code, out, _ = cli("eval", run, "--dataset", "grammar")
    assert code == 0 and "accuracy" not in out


def test_eval_writes_nothing_to_the_run(run):
    def files() -> dict[str, tuple[int, int]]:
        return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}

    before = files()
    evaluate(run, "--dataset", "add")
    assert files() == before


@pytest.mark.parametrize(
    ("args", "exit_code", "message"),
    [
        (["--dataset", "nope"], 2, "--dataset nope: not a dataset of the run (known: add, grammar"),
        (["--dataset", "add", "--samples", "0"], 2, "--samples 0: must be at least 1"),
        (["--dataset", "add", "--at-step", "4"], 2, "checkpoints exist at steps 3, 5"),
        ([], 2, "the following arguments are required: --dataset"),
    ],
)
def test_mistakes_are_one_line(run, args, exit_code, message):
    assert message in one_line_error(*cli("eval", run, *args), exit_code=exit_code)
