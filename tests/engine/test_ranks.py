"""What the processes of a sharded run tell each other (rewind.engine.model.ranks), checked in two real
processes under torchrun (gloo): sums, a stop request, rank 0's events, the lowest rank's failure, the
state check before a checkpoint, and what a rank whose peer is gone is told. One launch runs every
check; each rank writes what it saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rewind.engine.model import ranks

pytestmark = pytest.mark.distributed

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from rewind.engine.model import ranks
    from rewind.states.events import CheckpointCommitted
    from rewind.states.state import State

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    seen = {"rank": rank, "writer": ranks.is_writer()}
    seen["sums"] = ranks.sum_over_ranks([1.5 * (rank + 1), 0.25, float(rank)])
    seen["stop_none"] = ranks.any_rank(False)
    seen["stop_one"] = ranks.any_rank(rank == 1)
    mine = CheckpointCommitted(step=4, tokens=1024, checkpoint="00000004-deadbeef", manifest_sha256="ab" * 32,
                               files={"model.safetensors": "cd" * 32}, reason="interval")
    seen["event"] = ranks.shared_event(mine if rank == 0 else None).checkpoint
    seen["no_failure"] = ranks.first_failure(None) is None
    failure = ranks.first_failure(ranks.Failure(f"rank {rank} failed", 2 + rank) if rank == 1 else None)
    seen["failure"] = [failure.message, failure.exit_code]
    both = ranks.first_failure(ranks.Failure(f"rank {rank} failed", 2 + rank))
    seen["lowest"] = [both.message, both.exit_code]
    ranks.check_same_state(State(step=3))
    seen["same_state_ok"] = True
    try:
        ranks.check_same_state(State(step=3, last_loss=1.0 + rank))
        seen["different_state"] = "not caught"
    except ranks.RanksDisagree as exc:
        seen["different_state"] = str(exc)
    dist.barrier()
    if rank == 1:  # gone without a word, as a killed rank is
        with open(sys.argv[1] + f".{rank}.json", "w") as out:
            json.dump(seen, out)
        os._exit(0)
    try:
        dist.all_reduce(torch.ones(1))
        seen["lost"] = "the collective went on"
    except Exception as exc:
        seen["lost"] = ranks.lost_peer(exc)
    with open(sys.argv[1] + f".{rank}.json", "w") as out:
        json.dump(seen, out)
    os._exit(0)  # (the group cannot be torn down without its peer)
    """
)


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict]:
    where = tmp_path_factory.mktemp("ranks")
    script = where / "ranks_check.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(script), str(where / "seen")]
    done = subprocess.run(command, capture_output=True, text=True, cwd=where, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads((where / f"seen.{rank}.json").read_text()) for rank in (0, 1)]


def test_only_rank_0_writes(seen):
    assert [s["writer"] for s in seen] == [True, False]


def test_measured_values_are_summed_the_same_on_every_rank(seen):
    assert seen[0]["sums"] == seen[1]["sums"] == [1.5 + 3.0, 0.5, 1.0]


def test_a_stop_request_on_one_rank_stops_every_rank(seen):
    assert [s["stop_none"] for s in seen] == [False, False]
    assert [s["stop_one"] for s in seen] == [True, True]


def test_rank_0s_event_reaches_every_rank(seen):
    assert [s["event"] for s in seen] == ["00000004-deadbeef"] * 2


def test_every_rank_stops_with_the_lowest_failing_ranks_message(seen):
    assert all(s["no_failure"] for s in seen)
    assert [s["failure"] for s in seen] == [["rank 1 failed", 3]] * 2  # rank 1 alone failed
    assert [s["lowest"] for s in seen] == [["rank 0 failed", 2]] * 2  # both failed: rank 0's


def test_ranks_that_folded_different_states_refuse_to_checkpoint(seen):
    assert all(s["same_state_ok"] for s in seen)
    for s in seen:
        assert "folded different states at step 3" in s["different_state"]


def test_a_rank_whose_peer_is_gone_is_told_so_in_one_line(seen):
    assert seen[0]["lost"].startswith("rank 0: rank 1 stopped (killed, or ended by an error of its own)")
    assert "resumes from its last checkpoint" in seen[0]["lost"]


def test_only_a_collective_that_lost_its_peer_is_taken_for_a_lost_peer(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:48263: Connection reset by peer"
    )
    assert ranks.lost_peer(gloo).startswith("rank 1: rank 0 stopped")
    teardown = ValueError("raised while the collective's failure was handled")
    teardown.__context__ = gloo
    assert ranks.lost_peer(teardown).startswith("rank 1: rank 0 stopped")
    assert ranks.lost_peer(torch.distributed.DistBackendError("NCCL communicator was aborted"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert "another of its 4 ranks stopped" in ranks.lost_peer(gloo)
    assert ranks.lost_peer(RuntimeError("index out of range in self")) == ""
    assert ranks.lost_peer(ranks.RanksDisagree("the processes of the run folded different states")) == ""


def test_in_one_process_every_exchange_is_the_identity():
    assert ranks.is_writer()
    assert ranks.sum_over_ranks([1.0, 2.0]) == [1.0, 2.0]
    assert ranks.any_rank(True) and not ranks.any_rank(False)
    failure = ranks.Failure("no", 2)
    assert ranks.first_failure(failure) is failure and ranks.first_failure(None) is None


def test_a_rank_leaving_on_an_error_is_not_cut_short_by_the_launcher_s_sigterm(monkeypatch):
    """torchrun SIGTERMs the ranks left as soon as one dies: a rank leaving the loop on the error that
    follows (its peer gone) ignores it, so its one line is said; a clean exit, or an error of its own,
    gives the handler back."""
    import signal

    from rewind.engine.run.loop import StopRequest

    monkeypatch.setenv("WORLD_SIZE", "2")
    before = signal.getsignal(signal.SIGTERM)
    try:
        with StopRequest():
            assert signal.getsignal(signal.SIGTERM) not in (before, signal.SIG_IGN)  # a clean stop
        assert signal.getsignal(signal.SIGTERM) == before
        with pytest.raises(ValueError), StopRequest():
            raise ValueError("an error of this rank's own")  # its peer may still be waiting: Ctrl-C stops both
        assert signal.getsignal(signal.SIGTERM) == before
        with pytest.raises(RuntimeError), StopRequest():
            raise RuntimeError("gloo/transport: connection closed by peer")
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
