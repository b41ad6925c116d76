"""`rewind rollouts`: a rollout batch shown from its file (show_rollouts, on run directories built by hand),
the record chosen for a step, and the command's errors that need no grpo run. The end-to-end test on a
trained grpo run lives with the engine's grpo tests."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest
import torch

from rewind.engine.data.tokenizer import ByteTokenizer
from rewind.states.events import RunStarted, StepCommitted
from rewind.stores.eventlog import EventLog
from rewind.stores.rollouts import RolloutError, write_rollouts
from rewind.tools.configfile import load_config
from rewind.tools.jsonout import json_safe
from rewind.tools.rollouts_cmd import _decoder, last_rollouts, render, show_rollouts
from tests.engine.test_loop import TINY, run_cli

END = 0  # the end token of these batches (a byte no text here holds)
NAN = float("nan")


def padded(rows: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([row + [END] * (width - len(row)) for row in rows], dtype=torch.int64)


def batch_of(prompts: list[str], completions: list[tuple[str, bool]], rewards: list[list[float]]) -> dict:
    """A rollout batch of byte-token texts; a completion (text, finished) ends with END when finished."""
    prompt_ids = [list(text.encode()) for text in prompts]
    completion_ids = [list(text.encode()) + ([END] if done else []) for text, done in completions]
    n, width = len(completions), max(map(len, completion_ids))
    return {
        "prompt_sources": torch.tensor([1, 0][: len(prompts)], dtype=torch.int64),
        "prompt_rows": torch.tensor([17, 4242][: len(prompts)], dtype=torch.int64),
        "prompts": padded(prompt_ids, max(map(len, prompt_ids))),
        "prompt_lengths": torch.tensor([len(p) for p in prompt_ids], dtype=torch.int64),
        "completions": padded(completion_ids, width),
        "completion_lengths": torch.tensor([len(c) for c in completion_ids], dtype=torch.int64),
        "finished": torch.tensor([done for _, done in completions], dtype=torch.int8),
        "sample_logprobs": torch.zeros(n, width),
        "rewards": torch.tensor(rewards, dtype=torch.float32),
        "advantages": torch.linspace(-1.5, 1.5, n),
        "old_logprobs": torch.zeros(n, width),
    }


PROMPTS = ["1+1=", "2+2="]
COMPLETIONS = [("2", True), ("3\nx", False), ("4", True), ("", True)]
REWARDS = [[1.0, 0.0, 1.0, NAN], [0.5, 0.25, 0.5, 0.0]]


@pytest.fixture
def run(tmp_path) -> tuple[str, dict]:
    """A run directory holding one rollout batch, and the fields of the record that names it."""
    metadata = {"reward_functions": "exact_match,exact_match", "group_size": "2", "policy_step": "6"}
    path, sha256 = write_rollouts(str(tmp_path), batch_of(PROMPTS, COMPLETIONS, REWARDS), metadata)
    record = {
        "step": 7, "tokens": 7 * 256, "stage": 3, "path": path, "sha256": sha256, "num_prompts": 2,
        "group_size": 2, "cursors": {"add": 12}, "mean_reward": 0.4, "unscored": 1,
    }  # fmt: skip
    return str(tmp_path), record


def test_each_prompt_shows_its_group_decoded_with_finish_rewards_and_advantages(run):
    run_dir, record = run
    shown = show_rollouts(run_dir, record, ByteTokenizer().decode, datasets=["add", "sort"])
    assert {key: shown[key] for key in ("step", "stage", "policy_step", "num_prompts", "group_size")} == {
        "step": 7, "stage": 3, "policy_step": 6, "num_prompts": 2, "group_size": 2,
    }  # fmt: skip
    assert shown["reward_functions"] == ["exact_match", "exact_match"]  # a function named twice stays twice
    assert (shown["mean_reward"], shown["unscored"]) == (0.4, 1)  # the record's: over the scored completions
    assert [(p["text"], p["dataset"], p["row"]) for p in shown["prompts"]] == [
        ("1+1=", "sort", 17),
        ("2+2=", "add", 4242),
    ]
    completions = [c for p in shown["prompts"] for c in p["completions"]]
    assert [c["sample"] for c in completions] == [0, 1, 0, 1]
    # The end token is left out of the text (the finish reason says it was there), not out of the tokens.
    assert [(c["text"], c["finish"]) for c in completions] == [
        ("2", "eos"), ("3\nx", "length"), ("4", "eos"), ("", "eos"),
    ]  # fmt: skip
    assert completions[0]["tokens"] == [ord("2"), END]
    assert [c["rewards"] for c in completions] == [[1.0, 0.5], [0.0, 0.25], [1.0, 0.5], [None, 0.0]]
    assert [c["advantage"] for c in completions] == torch.linspace(-1.5, 1.5, 4).tolist()
    json.dumps(json_safe(shown), allow_nan=False)  # strict JSON: no NaN left in it


def test_a_source_outside_the_stages_datasets_is_shown_by_its_index(run):
    run_dir, record = run
    shown = show_rollouts(run_dir, record, ByteTokenizer().decode)
    assert [(p["source"], p["dataset"]) for p in shown["prompts"]] == [(1, None), (0, None)]
    assert "(dataset 1, row 17)" in render(shown)[3]


def test_the_text_output_keeps_one_line_per_completion(run):
    run_dir, record = run
    lines = render(show_rollouts(run_dir, record, ByteTokenizer().decode, datasets=["add", "sort"]))
    assert lines[0] == (
        "rollouts recorded at step 7 (stage 3, sampled by the weights of step 6): 2 prompts x 2 completions, "
        "mean reward 0.4 over the scored completions (1 unscored)"
    )
    assert lines[3] == 'prompt 0 (sort, row 17): "1+1="'
    assert lines[4] == '  [0] eos     exact_match 1  exact_match 0.5  advantage -1.5000  "2"'
    assert lines[5] == '  [1] length  exact_match 0  exact_match 0.25  advantage -0.5000  "3\\nx"'
    assert lines[9] == '  [1] eos     exact_match none  exact_match 0  advantage +1.5000  ""'
    assert len(lines) == 10


@pytest.mark.parametrize(("field", "value"), [("num_prompts", 4), ("group_size", 1)])
def test_a_file_that_is_not_what_its_record_says_is_refused(run, field, value):
    run_dir, record = run
    with pytest.raises(RolloutError) as exc:
        show_rollouts(run_dir, {**record, field: value}, ByteTokenizer().decode)
    assert "\n" not in str(exc.value) and "but its record says" in str(exc.value)


def test_a_missing_or_damaged_file_is_refused(run):
    run_dir, record = run
    file = Path(run_dir) / record["path"]
    file.write_bytes(file.read_bytes()[:-1])
    with pytest.raises(RolloutError, match="damaged"):
        show_rollouts(run_dir, record, ByteTokenizer().decode)
    file.unlink()
    with pytest.raises(RolloutError, match="missing"):
        show_rollouts(run_dir, record, ByteTokenizer().decode)


def test_token_ids_outside_the_models_vocabulary_are_refused_in_one_line(run):
    run_dir, record = run
    with pytest.raises(RolloutError, match=r"token id 50 is outside the model's vocabulary \(50 ids\)"):
        show_rollouts(run_dir, record, _decoder(ByteTokenizer(), 50))


# --- which record a step shows ------------------------------------------------------------------------


class StandIn(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="RolloutsRecorded"):
    """What the log's RolloutsRecorded looks like to the command (its tag, its step)."""

    step: int
    tokens: int = 0


def test_the_batch_of_a_step_is_the_last_recorded_at_or_before_it():
    def step(k):
        return StepCommitted(step=k, tokens=0, stage=0, lr=0.0, beta=0.0, loss=1.0)

    events = [step(1), StandIn(step=1), step(2), step(3), StandIn(step=3), step(4)]
    records = list(enumerate(events))
    assert last_rollouts(records, None) == 4
    assert [last_rollouts(records, k) for k in range(5)] == [None, 1, 1, 4, 4]
    assert last_rollouts(records[:1], None) is None


# --- the command's errors -----------------------------------------------------------------------------


@pytest.fixture
def empty_run(tmp_path) -> Path:
    """A run whose log holds its start and nothing else: no rollout batch."""
    run = tmp_path / "run"
    with EventLog.open(run, "w") as log:
        log.append(RunStarted(step=0, tokens=0, config=load_config(TINY), config_hash="test"))
        log.commit()
    return run


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_run_without_rollouts_is_one_line_and_exit_1(empty_run):
    code, out, err = run_cli("rollouts", empty_run)
    assert (code, out) == (1, "")
    assert "no rollout batch on record" in one_line(err)


def test_a_step_past_the_runs_end_is_a_usage_error(empty_run):
    code, _, err = run_cli("rollouts", empty_run, "--step", "5", "--json")
    assert code == 2 and "--step 5: out of range; the run reached step 0" in one_line(err)


def test_no_run_is_a_usage_error(tmp_path):
    code, _, err = run_cli("rollouts", tmp_path / "nothing")
    assert code == 2 and "no run here" in one_line(err)


@pytest.mark.parametrize("args", [[], ["{run}", "--step", "x"], ["{run}", "--steps", "1"]])
def test_bad_arguments_are_a_usage_error(empty_run, args):
    code, _, err = run_cli("rollouts", *(arg.format(run=empty_run) for arg in args))
    assert code == 2 and one_line(err).startswith("rewind")


def test_nan_free_json_even_when_the_mean_reward_is_nan(run):
    run_dir, record = run
    shown = show_rollouts(run_dir, {**record, "mean_reward": NAN}, ByteTokenizer().decode)
    assert math.isnan(shown["mean_reward"])
    assert json.loads(json.dumps(json_safe(shown), allow_nan=False))["mean_reward"] is None


def _grpo_run(tmp_path, name: str, settings: str = "", *args: str) -> str:
    """A short run whose last stage is grpo (two updates per batch): 10 steps of reverse, then 4 of grpo."""
    from tests.conftest import EXAMPLES
    from tests.engine.test_loop import run_cli

    tiny = (EXAMPLES / "tiny.toml").read_text()
    config = tiny[: tiny.index("[[stages]]")] + (
        '[[stages]]\ntokens = 2_560\ndatasets = [{ name = "reverse", rate = 1.0 }]\noverlap = 0.0\n\n'
        '[[stages]]\nstrategy = "grpo"\ntokens = 1_024\ndatasets = [{ name = "reverse", rate = 1.0 }]\n'
        f"grpo = {{ group_size = 4, max_new_tokens = 6, num_iterations = 2{settings} }}\n"
    )
    path, run = tmp_path / f"{name}.toml", tmp_path / name
    path.write_text(config)
    code, _, err = run_cli("train", path, "--run-dir", run, "--no-progress", *args)
    assert code == 0, err
    return str(run)


def test_the_command_shows_a_real_grpo_run_s_batch_as_its_file_holds_it(tmp_path):
    import json as json_module

    from rewind.states.events import RolloutsRecorded
    from rewind.stores.rollouts import read_rollouts
    from rewind.stores.runs import read_seq_events
    from tests.engine.test_loop import run_cli

    run = _grpo_run(tmp_path, "run")
    records = [e for _, e in read_seq_events(run) if isinstance(e, RolloutsRecorded)]
    assert [r.step for r in records] == [10, 12]  # 10 steps of stage 0, then a batch every 2 steps
    code, out, err = run_cli("rollouts", run, "--step", "11", "--json")
    assert code == 0, err
    shown = json_module.loads(out)
    tensors, _ = read_rollouts(str(run), records[0].path, records[0].sha256)
    assert shown["step"] == 10 and shown["sha256"] == records[0].sha256
    assert (shown["mean_reward"], shown["unscored"]) == (records[0].mean_reward, records[0].unscored)
    code, out, err = run_cli("rollouts", run, "--step", "11")
    assert code == 0, err
    said = f"mean reward {records[0].mean_reward:.4g} over the scored completions ({records[0].unscored} unscored)"
    assert out.splitlines()[0].endswith(said)
    completions = [c for p in shown["prompts"] for c in p["completions"]]
    assert len(completions) == 8
    for n, completion in enumerate(completions):
        length = int(tensors["completion_lengths"][n])
        assert completion["tokens"] == tensors["completions"][n, :length].tolist()
        assert completion["advantage"] == pytest.approx(float(tensors["advantages"][n]))


def test_diff_finds_the_first_rollout_batch_two_runs_sampled_differently(tmp_path):
    from tests.engine.test_loop import run_cli

    a, b = _grpo_run(tmp_path, "a"), _grpo_run(tmp_path, "b", ", temperature = 0.7")
    code, out, err = run_cli("diff", a, b, "--json")
    assert code == 1, err
    import json as json_module

    divergence = json_module.loads(out)["divergence"]
    assert (divergence["step"], divergence["a"]["type"], divergence["field"]) == (10, "RolloutsRecorded", "path")


def test_a_rollout_file_lost_inside_its_window_stops_a_resume_before_it_records_anything(tmp_path):
    """Stopped at step 11, the second update of the window sampled at step 10: its steps need that batch.
    Without the file a resume is one line and leaves the log as it was; with it back, the run ends on
    the straight run's records (and `rewind verify` says which file is missing meanwhile)."""
    import shutil

    from rewind.states.events import RolloutsRecorded, StepCommitted
    from rewind.states.history import effective
    from rewind.stores.runs import read_seq_events
    from tests.engine.test_loop import run_cli

    straight = _grpo_run(tmp_path, "straight")
    stopped = _grpo_run(tmp_path, "stopped", "", "--max-steps", "11")
    (record,) = [e for _, e in read_seq_events(stopped) if isinstance(e, RolloutsRecorded)]
    kept = tmp_path / "kept.safetensors"
    shutil.move(f"{stopped}/{record.path}", kept)
    before = read_seq_events(stopped)
    code, _, err = run_cli("train", tmp_path / "stopped.toml", "--run-dir", stopped, "--no-progress")
    assert code == 1 and err.count("\n") == 1 and "missing" in err and record.path in err, err
    assert read_seq_events(stopped) == before  # nothing recorded
    code, out, _ = run_cli("verify", stopped)
    assert code == 1 and "PROBLEM record: seq" in out and record.path in out
    shutil.move(kept, f"{stopped}/{record.path}")
    code, _, err = run_cli("train", tmp_path / "stopped.toml", "--run-dir", stopped, "--no-progress")
    assert code == 0, err

    def records(run: str) -> list:
        return [e for _, e in effective(read_seq_events(run)) if isinstance(e, StepCommitted | RolloutsRecorded)]

    assert records(stopped) == records(straight)


def test_replay_samples_each_batch_again_and_finds_one_sampled_differently(tmp_path, monkeypatch):
    import json as json_module

    from rewind.engine.posttrain import rollouts
    from tests.engine.test_loop import run_cli

    run = _grpo_run(tmp_path, "run")
    code, out, err = run_cli("replay", run, "--json", "--no-progress")
    assert code == 0 and json_module.loads(out)["num_rollouts_resampled"] == 2, err
    sample = rollouts.sample_completions  # a sampler that draws at another temperature than recorded

    def hotter(*args, **kwargs):
        return sample(*args, **{**kwargs, "temperature": kwargs["temperature"] * 1.5})

    monkeypatch.setattr(rollouts, "sample_completions", hotter)
    code, out, err = run_cli("replay", run, "--no-progress")
    assert code == 1, err
    assert "FIRST MISMATCH at step 10 (seq" in out and "RolloutsRecorded.path" in out, out
