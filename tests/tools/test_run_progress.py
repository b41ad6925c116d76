"""What `rewind train` and `rewind replay` say while they work, and what a start can no longer strand:
the bar names every pause between steps (checkpoints, evaluations, growth, the trunk's cache), replay's
bar counts towards its last step, a config the log cannot record is refused before anything is written,
and a schedule plot that fails after RunStarted does not stop the run."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rewind.engine.run.loop import pause_note
from rewind.states.events import EpochStarted, StackAppended, StageEntered
from rewind.states.fold import fold
from rewind.states.plan import (
    CacheTrunk,
    DeleteCheckpoints,
    Evaluate,
    TakeCheckpoint,
    Validate,
)
from tests.engine.test_loop import events_of, run_cli, train_args


def bar_lines(err: str) -> list[str]:
    """The bar's redraws (tqdm rewrites one line with carriage returns) and the lines written above it."""
    return [line.strip() for line in re.split(r"[\r\n]+", err) if line.strip()]


@pytest.fixture(scope="module")
def trained_with_bar(tmp_path_factory) -> tuple[Path, str]:
    run = tmp_path_factory.mktemp("bar") / "run"
    args = [a for a in train_args(run) if a != "--no-progress"]
    code, _, err = run_cli(*args)
    assert code == 0, err
    return run, err


def test_the_bar_names_each_pause_before_it(trained_with_bar):
    _, err = trained_with_bar
    draws = [m.groups() for line in bar_lines(err) if (m := re.match(r"(?:(.*?): )?\s*\d+%\|.*?\| (\d+)/20", line))]
    described = [(words, int(step)) for words, step in draws if words]
    assert described[0] == ("evaluating before training", 0)
    assert ("evaluating at the end of stage 0", 11) in described  # tiny's stage 0 ends at step 11 here
    assert ("evaluating at the end of stage 2", 20) in described
    assert {step for words, step in described if words == "writing a checkpoint"} >= {4, 8, 12, 16, 20}
    # The words last until the next step: the redraw of a step carries none.
    assert all(words is None for words, step in draws if step == "1")


def test_pause_notes_cover_the_long_intents_only():
    grow = StackAppended(step=5, tokens=1280, stack=1, num_blocks=2)
    assert pause_note(grow) == "growing the model: 2 block(s) join"
    assert pause_note(CacheTrunk(version=1, num_steps=10, num_rows=80)) == "caching the trunk's activations"
    assert pause_note(TakeCheckpoint(reason="interval")) == "writing a checkpoint"
    assert pause_note(Evaluate(boundary=-1)) == "evaluating before training"
    assert pause_note(Evaluate(boundary=1)) == "evaluating at the end of stage 1"
    assert pause_note(Validate()) == "validating"
    assert pause_note(StageEntered(step=5, tokens=1280, stage=1)) == ""
    assert pause_note(DeleteCheckpoints(names=("00000004-abcdef12",))) == ""


def test_replay_bar_counts_to_the_last_step(trained_with_bar):
    run, _ = trained_with_bar
    code, out, err = run_cli("replay", run, "--to-step", "12")
    assert code == 0, err
    assert "replay: reproducible" in out
    redraws = [line for line in bar_lines(err) if line.startswith("replay:")]
    assert redraws and all("/12 [" in line for line in redraws), redraws


def test_a_config_the_log_cannot_record_writes_nothing(tmp_path):
    run = tmp_path / "run"
    code, _, err = run_cli(*train_args(run, "--set", f"training.tokens=[{2**63}, {2**63}, 1]"))
    assert code == 2
    assert "Traceback" not in err
    assert err.strip().splitlines() == [
        f"rewind: {train_args(run)[1]}: training.tokens[{i}]: must fit a signed 64-bit integer (the log's integers), "
        f"got {2**63}"
        for i in (0, 1)
    ]
    assert not run.exists()


def test_a_schedule_plot_that_fails_does_not_stop_the_run(tmp_path, monkeypatch):
    import rewind.tools.plots as plots

    def broken(*args, **kwargs):
        raise TypeError("ufunc 'isfinite' not supported for the input types")

    monkeypatch.setattr(plots, "plot_schedule", broken)
    run = tmp_path / "run"
    code, out, err = run_cli(*train_args(run))
    assert code == 0, err
    assert "run finished" in out
    assert f"rewind: warning: {run / 'plots' / 'schedule.png'} not written (TypeError: ufunc" in err
    assert fold(events_of(run)).finished


WORDS = ("abc", "hello", "xyzzy", "plugh", "frob", "quux", "wand", "mox", "orb", "elk")
SFT_ROWS = [{"q": f"rev {w}=", "a": w[::-1]} for w in WORDS]
# Two sft stages on the 10 rows above (8 train, 2 held out), 8 rows a step: 8 steps, then 4. Every step
# reads the train split whole, so an epoch begins at nearly every step: 11 in all.
SMALL_SFT = """
[run]
seed = 1

[architecture]
block_size = 32
num_layers = 1
num_heads = 2
d_model = 16

[training]
batch_size = 8

[optimization]
schedule = "constant"

[logging]
report_interval = 1000

[[stages]]
strategy = "sft"
tokens = 2_048
datasets = [{{ name = "qa" }}]

[[stages]]
strategy = "sft"
tokens = 1_024
datasets = [{{ name = "qa" }}]

[data.qa]
kind = "jsonl"
path = "{rows}"
prompt_field = "q"
response_field = "a"
validation_fraction = 0.2
"""


def test_a_small_dataset_read_over_and_over_says_so_twice_a_stage_not_once_an_epoch(tmp_path):
    """Its first epoch of a stage at once, and the rest of that stage's together when the stage (or the
    run) ends: what a 200-row sft dataset said 33 times in one stage."""
    rows = tmp_path / "qa.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in SFT_ROWS))
    config = tmp_path / "sft.toml"
    config.write_text(SMALL_SFT.format(rows=rows))
    code, _, err = run_cli("train", config, "--run-dir", tmp_path / "run", "--no-progress")
    assert code == 0, err
    began = [(e.epoch, e.step + 1) for e in events_of(tmp_path / "run") if isinstance(e, EpochStarted)]
    assert began == [(epoch, epoch + 1) for epoch in range(1, 12)]  # step N + 1 begins epoch N
    said = [line for line in err.splitlines() if "epoch" in line]
    assert said == [
        "rewind: dataset 'qa': all its 8 train rows read; epoch 1 begins at step 2 (any more in stage 0 are "
        "said once, at its end)",
        "rewind: dataset 'qa': epochs 2-7 began too in stage 0, the last at step 8",
        "rewind: dataset 'qa': all its 8 train rows read; epoch 8 begins at step 9 (any more in stage 1 are "
        "said once, at its end)",
        "rewind: dataset 'qa': epochs 9-11 began too in stage 1, the last at step 12",
    ]
