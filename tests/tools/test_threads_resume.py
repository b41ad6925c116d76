"""A run's CPU thread count is on record: a resume computes with the count the run goes on from (the
count changes the bits of some models), or with the one the user asks for (--threads, recorded in
RunResumed, with a note that bits may differ), and replay recomputes each segment with its own count."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import msgspec
import pytest
import torch
import torch.nn.functional as F

from rewind.states.events import RunResumed, RunStarted
from rewind.stores.runs import read_seq_events
from tests.conftest import EXAMPLES

# The tiny example with LayerNorm (whose weight gradient's bits depend on the thread count), 20 steps.
TINY_LAYERNORM = (
    str(EXAMPLES / "tiny.toml"),
    "--set", "architecture.norm=layernorm",
    "--set", "training.tokens=[2560,1280,1280]",
    "--set", "logging.checkpoint_interval=4",
)  # fmt: skip


@contextlib.contextmanager
def process_threads(count: int) -> Iterator[None]:
    """This process's torch thread count while the block runs (a resume elsewhere has another default)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def opening_counts(run) -> list[tuple[str, int]]:
    """(event type, num_threads) of the run's RunStarted and every RunResumed, in log order."""
    return [
        (type(e).__name__, e.num_threads)
        for _, e in read_seq_events(run)
        if isinstance(e, RunStarted | RunResumed)
    ]


def test_the_thread_count_changes_the_bits_of_a_layernorm_gradient_and_of_a_long_sum():
    """Why a resume keeps the run's count unless told otherwise (measured with torch 2.13 on the CPU; if
    this stops failing to differ, docs/resuming.md's "What is reproducible where" needs another look)."""
    generator = torch.Generator().manual_seed(0)
    x, dy = torch.randn(256, 32, generator=generator), torch.randn(256, 32, generator=generator)
    values = torch.randn(300_007, generator=generator)
    grads, sums = [], []
    for count in (1, 2):
        weight = torch.ones(32, requires_grad=True)
        with process_threads(count):
            F.layer_norm(x, (32,), weight).backward(dy)
            sums.append(values.sum())
        grads.append(weight.grad)
    assert not torch.equal(*grads)
    assert not torch.equal(*sums)


def test_a_resume_records_its_count_and_may_be_told_another(rewind_cli, tmp_path):
    run = tmp_path / "run"
    code, _, err = rewind_cli(
        "train", *TINY_LAYERNORM, "--run-dir", run, "--threads", "1", "--max-steps", "6", "--no-progress"
    )
    assert code == 0, err
    with process_threads(2):  # this process's own default differs from the run's
        code, _, err = rewind_cli("resume", run, "--max-steps", "4", "--no-progress")
        assert code == 0, err
        assert "computing with 1 CPU thread(s) as the run did (this process had 2): bit for bit" in err
        code, _, err = rewind_cli("resume", run, "--threads", "2", "--max-steps", "4", "--no-progress")
        assert code == 0, err
        assert "computing with 2 CPU thread(s) as asked (--threads), the run computed with 1" in err
        assert "bits may differ" in err
    with process_threads(1):
        code, _, err = rewind_cli("resume", run, "--no-progress")  # goes on as its last resume chose
    assert code == 0, err
    assert "computing with 2 CPU thread(s) as the run did (this process had 1)" in err
    assert opening_counts(run) == [("RunStarted", 1), ("RunResumed", 1), ("RunResumed", 2), ("RunResumed", 2)]
    # Replay computes each segment with the count it recorded: bit for bit across the change.
    code, out, err = rewind_cli("replay", run, "--json")
    report = json.loads(out)
    assert code == 0 and report["reproducible"] and report["num_steps_compared"] == 20, out + err


def test_a_fork_computes_with_its_parents_count_or_the_one_asked_for(rewind_cli, tmp_path):
    parent = tmp_path / "parent"
    code, _, err = rewind_cli(
        "train", *TINY_LAYERNORM, "--run-dir", parent, "--threads", "2", "--max-steps", "8", "--no-progress"
    )
    assert code == 0, err
    with process_threads(1):
        code, _, err = rewind_cli(
            "fork", parent, tmp_path / "same", "--at-step", "8", "--max-steps", "1", "--no-progress"
        )
        assert code == 0, err
        code, _, err = rewind_cli(
            "fork",
            parent,
            tmp_path / "faster",
            "--at-step",
            "8",
            "--threads",
            "1",
            "--max-steps",
            "1",
            "--no-progress",
        )
    assert code == 0, err
    assert "the run computed with 2: from here on its bits may differ" in err
    assert opening_counts(tmp_path / "same")[0] == ("RunStarted", 2)
    assert opening_counts(tmp_path / "faster")[0] == ("RunStarted", 1)


@pytest.mark.parametrize("count", ["0", "-1", "100000", "two"])
def test_a_thread_count_out_of_range_is_a_usage_error(rewind_cli, tmp_path, count):
    code, _, err = rewind_cli("train", *TINY_LAYERNORM, "--run-dir", tmp_path / "run", "--threads", count)
    assert code == 2 and err.count("\n") == 1 and "--threads" in err, err
    assert not (tmp_path / "run").exists()


def test_a_resume_record_with_an_absurd_thread_count_is_refused():
    """Never handed to OpenMP (it crashes on such counts): a log that holds one does not fold."""
    from rewind.stores.trust import RecordChecker

    resumed = RunResumed(
        step=0, tokens=0, checkpoint="", superseded_first_seq=1, superseded_last_seq=0, num_threads=100_000
    )
    assert "num_threads 100000 is out of range" in RecordChecker().problem(resumed)
    assert RecordChecker().problem(msgspec.structs.replace(resumed, num_threads=4)) == ""
