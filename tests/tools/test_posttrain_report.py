"""The per-stage post-training table (rewind.tools.posttrain_report) from hand-made records: a row per
boundary, named by its stage, "-" where a figure does not apply, the sampled columns' G named in the
title, a dataset with pairs only said so; a stage's train loss is the mean of its last tenth of finite
steps, as `rewind timeline` takes it."""

from __future__ import annotations

import math

from rewind.states.config_reading import loads_config
from rewind.states.events import Evaluated, StepCommitted
from rewind.states.plan import Evaluate, decide, started_state
from rewind.states.schedule import Schedule
from rewind.tools.posttrain_report import end_losses, posttrain_tables
from tests.engine.test_dpo import DPO_TEXT

CONFIG = loads_config(DPO_TEXT)  # pretrain (unnamed), sft, dpo


def _evaluated(boundary: int, posttraining: dict, score: float = 0.5) -> Evaluated:
    return Evaluated(step=0, tokens=0, boundary=boundary, scores={"sort": score}, losses={"sort": 1.25},
                     posttraining=posttraining)  # fmt: skip


def _cells(line: str) -> list[str]:
    return line.split()


def test_a_row_per_boundary_with_dashes_where_a_figure_does_not_apply():
    sampled = {"pass@1": 0.25, "pass@4": 0.5, "reward": 0.375}
    evaluations = [
        _evaluated(-1, {"sort": sampled}),
        _evaluated(1, {"sort": {**sampled, "win_rate": 0.625}}),
        _evaluated(2, {"sort": {**sampled, "win_rate": 0.75, "dpo_accuracy": 0.875, "dpo_margin": 0.125}}),
    ]
    lines = posttrain_tables(evaluations, CONFIG, {1: 0.5, 2: 0.25})
    assert "pass@G and reward over G = 4 samples" in lines[0]
    assert _cells(lines[2])[3:] == ["accuracy", "loss", "train", "pass@1", "pass@G", "reward", "win", "dpo", "acc", "margin"]
    start, sft, dpo = (_cells(line) for line in lines[3:])
    assert start == ["(start)", "-", "0.500", "1.250", "-", "0.250", "0.500", "0.375", "-", "-", "-"]
    assert sft == ["1", "sft", "0.500", "1.250", "0.500", "0.250", "0.500", "0.375", "0.625", "-", "-"]
    assert dpo == ["2", "dpo", "0.500", "1.250", "0.250", "0.250", "0.500", "0.375", "0.750", "0.875", "0.125"]
    assert len(lines) == 6


def test_a_pretraining_run_has_no_table_and_a_pairs_only_dataset_says_so():
    assert posttrain_tables([_evaluated(-1, {}), _evaluated(0, {})], CONFIG, {}) == []
    lines = posttrain_tables([_evaluated(2, {"prefs": {"dpo_accuracy": 1.0, "dpo_margin": 0.5}})], CONFIG, {})
    assert "no prompts with answers, its pairs only" in lines[0]
    assert _cells(lines[3])[-3:] == ["-", "1.000", "0.500"]


def test_each_dataset_gets_its_table_and_a_named_stage_its_name():
    config = loads_config(DPO_TEXT.replace('strategy = "sft"', 'strategy = "sft"\nname = "teach"'))
    evaluations = [_evaluated(1, {"sort": {"pass@1": 1.0}, "add": {"pass@1": 0.0}})]
    lines = posttrain_tables(evaluations, config, {})
    assert [line.split(",")[1].split("'")[0].strip() for line in lines if line.startswith("post-training")] == [
        "sort", "add"
    ]  # fmt: skip
    assert _cells(lines[3])[:2] == ["teach", "sft"] and lines[4] == ""


def test_the_train_loss_is_the_mean_of_a_stage_s_last_tenth_of_finite_steps():
    def step(n: int, stage: int, loss: float, skipped: bool = False) -> StepCommitted:
        return StepCommitted(step=n, tokens=n, stage=stage, lr=0.0, beta=0.0, loss=loss, skipped=skipped)

    events = [step(n, 0, float(n)) for n in range(1, 21)]  # 20 steps: the last 2
    events += [step(21, 1, 7.0), step(22, 1, math.nan), step(23, 1, 1.0, skipped=True)]
    assert end_losses(events) == {0: 19.5, 1: 7.0}


def test_without_an_evaluation_before_training_the_tables_say_why_they_have_no_start_row():
    """A run evaluates before training only when training.evaluations is set (its boundaries are evaluated
    either way): the tables then end with why their "(start)" row is missing and the setting that gives
    it, and that setting does plan the evaluation before training (with the datasets the boundaries had)."""
    unset = loads_config(DPO_TEXT.replace('evaluations = ["reverse", "sort"]\n', ""))
    assert not unset.training.evaluations and started_state(unset)[1].baseline_step == -1
    evaluations = [_evaluated(1, {"sort": {"pass@1": 0.25}}), _evaluated(2, {"sort": {"pass@1": 0.5}})]
    lines = posttrain_tables(evaluations, unset, {})
    assert [_cells(line)[0] for line in lines[3:5]] == ["1", "2"] and len(lines) == 6
    assert lines[-1] == (
        'no "(start)" row: a run evaluates before training only when its config sets training.evaluations '
        '(evaluations = ["sort"] under [training] gives the row)'
    )
    given = loads_config(DPO_TEXT.replace('evaluations = ["reverse", "sort"]', 'evaluations = ["sort"]'))
    _, state = started_state(given)
    assert state.baseline_step == 0 and decide(state, Schedule(given)) == Evaluate(-1)
    old = posttrain_tables(evaluations, CONFIG, {})  # evaluations set, and no row: a run started without one
    assert old[-1] == 'no "(start)" row: this run was started without an evaluation before training'
    with_start = posttrain_tables([_evaluated(-1, {"sort": {"pass@1": 0.0}}), *evaluations], unset, {})
    assert _cells(with_start[3])[0] == "(start)" and not any(line.startswith("no ") for line in with_start)
