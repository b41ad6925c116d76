"""A distill stage end to end (rewind.engine.posttrain.distill), on the small run of
tests/states/test_distill_rules.py (2 pretraining steps, 2 sft steps that refresh the reference, 6 distill
steps in windows of 2 sampled at steps 4, 6 and 8; about 3 s a run in one thread):

- stopped with --max-steps inside a window, or SIGKILLed inside one, it resumes to the straight run's
  tensors and its very RolloutsRecorded records, reading the window's batch back (nothing sampled again);
- `rewind replay` samples every batch again and recomputes every step, bit for bit;
- a teacher from a file: its sha256 on every batch; a resume or a replay under a changed file is one line
  (exit 1) and records nothing; the restored file resumes to the straight run's bits; a file of another
  architecture, a missing one, one that is not safetensors: one line at the start (exit 2), no run
  directory; a fork in place that names another teacher mid-window samples the window's batch again;
- a distill batch follows its rules (rollout_problems): every batch of a run does, each forgery breaks
  one; a resume checks the held batch before it records anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from rewind.engine.model.layout import build_model
from rewind.engine.posttrain.distill import batch_problem, rollout_problems, teacher_rewards
from rewind.states.config_reading import loads_config
from rewind.states.events import CheckpointCommitted, RolloutsRecorded, RunStarted, StepCommitted
from rewind.states.history import effective
from rewind.stores.rollouts import read_rollouts, write_rollouts
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import one_line, run_cli
from tests.states.test_distill_rules import DISTILL, SETTINGS
from tests.tools.rundir_forgery import rewrite_log

TEACHER = DISTILL.replace(SETTINGS, SETTINGS.replace("{ ", '{ teacher = "teacher", '))
END_ID = 10  # the byte-level tokenizer's "\n"


def train(config: Path, run: Path, *extra: object) -> tuple[int, str, str]:
    return run_cli("train", config, "--run-dir", run, "--no-progress", *extra)


def raw_rollouts(run: Path) -> list[RolloutsRecorded]:
    """Every RolloutsRecorded the log holds, superseded ones too: a batch sampled twice shows twice."""
    return [e for _, e in read_seq_events(run) if isinstance(e, RolloutsRecorded)]


def effective_events(run: Path) -> list:
    return [e for _, e in effective(read_seq_events(run))]


def records(run: Path) -> list[bytes]:
    """The effective StepCommitted and RolloutsRecorded stream, as bytes (floats bit for bit)."""
    kept = (StepCommitted, RolloutsRecorded)
    return [msgspec.msgpack.encode(e) for _, e in effective(read_seq_events(run)) if isinstance(e, kept)]


def final_tensors(run: Path) -> dict[str, str]:
    """sha256 of every tensor of the run's last checkpoint (model and optimizer), by file and name."""
    last = [e for _, e in effective(read_seq_events(run)) if isinstance(e, CheckpointCommitted)][-1]
    found = {}
    for file in sorted((run / "checkpoints" / last.checkpoint).glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            found[f"{file.name}:{name}"] = hashlib.sha256(tensor.contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
    return found


def log_bytes(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run / "events").iterdir())}


def teacher_weights(path: Path, seed: int, text: str = DISTILL) -> str:
    """A model of `text`'s architecture, perturbed by `seed`, saved at `path`/model.safetensors: its sha256."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: (t + 0.05 * torch.randn(t.shape, generator=generator)) if t.is_floating_point() else t
        for name, t in build_model(loads_config(text), None).state_dict().items()
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, path / "model.safetensors")
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> Path:
    """The small run's config (distill.toml) and its teacher-from-a-file twin (teacher.toml) beside a
    teacher directory (teacher/model.safetensors)."""
    here = tmp_path_factory.mktemp("configs")
    (here / "distill.toml").write_text(DISTILL)
    (here / "teacher.toml").write_text(TEACHER)
    teacher_weights(here / "teacher", seed=1)
    return here


@pytest.fixture(scope="module")
def straight(configs, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight") / "run"
    code, _, err = train(configs / "distill.toml", run)
    assert code == 0, err
    assert [r.step for r in raw_rollouts(run)] == [4, 6, 8]
    return run


@pytest.fixture(scope="module")
def stopped(configs, tmp_path_factory) -> Path:
    """The run stopped after step 5: inside the window whose batch was sampled at step 4."""
    run = tmp_path_factory.mktemp("stopped") / "run"
    code, _, err = train(configs / "distill.toml", run, "--max-steps", 5)
    assert code == 0, err
    assert [r.step for r in raw_rollouts(run)] == [4]
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    return copy


# --- stopped, killed, replayed: the same bits, the batches read back ------------------------------------


def test_a_run_stopped_inside_a_window_resumes_to_the_straight_runs_bits_without_sampling_again(
    configs, straight, stopped, tmp_path
):
    run = _copy(stopped, tmp_path)
    code, _, err = train(configs / "distill.toml", run)
    assert code == 0, err
    assert raw_rollouts(run) == raw_rollouts(straight)  # the batch of step 4 read back, not sampled again
    assert records(run) == records(straight)
    assert final_tensors(run) == final_tensors(straight)
    assert sorted(p.name for p in (run / "rollouts").iterdir()) == sorted(p.name for p in (straight / "rollouts").iterdir())


# SIGKILLs the process as it computes step 10: the last checkpoint (step 9) lies inside the window whose
# batch was sampled at step 8, so the resume reads that batch back.
KILLER = """
import os, signal, sys
from rewind.engine.posttrain import distill
train = distill.DistillSpec.train
def train_then_die(self, parts, state, plan, lr):
    if state.step == 9:
        os.kill(os.getpid(), signal.SIGKILL)
    return train(self, parts, state, plan, lr)
distill.DistillSpec.train = train_then_die
from rewind.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_run_killed_inside_a_window_resumes_to_the_straight_runs_bits_without_sampling_again(
    configs, straight, tmp_path
):
    run = tmp_path / "killed"
    command = [sys.executable, "-c", KILLER, "train", str(configs / "distill.toml"), "--run-dir", str(run), "--no-progress"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
    dead = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert dead.returncode == -signal.SIGKILL, dead.stderr
    checkpoints = [e.step for e in effective_events(run) if isinstance(e, CheckpointCommitted)]
    assert checkpoints[-1] == 9 and [r.step for r in raw_rollouts(run)] == [4, 6, 8]
    (run / "events" / "LOCK").unlink(missing_ok=True)  # the dead writer's lock (its breaking warns)
    code, _, err = train(configs / "distill.toml", run)
    assert code == 0, err
    assert f"resuming {run} at step 9 from checkpoint 00000009-" in err  # inside the window of step 8
    assert raw_rollouts(run) == raw_rollouts(straight)  # the batch of step 8 read back, not sampled again
    assert records(run) == records(straight)
    assert final_tensors(run) == final_tensors(straight)


def test_replay_samples_every_batch_again_and_recomputes_every_step_bit_for_bit(straight):
    code, out, err = run_cli("replay", straight)
    assert code == 0, err
    assert "replay: reproducible" in out
    assert "rollouts: 3 batch(es) sampled again, the same tokens as on record" in out


# --- the teacher ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def taught(configs, tmp_path_factory) -> Path:
    """The teacher-from-a-file run, straight."""
    run = tmp_path_factory.mktemp("taught") / "run"
    code, _, err = train(configs / "teacher.toml", run)
    assert code == 0, err
    return run


def test_a_teacher_from_a_file_scores_every_batch_and_its_sha256_is_on_record(configs, straight, taught):
    digest = hashlib.sha256((configs / "teacher" / "model.safetensors").read_bytes()).hexdigest()
    assert [r.teacher for r in raw_rollouts(taught)] == [digest] * 3
    assert {r.teacher for r in raw_rollouts(straight)} == {""}  # the run's reference: named by the log
    first = {run: [e for e in effective_events(run) if isinstance(e, StepCommitted)][4] for run in (straight, taught)}
    assert first[straight].stage == first[taught].stage == 2
    assert first[straight].loss != first[taught].loss  # another teacher: another KL
    assert first[taught].loss > 0.05 and first[taught].kl == first[taught].loss  # the KL is the loss


def test_a_resume_or_a_replay_under_a_changed_teacher_is_one_line_and_records_nothing(
    configs, taught, tmp_path, monkeypatch
):
    home = tmp_path / "home"
    shutil.copytree(configs, home)
    run = tmp_path / "run"
    code, _, err = train(home / "teacher.toml", run, "--max-steps", 7)  # inside the stage's second window
    assert code == 0, err
    teacher = home / "teacher" / "model.safetensors"
    kept = teacher.read_bytes()
    digest = teacher_weights(home / "teacher", seed=2)  # another teacher of the same architecture
    before = log_bytes(run)
    code, _, err = train(home / "teacher.toml", run)
    line = one_line(err)
    assert code == 1 and "Traceback" not in err
    assert f"distill.teacher '{teacher}' is the file of sha256 {digest[:12]}, not the file of sha256" in line, line
    assert "which scored the batch of step 6" in line
    assert f"a fork from the stage's start, `rewind fork {run} --at-step 4 NEW_RUN`" in line  # (its first batch's step)
    assert log_bytes(run) == before
    monkeypatch.chdir(home)  # replay and fork have no config beside which to look: the working directory
    code, _, err = run_cli("replay", run, "--from-checkpoint", 4)  # it samples the window's batch again
    line = err.replace("\r", "\n").splitlines()[-1]  # (replay's progress bar comes before)
    assert code == 1 and f"distill.teacher is the file of sha256 {digest[:12]}, not the file of sha256" in line, err
    assert "which scored the batch of step 4; replay scores it again with the teacher here" in line
    assert log_bytes(run) == before
    code, _, err = run_cli("fork", run, tmp_path / "fork", "--at-step", 4)  # the way on the line gives
    assert code == 0, err
    assert {r.teacher for r in raw_rollouts(tmp_path / "fork")} == {digest}
    teacher.write_bytes(kept)  # restored: it goes on as if it had never stopped
    code, _, err = train(home / "teacher.toml", run)
    assert code == 0, err
    assert records(run) == records(taught) and final_tensors(run) == final_tensors(taught)


def test_a_run_exported_by_rewind_export_is_a_teacher(straight, tmp_path):
    exported = tmp_path / "exported" / "model.safetensors"
    code, _, err = run_cli("export", straight, "--to", exported)
    assert code == 0, err
    config = tmp_path / "run.toml"  # named by its absolute path: found wherever the config is
    config.write_text(TEACHER.replace('teacher = "teacher"', f'teacher = "{exported.parent}"'))
    code, _, err = train(config, tmp_path / "run", "--max-steps", 5)
    assert code == 0, err
    digest = hashlib.sha256(exported.read_bytes()).hexdigest()
    assert [r.teacher for r in raw_rollouts(tmp_path / "run")] == [digest]


@pytest.mark.parametrize("teacher", ["missing", "another architecture", "not safetensors"])
def test_a_teacher_that_cannot_be_read_or_does_not_fit_is_one_line_at_the_start(configs, tmp_path, teacher):
    home = tmp_path / "home"
    home.mkdir()
    (home / "teacher.toml").write_text(TEACHER)
    if teacher == "another architecture":
        teacher_weights(home / "teacher", seed=1, text=DISTILL.replace("d_model = 32", "d_model = 64"))
    elif teacher == "not safetensors":
        (home / "teacher").mkdir()
        (home / "teacher" / "model.safetensors").write_bytes(b"not a model")
    run = tmp_path / "run"
    code, _, err = train(home / "teacher.toml", run)
    line = one_line(err)
    assert code == 2 and "Traceback" not in err and "distill.teacher" in line, err
    said = {"missing": "cannot read", "another architecture": "is not a model of this run's architecture",
            "not safetensors": "is not a safetensors file"}  # fmt: skip
    assert said[teacher] in line and str(home / "teacher") in line, line
    assert not run.exists()  # nothing recorded, no run directory left behind


@pytest.mark.parametrize("named", ["~no_such_user_of_rewind/teacher", "tea\\u0000cher"])
def test_a_teacher_name_no_file_can_have_is_one_line_at_the_start(tmp_path, named):
    config = tmp_path / "teacher.toml"
    config.write_text(TEACHER.replace('teacher = "teacher"', f'teacher = "{named}"'))
    code, _, err = train(config, tmp_path / "run")
    assert code == 2 and "Traceback" not in err and one_line(err).startswith("rewind: "), err
    assert "distill.teacher" in one_line(err) and not (tmp_path / "run").exists()


def test_a_fork_in_place_that_names_another_teacher_mid_window_samples_the_windows_batch_again(
    configs, stopped, tmp_path
):
    run = _copy(stopped, tmp_path)
    code, _, err = train(configs / "teacher.toml", run, "--fork", "--max-steps", 1)
    assert code == 0, err
    digest = hashlib.sha256((configs / "teacher" / "model.safetensors").read_bytes()).hexdigest()
    assert [(r.step, r.teacher) for r in raw_rollouts(run)][:2] == [(4, ""), (5, digest)]


# --- a distill batch's rules --------------------------------------------------------------------------------


def test_every_batch_of_a_run_follows_the_rules_a_resume_and_verify_check(straight, taught):
    for run in (straight, taught):
        events = effective_events(run)
        config = next(e for e in events if isinstance(e, RunStarted)).config
        for record in (e for e in events if isinstance(e, RolloutsRecorded)):
            assert batch_problem(str(run), record, config) == ""
            assert batch_problem(str(run), record, config, END_ID) == ""


def _first_batch(run: Path):
    events = effective_events(run)
    config = next(e for e in events if isinstance(e, RunStarted)).config
    record = next(e for e in events if isinstance(e, RolloutsRecorded))
    tensors, metadata = read_rollouts(str(run), record.path, record.sha256)
    return tensors, metadata, record, config


def _rewards_off(t, m, r):
    t["rewards"] = t["rewards"].clone()
    t["rewards"][0, 1] = torch.nextafter(t["rewards"][0, 1], torch.tensor(0.0))


def _reference_off(t, m, r):  # the teacher's log-probs changed, the rewards row left as it was
    t["reference_logprobs"] = t["reference_logprobs"] * 0.5


def _advantages(t, m, r):
    t["advantages"] = torch.ones_like(t["advantages"])


def _token(t, m, r):
    t["completions"] = t["completions"].clone()
    t["completions"][0, 0] = 300


def _past_the_end(t, m, r):  # completion 0 ends a token early, its log-probs there left as they were
    for name in ("completion_lengths", "completions", "finished"):
        t[name] = t[name].clone()
    t["completion_lengths"][0] -= 1
    t["completions"][0, t["completion_lengths"][0] - 1] = END_ID
    t["finished"][0] = 1
    t["rewards"] = teacher_rewards(t)


FORGERIES = {
    "rewards": (_rewards_off, lambda r: r, "its rewards are not each completion's mean teacher log-prob"),
    "reference": (_reference_off, lambda r: r, "its rewards are not each completion's mean teacher log-prob"),
    "advantages": (_advantages, lambda r: r, "it holds advantages: a distill batch's are 0"),
    "token": (_token, lambda r: r, "completions hold token id 300, outside the vocabulary (256 ids)"),
    "length": (_past_the_end, lambda r: r, "its old_logprobs hold a value past a completion's end"),
    "mean": (lambda t, m, r: None, lambda r: msgspec.structs.replace(r, mean_reward=r.mean_reward + 1.0),
             "its record's mean_reward"),
    "unscored": (lambda t, m, r: None, lambda r: msgspec.structs.replace(r, unscored=1), "its record's mean_reward"),
    "teacher": (lambda t, m, r: None, lambda r: msgspec.structs.replace(r, teacher="ab" * 32),
                "its record's teacher is the file of sha256 abababababab, but the stage's distill.teacher is 'reference'"),
    "stage": (lambda t, m, r: None, lambda r: msgspec.structs.replace(r, stage=1),
              "its record names stage 1, not a distill stage of the run's config"),
    "functions": (lambda t, m, r: m.update(reward_functions="exact_match"), lambda r: r,
                  "its reward functions 'exact_match' are not the stage's 'teacher'"),
    "policy": (lambda t, m, r: m.update(policy_step="3"), lambda r: r, "sampled by the weights of step 3"),
    "group": (lambda t, m, r: None, lambda r: msgspec.structs.replace(r, group_size=4, num_prompts=2),
              "it holds 4 prompts x 2 completions, but its record says 2 x 4"),
}  # fmt: skip


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_each_forgery_of_a_distill_batch_breaks_a_rule(straight, forgery):
    tensors, metadata, record, config = _first_batch(straight)
    assert rollout_problems(tensors, metadata, record, config, END_ID) == []
    change_tensors, change_record, said = FORGERIES[forgery]
    change_tensors(tensors, metadata, record)
    problems = rollout_problems(tensors, metadata, change_record(record), config, END_ID)
    assert problems and problems[0].startswith(said), problems


def test_a_finish_flag_that_disagrees_with_the_end_token_breaks_a_rule(straight):
    tensors, metadata, record, config = _first_batch(straight)
    tensors["finished"] = 1 - tensors["finished"]
    problems = rollout_problems(tensors, metadata, record, config, END_ID)
    assert any("marked finished but does not end with the end token" in p for p in problems), problems
    assert rollout_problems(tensors, metadata, record, config, None) == []  # (no end token known: not checked)


def test_a_resume_checks_the_held_batch_before_it_records_anything(configs, stopped, tmp_path):
    run = _copy(stopped, tmp_path)
    (record,) = raw_rollouts(run)
    (run / record.path).write_bytes((run / record.path).read_bytes()[:100])  # cut: not the file on record
    before = log_bytes(run)
    code, _, err = train(configs / "distill.toml", run)
    assert code == 1 and "Traceback" not in err and record.path in one_line(err), err
    assert log_bytes(run) == before


def test_a_resume_refuses_a_held_batch_forged_with_its_record(configs, stopped, tmp_path):
    run = _copy(stopped, tmp_path)
    tensors, metadata, record, _ = _first_batch(run)
    tensors["completions"] = tensors["completions"].clone()
    tensors["completions"][0, 0] = 300  # a token outside the vocabulary, in a file that hashes to its record
    path, sha256 = write_rollouts(str(run), tensors, metadata)
    rewrite_log(run, lambda seq, e: msgspec.structs.replace(e, path=path, sha256=sha256) if e == record else e)
    before = log_bytes(run)
    code, _, err = train(configs / "distill.toml", run)
    line = one_line(err)
    assert code == 1 and "not a batch a run writes: completions hold token id 300" in line, err
    assert f"rewind fork {run} --at-step 4 NEW_RUN" in line
    assert log_bytes(run) == before


# --- the reading commands -------------------------------------------------------------------------------


def test_verify_and_rollouts_check_a_distill_batch_by_its_kinds_rules(straight, tmp_path):
    code, out, err = run_cli("verify", straight)
    assert code == 0 and "rollouts: 3 file(s), verified" in out and "verify: clean" in out, out + err
    code, out, err = run_cli("rollouts", straight, "--json")
    assert code == 0, err
    shown = json.loads(out)
    last = raw_rollouts(straight)[-1]
    assert shown["step"] == last.step == 8 and shown["reward_functions"] == ["teacher"]
    assert shown["mean_reward"] == last.mean_reward < 0  # the teacher's mean log-prob of the completions
    completions = [c for prompt in shown["prompts"] for c in prompt["completions"]]
    assert len(completions) == 8 and {c["advantage"] for c in completions} == {0.0}
    code, out, err = run_cli("rollouts", straight, "--step", 5)
    assert code == 0 and "rollouts recorded at step 4 (stage 2" in out, err
    # what verify and a resume refuse alike: a held batch forged with its record
    run = _copy(straight, tmp_path)
    tensors, metadata, record, _ = _first_batch(run)
    tensors["advantages"] = torch.ones_like(tensors["advantages"])
    path, sha256 = write_rollouts(str(run), tensors, metadata)
    rewrite_log(run, lambda seq, e: msgspec.structs.replace(e, path=path, sha256=sha256) if e == record else e)
    code, out, _ = run_cli("verify", run)
    assert code == 1 and "rollouts: 3 file(s), 1 with problems" in out
    assert f"{path}: not a batch a run writes: it holds advantages" in out  # (and the state digests after it)
    code, _, err = run_cli("rollouts", run, "--step", 4)
    assert code == 1 and "it holds advantages" in one_line(err)


GRPO_STAGE = (
    '[[stages]]\nstrategy = "grpo"\ntokens = 1_024\ndatasets = [{ name = "sort", rate = 1.0 }]\n'
    "grpo = { group_size = 4, max_new_tokens = 8, num_iterations = 2 }\n"
)


@pytest.mark.parametrize("grpo_first", [True, False])
def test_a_grpo_stage_and_a_distill_stage_train_in_one_run_and_resume_inside_each_window(tmp_path, grpo_first):
    """Each rollout kind keeps its own window's batch (a grpo stage beside a distill one shares nothing)."""
    head, distill = DISTILL.split('[[stages]]\nstrategy = "distill"')
    distill = '[[stages]]\nstrategy = "distill"' + distill
    text = head + (GRPO_STAGE + "\n" + distill if grpo_first else distill + "\n" + GRPO_STAGE)
    config = tmp_path / "run.toml"
    config.write_text(text)
    code, _, err = train(config, tmp_path / "straight")
    assert code == 0, err
    kinds = {e.stage for e in raw_rollouts(tmp_path / "straight")}
    assert len(kinds) == 2  # both stages sampled their windows
    code, _, err = train(config, tmp_path / "stopped", "--max-steps", "9")  # inside the second kind's first window
    assert code == 0, err
    code, _, err = train(config, tmp_path / "stopped")
    assert code == 0, err
    assert final_tensors(tmp_path / "stopped") == final_tensors(tmp_path / "straight")
