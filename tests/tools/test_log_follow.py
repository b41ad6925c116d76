"""`rewind log --follow` ends when the run ends: at once for a run that has finished or stopped, and,
for a run whose writer died without saying so, once no writer holds the log and no record has come
for `FOLLOW_QUIET_S`; never while a writer holds the lock, however quiet the log."""

from __future__ import annotations

import threading
import time

import pytest

from rewind.states.events import StepCommitted
from rewind.stores.eventlog import EventLog
from rewind.stores.synthetic import write_synthetic_run
from rewind.tools import log_cmd
from tests.engine.test_loop import run_cli


@pytest.fixture
def quick_quiet(monkeypatch):
    monkeypatch.setattr(log_cmd, "FOLLOW_QUIET_S", 0.3)
    monkeypatch.setattr(log_cmd, "FOLLOW_POLL_S", 0.05)


def timed_follow(run) -> tuple[float, tuple[int, str, str]]:
    started = time.monotonic()
    result = run_cli("log", run, "--follow")
    return time.monotonic() - started, result


def test_following_a_finished_run_ends_at_once(straight, monkeypatch):
    monkeypatch.setattr(log_cmd, "FOLLOW_QUIET_S", 60.0)  # only RunFinished can end it in time
    _, listing, _ = run_cli("log", straight)
    elapsed, (code, out, err) = timed_follow(straight)
    assert code == 0, err
    assert out == listing and "RunFinished" in out.splitlines()[-1]  # nothing printed twice
    assert elapsed < 30


def test_following_a_run_whose_writer_is_gone_ends_after_the_quiet_time(tmp_path, quick_quiet):
    run = tmp_path / "run"
    write_synthetic_run(run, 30, 1, checkpoint_every=10, report_interval=5)  # unfinished, lock released
    _, listing, _ = run_cli("log", run)
    elapsed, (code, out, err) = timed_follow(run)
    assert code == 0, err
    assert out == listing
    assert 0.3 <= elapsed < 30


def test_following_waits_for_a_live_writer_however_quiet_then_ends_once_it_is_gone(tmp_path, quick_quiet):
    run = tmp_path / "run"
    write_synthetic_run(run, 30, 0, checkpoint_every=10, report_interval=5)
    with EventLog.open(run) as log:
        last = log.next_seq - 1
    holding, done = threading.Event(), threading.Event()

    def writer() -> None:
        with EventLog.open(run, "w") as log:
            holding.set()
            time.sleep(1.2)  # four quiet times with the lock held: the follower must keep going
            log.append(StepCommitted(step=31, tokens=31 * 256, stage=0, lr=0.0, beta=0.0, loss=1.0))
            log.commit()
            time.sleep(0.2)
        done.set()  # released without RunFinished or RunStopped, like a writer that crashed

    thread = threading.Thread(target=writer)
    thread.start()
    assert holding.wait(30)
    elapsed, (code, out, err) = timed_follow(run)
    thread.join()
    assert code == 0, err
    assert done.is_set()  # it ended only after the writer let go
    new = [line for line in out.splitlines()[1:] if int(line.split()[0]) > last]
    assert len(new) == 1 and new[0].split()[:2] == [str(last + 1), "31"] and "StepCommitted" in new[0]
    assert elapsed >= 1.2


def test_the_follow_help_says_when_it_ends(rewind_cli):
    code, out, _ = rewind_cli("log", "--help")
    assert code == 0
    text = " ".join(out.split())
    assert "finishes or stops" in text and "no writer holds the log" in text
