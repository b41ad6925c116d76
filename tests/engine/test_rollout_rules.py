"""A rollout batch forged consistently, file and record (its bytes rewritten, renamed by their new sha256,
the RolloutsRecorded record and every state digest after it rewritten to match): what no run could have
written is refused by the rules a run follows (rewind.engine.posttrain.rolloutreader.rollout_problems), not by the
hash. A resume inside the window refuses it in one line naming the file and the broken rule, with the way
forward, before anything is recorded; `rewind verify` names the same rule; `rollouts` and `replay` say one
line. The run is the one of tests/engine/test_posttrain_adversarial.py, stopped inside its first window."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from rewind.engine.posttrain.rolloutreader import rollout_problems
from rewind.states.events import CheckpointCommitted, ConfigChanged, RolloutsRecorded, RunStarted
from rewind.states.fold import apply
from rewind.states.state import State
from rewind.stores import snapshots
from rewind.stores.rollouts import read_rollouts, write_rollouts
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import config_of, one_line, run_cli
from tests.engine.test_posttrain_adversarial import GRPO, log_bytes, rollout_records, train
from tests.tools.rundir_forgery import rewrite_log

VOCAB, BLOCK, MAX_NEW = 256, 64, 8  # the run's vocab_size, block_size and max_new_tokens


@pytest.fixture(scope="module")
def mid_window(tmp_path_factory) -> Path:
    """The grpo run stopped after step 3: inside the window whose batch was sampled at step 2."""
    config = tmp_path_factory.mktemp("config") / "grpo.toml"
    config.write_text(GRPO)
    run = tmp_path_factory.mktemp("mid") / "run"
    code, _, err = train(config, run, "--max-steps", 3)
    assert code == 0, err
    assert [r.step for r in rollout_records(run)] == [2]
    return run


def _batch(run: Path) -> tuple[RolloutsRecorded, dict[str, torch.Tensor], dict[str, str]]:
    record = rollout_records(run)[0]  # the first window's
    tensors, metadata = read_rollouts(str(run), record.path, record.sha256)
    return record, {name: tensor.clone() for name, tensor in tensors.items()}, metadata


def forge(run: Path, change: Callable[[dict[str, torch.Tensor]], None], **fields) -> RolloutsRecorded:
    """Rewrite the run's first rollout file by `change` (in place on its tensors) and its record to name the
    new file (and carry `fields`), every CheckpointCommitted's state digest recomputed: a forgery that
    every hash and checksum vouches for."""
    record, tensors, metadata = _batch(run)
    change(tensors)
    (run / record.path).unlink()
    path, sha256 = write_rollouts(str(run), tensors, metadata)
    forged = msgspec.structs.replace(record, path=path, sha256=sha256, **fields)
    state, config, rewritten = State(), None, {}
    for seq, event in read_seq_events(run):
        if isinstance(event, RolloutsRecorded) and event.sha256 == record.sha256:
            event = forged
        elif isinstance(event, CheckpointCommitted) and event.state_sha256:
            event = msgspec.structs.replace(event, state_sha256=snapshots.state_digest(state, config))
        state, rewritten[seq] = apply(state, event), event
        if isinstance(event, RunStarted | ConfigChanged):
            config = event.config
    rewrite_log(run, lambda seq, _: rewritten[seq])
    return forged


def _forge_advantages(t):  # (the run's rewards are all 0: so are its advantages)
    t["advantages"][0] = 1.5


def _token_past_vocabulary(t):
    t["completions"][5, 0] = VOCAB


def _prompt_token_past_vocabulary(t):
    t["prompts"][1, 0] = VOCAB + 7


def _row_past_the_context(t):  # a prompt longer than block_size - max_new_tokens: its row overflows
    width = BLOCK
    prompts = torch.ones((t["prompts"].shape[0], width), dtype=torch.int64)
    prompts[:, : t["prompts"].shape[1]] = t["prompts"]
    t["prompts"], t["prompt_lengths"] = prompts, torch.full_like(t["prompt_lengths"], width)


def _end_token_inside(t):  # a completion that goes on after its end token (the sampler stops there)
    n = int(torch.nonzero(t["finished"] == 1)[0])
    length = int(t["completion_lengths"][n])
    t["completions"][n, : length - 1] = t["completions"][n, length - 1]


def _rewards_changed(t):  # the advantages no longer follow from them (nor the record's mean reward)
    t["rewards"][0, 0] = t["rewards"][0, 0] + 1.0


FORGERIES = {
    "advantages": (_forge_advantages, "advantages do not follow from the rewards"),
    "completion token": (_token_past_vocabulary, f"completions hold token id {VOCAB}"),
    "prompt token": (_prompt_token_past_vocabulary, f"prompts hold token id {VOCAB + 7}"),
    "row length": (_row_past_the_context, f"more than block_size - max_new_tokens = {BLOCK - MAX_NEW}"),
    "end token": (_end_token_inside, "goes on after its end token"),
    "rewards": (_rewards_changed, "advantages do not follow from the rewards"),
}


@pytest.mark.parametrize("case", list(FORGERIES))
def test_a_consistently_forged_rollout_batch_is_refused_by_resume_and_named_by_verify(mid_window, tmp_path, case):
    change, rule = FORGERIES[case]
    run = tmp_path / "run"
    shutil.copytree(mid_window, run)
    forged = forge(run, change)
    before = log_bytes(run)
    code, out, _ = run_cli("verify", run)
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert code == 1 and len(problems) == 1, out  # the forged file, and nothing else the forgery left
    assert forged.path in problems[0] and rule in problems[0], out
    code, _, err = run_cli("resume", run, "--no-progress")
    line = one_line(err)
    assert code == 1 and "Traceback" not in err, err
    assert forged.path in line and rule in line, line
    assert f"rewind fork {run} --at-step {forged.step} " in line, line  # the way forward
    assert log_bytes(run) == before  # nothing recorded, RunResumed neither
    code, _, err = run_cli("rollouts", run)
    assert code == 1 and "Traceback" not in err and forged.path in one_line(err) and rule in err, err
    # Replayed from before the window, its batch is sampled again: not the logged one, a mismatch.
    code, out, err = run_cli("replay", run, "--no-progress")
    assert code == 1 and "Traceback" not in err and "FIRST MISMATCH at step 2" in out, (out, err)
    assert log_bytes(run) == before


def test_a_replay_from_inside_the_window_refuses_the_forged_batch_in_one_line(tmp_path):
    config, run = tmp_path / "grpo.toml", tmp_path / "run"
    config.write_text(GRPO)
    code, _, err = train(config, run, "--max-steps", 4)  # a checkpoint at step 3, inside the window
    assert code == 0, err
    forged = forge(run, _token_past_vocabulary)  # the batch of the window at step 2
    before = log_bytes(run)
    code, _, err = run_cli("replay", run, "--no-progress", "--from-checkpoint", "3")
    line = one_line(err.replace("\r", "\n").splitlines()[-1])
    assert code == 1 and "Traceback" not in err and forged.path in line and "token id 256" in line, err
    assert log_bytes(run) == before


def test_the_way_forward_a_fork_from_before_the_window_verifies_clean(mid_window, tmp_path):
    run, child = tmp_path / "run", tmp_path / "child"
    shutil.copytree(mid_window, run)
    forged = forge(run, _forge_advantages)
    code, _, err = run_cli("fork", run, "--at-step", forged.step, child)
    assert code == 0, err
    code, out, _ = run_cli("verify", child)
    assert code == 0, out


def test_a_mean_reward_the_file_does_not_give_is_refused(mid_window, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(mid_window, run)
    (record,) = rollout_records(run)
    forged = forge(run, lambda t: None, mean_reward=record.mean_reward + 0.5)
    code, out, _ = run_cli("verify", run)
    assert code == 1 and forged.path in out and "mean_reward" in out, out


# --- the rules, one by one, on the run's own batch ------------------------------------------------------


def _check(run: Path, change: Callable[[dict[str, torch.Tensor]], None], **fields) -> list[str]:
    record, tensors, metadata = _batch(run)
    change(tensors)
    return rollout_problems(tensors, metadata, msgspec.structs.replace(record, **fields), config_of(run), end_id=10)


def test_the_runs_own_batch_follows_every_rule(mid_window):
    assert _check(mid_window, lambda t: None) == []


def _infinite_reward(t):
    t["rewards"][0, 3] = float("inf")


def _unfinished_short(t):  # cut before max_new_tokens, yet not ended by the end token
    n = int(torch.nonzero(t["finished"] == 1)[0])
    t["finished"][n] = 0


def _finished_without_end(t):
    n = int(torch.nonzero(t["finished"] == 1)[0])
    t["completions"][n, int(t["completion_lengths"][n]) - 1] = 11


def _reference_dropped(t):
    del t["reference_logprobs"]


@pytest.mark.parametrize(
    ("change", "fields", "said"),
    [
        (_infinite_reward, {}, "rewards hold an infinite value"),
        (_unfinished_short, {}, "cut before max_new_tokens"),
        (_finished_without_end, {}, "does not end with the end token"),
        (_reference_dropped, {}, "no reference_logprobs"),
        (lambda t: None, {"unscored": 3}, "unscored"),
        (lambda t: None, {"num_prompts": 3}, "its record says 3 x 4"),
        (_forge_advantages, {}, "advantages do not follow from the rewards"),
        (_token_past_vocabulary, {}, f"completions hold token id {VOCAB}"),
    ],
    ids=["infinite", "short", "no-end", "no-reference", "unscored", "shape", "advantages", "vocabulary"],
)
def test_each_rule_names_what_breaks_it(mid_window, change, fields, said):
    problems = _check(mid_window, change, **fields)
    assert problems and said in problems[0], problems
