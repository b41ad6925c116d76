"""`rewind log` (filters, JSON, the effective view after a resume) and `rewind verify` (a clean run, and
damage to the log or a checkpoint found and located)."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from rewind.states.events import CheckpointCommitted, RunFinished, RunResumed, StepCommitted
from rewind.states.fold import fold
from rewind.states.history import effective
from rewind.stores.eventlog import EventLog
from rewind.stores.runs import read_records, read_seq_events
from rewind.stores.synthetic import write_synthetic_run
from rewind.tools.log_cmd import describe, parse_steps
from tests.engine.test_loop import (
    OVERRIDES,
    events_of,
    interrupt_before,
    one_line,
    run_cli,
    train_args,
)
from tests.tools.small_posttrain import train_small_posttrain


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> Path:
    """A run hit by Ctrl-C twice before the step with index 6 (steps 5 and 6 committed, no checkpoint
    since step 4), then resumed to the end: the records of steps 5 and 6 are superseded."""
    run = tmp_path_factory.mktemp("resumed") / "run"
    overrides = (*OVERRIDES, "logging.report_interval=1")  # commit the log at every step
    with pytest.MonkeyPatch.context() as patch:
        interrupt_before(patch, step_index=6, times=2)  # the second Ctrl-C stops at once
        code, _, err = run_cli(*train_args(run, overrides=overrides))
    assert code == 130, err
    state = fold(events_of(run))
    assert state.step == 6 and state.last_checkpoint.step == 4 and not state.stopped_reason
    code, _, err = run_cli(*train_args(run, overrides=overrides))
    assert code == 0, err
    return run


def log_json(run: Path, *args: str) -> list[dict]:
    code, out, err = run_cli("log", run, "--json", *args)
    assert code == 0, err
    return json.loads(out)


# --- rewind log -------------------------------------------------------------------------------------


def test_log_prints_a_header_and_one_line_per_record(resumed):
    code, out, err = run_cli("log", resumed)
    assert code == 0, err
    lines = out.splitlines()
    records = read_seq_events(resumed)
    assert lines[0].split() == ["seq", "step", "tokens", "type", "fields"]
    assert len(lines) == 1 + len(records)
    for line, (seq, event) in zip(lines[1:], records, strict=True):
        assert line.split()[:2] == [str(seq), str(event.step)] and type(event).__name__ in line


def test_log_json_is_a_list_of_records_with_type_seq_step_and_fields(resumed):
    listed = log_json(resumed)
    records = read_seq_events(resumed)
    assert [(d["type"], d["seq"], d["step"], d["tokens"]) for d in listed] == [
        (type(e).__name__, s, e.step, e.tokens) for s, e in records
    ]
    steps = [d for d in listed if d["type"] == "StepCommitted"]
    assert steps and all({"loss", "lr", "rows", "cursors", "skipped"} <= d.keys() for d in steps)
    assert listed[0]["type"] == "RunStarted" and listed[0]["config"]["run"]["name"] == "tiny"


def test_log_type_filter(resumed):
    listed = log_json(resumed, "--type", "StepCommitted", "--type", "RunResumed")
    records = read_seq_events(resumed)
    expected = [s for s, e in records if isinstance(e, StepCommitted | RunResumed)]
    assert [d["seq"] for d in listed] == expected
    assert {d["type"] for d in listed} == {"StepCommitted", "RunResumed"}


def test_log_type_matches_in_any_case(resumed):
    exact = log_json(resumed, "--type", "StepCommitted", "--type", "RunResumed")
    assert log_json(resumed, "--type", "stepcommitted", "--type", "RUNRESUMED") == exact
    code, out, _ = run_cli("log", resumed, "--type", "checkpointcommitted")
    assert code == 0 and "CheckpointCommitted" in out


def test_log_type_takes_a_comma_separated_list(resumed):
    exact = log_json(resumed, "--type", "StepCommitted", "--type", "RunResumed")
    assert log_json(resumed, "--type", "StepCommitted,RunResumed") == exact
    assert log_json(resumed, "--type", "stepcommitted, runresumed") == exact
    for bad in ("StepCommitted,", ",", "StepCommitted,,RunResumed"):
        code, out, err = run_cli("log", resumed, "--type", bad)
        assert code == 2 and not out and "an empty event type" in one_line(err), bad


@pytest.fixture(scope="module")
def forked_posttrain(tmp_path_factory) -> Path:
    """The small post-training example stopped in its grpo stage (steps 9..14) after step 11, then forked in
    place from there with grpo.kl_beta 0.05 instead of 0.02."""
    run = tmp_path_factory.mktemp("posttrain") / "run"
    train_small_posttrain(run, "--max-steps", "11")
    return train_small_posttrain(run, "--fork", "--set", "stages[3].grpo.kl_beta=0.05")


def step_lines(run: Path, *args: str) -> dict[int, str]:
    code, out, err = run_cli("log", run, "--type", "StepCommitted", *args)
    assert code == 0, err
    return {int(line.split()[1]): line for line in out.splitlines()[1:]}


def test_log_shows_a_dpo_or_grpo_step_with_its_own_tie_to_the_reference(forked_posttrain):
    """Not `beta=0` (the token-level beta such a stage must have): dpo.beta, and grpo.kl_beta as the
    config in force when the step was written says (a fork in place changed it after step 11), also when
    --steps starts after the fork's ConfigChanged."""
    lines = step_lines(forked_posttrain)
    assert sorted(lines) == list(range(1, 15))
    stages = {step: int(line.split("stage=")[1].split()[0]) for step, line in lines.items()}
    assert [stages[k] for k in range(1, 15)] == [0] * 2 + [1] * 4 + [2] * 2 + [3] * 6
    for step, line in lines.items():
        fields = line.split()[4:]
        if stages[step] < 2:  # pretrain and sft: the token-level KL, as recorded
            assert fields[2] == "beta=0" and "kl=0" in fields
        elif stages[step] == 2:  # dpo: no KL penalty is computed; its loss is its tie to the reference
            assert fields[2] == "dpo.beta=0.1" and not any(f.startswith(("beta=", "kl=")) for f in fields)
        else:
            weight = "0.02" if step <= 11 else "0.05"
            assert fields[2] == f"grpo.kl_beta={weight}" and any(f.startswith("kl=") for f in fields), line
            assert not any(f.startswith("beta=") for f in fields)
    assert step_lines(forked_posttrain, "--steps", "12:14") == {k: lines[k] for k in (12, 13, 14)}
    assert step_lines(forked_posttrain, "--steps", "10:11") == {k: lines[k] for k in (10, 11)}
    # --json is the record itself: the token-level beta (0) and kl as the step wrote them.
    steps = log_json(forked_posttrain, "--type", "StepCommitted", "--steps", "7:7")
    assert [(d["beta"], d["kl"]) for d in steps] == [(0.0, 0.0)]


def test_log_unknown_type_is_a_usage_error(resumed):
    code, out, err = run_cli("log", resumed, "--type", "StepCommited")
    assert code == 2 and not out
    assert "StepCommited" in one_line(err) and "StepCommitted" in err  # the known types are listed


@pytest.mark.parametrize(("steps", "low", "high"), [("3:5", 3, 5), ("18:", 18, 10**9), (":2", 0, 2)])
def test_log_steps_filter(resumed, steps, low, high):
    listed = log_json(resumed, "--steps", steps)
    expected = [s for s, e in read_seq_events(resumed) if low <= e.step <= high]
    assert expected and [d["seq"] for d in listed] == expected


@pytest.mark.parametrize("steps", ["3-5", "a:b", "3", "1:2:3"])
def test_log_bad_steps_is_a_usage_error(resumed, steps):
    code, out, err = run_cli("log", resumed, "--steps", steps)
    assert code == 2 and not out
    assert "--steps" in one_line(err)


def test_log_effective_drops_the_records_a_resume_superseded(resumed):
    raw = log_json(resumed, "--type", "StepCommitted")
    kept = log_json(resumed, "--type", "StepCommitted", "--effective")
    raw_steps = [d["step"] for d in raw]
    assert raw_steps.count(5) == raw_steps.count(6) == 2  # committed, then redone after the resume
    assert [d["step"] for d in kept] == list(range(1, 21))
    (resume,) = [e for e in events_of(resumed) if isinstance(e, RunResumed)]
    superseded = range(resume.superseded_first_seq, resume.superseded_last_seq + 1)
    assert len(superseded) >= 2
    everything = log_json(resumed, "--effective")
    assert [d["seq"] for d in everything] == [s for s, _ in effective(read_seq_events(resumed))]
    assert not any(d["seq"] in superseded for d in everything)


@pytest.fixture(scope="module")
def long_run(tmp_path_factory) -> Path:
    """A synthetic run over many small segments, resumed three times: `--steps` reads only a few."""
    run = tmp_path_factory.mktemp("long") / "run"
    write_synthetic_run(run, 3000, 3, checkpoint_every=200, report_interval=50, segment_bytes=20_000)
    return run


@pytest.mark.parametrize(
    "args",
    [
        ("--steps", "1499:1502"),
        ("--steps", "1499:1502", "--effective"),
        ("--steps", "750:", "--type", "RunResumed"),
        ("--steps", ":3", "--effective"),
        ("--type", "CheckpointDeleted", "--effective"),
    ],
    ids=["steps", "steps-effective", "type", "first-steps", "whole-log"],
)
def test_log_reads_a_long_run_by_seeking_and_prints_what_a_full_read_would(long_run, args):
    records = read_seq_events(long_run)
    if "--effective" in args:
        records = effective(records)
    low, high = parse_steps(args[1] if args[0] == "--steps" else None)
    kinds = {args[i + 1] for i, a in enumerate(args) if a == "--type"}
    expected = [
        (s, e) for s, e in records if low <= e.step <= high and (not kinds or type(e).__name__ in kinds)
    ]
    assert expected
    code, out, err = run_cli("log", long_run, *args)
    assert code == 0, err
    assert out.splitlines()[1:] == [describe(s, e) for s, e in expected]
    assert [d["seq"] for d in log_json(long_run, *args)] == [s for s, _ in expected]


def test_log_follow_prints_each_new_record_once_until_the_run_finishes(tmp_path, monkeypatch):
    run = tmp_path / "run"
    write_synthetic_run(run, 200, 1, checkpoint_every=50, report_interval=10, segment_bytes=4000)
    following = threading.Event()
    real_follow = EventLog.follow

    def follow(self, *args, **kwargs):
        following.set()
        yield from real_follow(self, *args, **kwargs)

    def finish() -> None:  # the run goes on once the command is past its first read
        assert following.wait(30)
        with EventLog.open(run, "w") as log:
            for step in range(201, 204):
                log.append(StepCommitted(step=step, tokens=step * 512, stage=0, lr=0.0, beta=0.0, loss=1.0))
                log.commit()
            log.append(RunFinished(step=203, tokens=203 * 512))
            log.commit()

    monkeypatch.setattr(EventLog, "follow", follow)
    writer = threading.Thread(target=finish)
    writer.start()
    code, out, err = run_cli("log", run, "--follow", "--steps", "150:")
    writer.join()
    assert code == 0, err
    expected = [describe(s, e) for s, e in read_seq_events(run) if e.step >= 150]
    assert out.splitlines()[1:] == expected and "RunFinished" in expected[-1]


def test_log_of_an_empty_log_is_exit_1(tmp_path):
    (tmp_path / "run" / "events").mkdir(parents=True)
    code, out, err = run_cli("log", tmp_path / "run")
    assert code == 1 and not out and "empty" in one_line(err)


def test_log_of_a_missing_run(tmp_path):
    code, out, err = run_cli("log", tmp_path / "nothing")
    assert code != 0 and not out
    assert "no run here" in one_line(err) and "Traceback" not in err


# --- rewind verify ----------------------------------------------------------------------------------


def verify(run: Path) -> tuple[int, list[str]]:
    code, out, err = run_cli("verify", run)
    assert not err
    return code, [line for line in out.splitlines() if line.startswith("PROBLEM ")]


@pytest.fixture
def damaged(straight, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    return run


@pytest.mark.parametrize("which", ["straight", "resumed"])
def test_verify_a_clean_run(which, request):
    run = request.getfixturevalue(which)
    code, out, err = run_cli("verify", run)
    assert code == 0, out + err
    assert "PROBLEM" not in out and out.splitlines()[-1] == "verify: clean"


def test_verify_finds_a_flipped_byte_in_the_log(damaged):
    segment = damaged / "events" / "00000000.log"
    data = bytearray(segment.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0xFF
    hit = [r for r in read_records(damaged) if r.offset <= middle][-1]  # the record holding the byte
    segment.write_bytes(data)
    code, problems = verify(damaged)
    assert code == 1
    assert problems[0].startswith(f"PROBLEM log: 00000000.log offset {hit.offset}: ")


def test_verify_finds_a_corrupt_checkpoint_file(damaged):
    final = fold(events_of(damaged)).last_checkpoint
    path = damaged / "checkpoints" / final.checkpoint / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)
    code, problems = verify(damaged)
    assert code == 1
    (problem,) = problems
    assert final.checkpoint in problem and "model.safetensors" in problem
    code, out, _ = run_cli("verify", damaged)
    assert "1 with problems" in out and "verified" not in out  # the summary does not claim otherwise


def test_verify_finds_a_missing_live_checkpoint(damaged):
    live = fold(events_of(damaged)).live_checkpoints
    gone = live[0].checkpoint
    shutil.rmtree(damaged / "checkpoints" / gone)
    code, problems = verify(damaged)
    assert code == 1
    (problem,) = problems
    assert gone in problem and "not found" in problem


def test_verify_names_a_damaged_segment_index_and_log_still_reads_right(long_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(long_run, run)
    index = run / "events" / "00000003.idx"
    data = bytearray(index.read_bytes())
    data[len(data) // 2] ^= 0x04
    index.write_bytes(bytes(data))
    code, out, _ = run_cli("verify", run)
    assert code == 1
    (problem,) = [line for line in out.splitlines() if line.startswith("PROBLEM log index")]
    assert problem.startswith("PROBLEM log index: 00000003.idx: damaged index file")
    assert "fold: ok" in out  # a bad index is no reason to stop checking the log
    assert log_json(run) == log_json(long_run)


def test_verify_reports_a_torn_tail(damaged):
    last = read_records(damaged)[-1]
    segment = damaged / "events" / last.segment
    data = segment.read_bytes()
    segment.write_bytes(data[: len(data) - 5])  # the last record loses its end
    code, out, err = run_cli("verify", damaged)
    # What a crash mid-commit leaves is the expected state, not a problem: a note, and exit 0.
    assert code == 0 and not err and "PROBLEM" not in out
    (note,) = [line for line in out.splitlines() if "torn tail" in line]
    assert f"{last.segment} at offset {last.offset}" in note and "expected state after a crash" in note
    # Everything before the tear is intact and still folds (to a run that has not finished).
    assert isinstance(read_seq_events(damaged)[-1][1], CheckpointCommitted)


@pytest.mark.parametrize("command", ["log", "replay", "diff", "timeline", "state"])
def test_a_damaged_log_is_one_line_and_exit_1_from_every_reader(straight, tmp_path, command):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    segment = sorted((run / "events").glob("*.log"))[0]
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF  # mid-log: not a torn tail, real damage
    segment.write_bytes(bytes(data))
    args = [command, run, straight] if command == "diff" else [command, run]
    code, _, err = run_cli(*args)
    assert code == 1, err
    assert "Traceback" not in err
    assert "00000000.log" in one_line(err)
