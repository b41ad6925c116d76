"""What the processes of a sharded run tell each other: sums of what a step measured, a stop request,
rank 0's events (as msgspec bytes, never a pickle), and the failure that stops them all. Each is a
no-op in one process, so the single-process path computes exactly what it always did.

A rank that dies (killed, or gone on an error of its own) cannot tell the others: their next
collective fails instead, deep in the loop, the step or the model. `lost_peer` recognises that failure,
so that a survivor says so in one line (rewind.tools.cli) rather than in a traceback.
"""

from __future__ import annotations

import hashlib
import os

import msgspec
import torch
import torch.distributed as dist

from rewind.states.events import AnyEvent, Event
from rewind.states.state import State


def is_writer() -> bool:
    """Whether this process writes the run (rank 0, or the only process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def _wire() -> torch.device:
    """Where collectives' tensors must live: NCCL talks between GPUs, gloo between CPUs."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over_ranks(values: list[float]) -> list[float]:
    """The sums over every rank of `values` (float64), the same on every rank; itself in one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return values
    summed = torch.tensor(values, dtype=torch.float64, device=_wire())
    dist.all_reduce(summed)
    return summed.cpu().tolist()


def gathered_rows(mine: torch.Tensor) -> torch.Tensor:
    """Every rank's `mine` (equal shapes: each its share of a batch's rows) concatenated along the rows in
    rank order, the same on every rank; `mine` itself in one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    wire = mine.to(_wire())
    shares = [torch.empty_like(wire) for _ in range(dist.get_world_size())]
    dist.all_gather(shares, wire)
    return torch.cat(shares).to(mine.device)


def any_rank(flag: bool) -> bool:
    """Whether `flag` is set on any rank (a stop request seen by one process stops them all, together)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int64, device=_wire())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def shared_event(event: Event | None) -> Event:
    """Rank 0's `event` on every rank (the others pass None): sent as its msgspec JSON bytes."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert event is not None
        return event
    payload = _broadcast_bytes(msgspec.json.encode(event) if dist.get_rank() == 0 else b"", source=0)
    return msgspec.json.decode(payload, type=AnyEvent)  # type: ignore[return-value]


class RanksDisagree(RuntimeError):
    """The processes of a sharded run folded different states: their events were not the same."""


def check_same_state(state: State) -> None:
    """Every rank folds rank 0's events, so their states must be equal; checked (a digest of the
    whole state, compared over the ranks) before each checkpoint, so a divergence can never be
    written as if it were the run: it stops the run with a RanksDisagree instead."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    digest = int.from_bytes(hashlib.sha256(msgspec.json.encode(state)).digest()[:7], "big")
    bounds = torch.tensor([digest, -digest], dtype=torch.int64, device=_wire())
    dist.all_reduce(bounds, op=dist.ReduceOp.MIN)  # (min, -max): equal on every rank iff min == max
    if int(bounds[0]) != -int(bounds[1]):
        raise RanksDisagree(
            f"the processes of the run folded different states at step {state.step}; nothing was checkpointed "
            "(resume from the last checkpoint; report this with the run's log)"
        )


class Failure(msgspec.Struct, frozen=True):
    message: str
    exit_code: int


def first_failure(failure: Failure | None) -> Failure | None:
    """The failure of the lowest rank that failed (None if none did), on every rank: so that every
    process of a sharded run stops with the same one-line message, which rank 0 alone prints."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failure
    world = dist.get_world_size()
    lowest = torch.tensor([dist.get_rank() if failure is not None else world], dtype=torch.int64, device=_wire())
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    source = int(lowest.item())
    if source == world:
        return None
    mine = msgspec.json.encode(failure) if dist.get_rank() == source else b""
    return msgspec.json.decode(_broadcast_bytes(mine, source=source), type=Failure)


def _broadcast_bytes(payload: bytes, *, source: int) -> bytes:
    size = torch.tensor([len(payload)], dtype=torch.int64, device=_wire())
    dist.broadcast(size, src=source)
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8, device=_wire())
    if dist.get_rank() == source:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    dist.broadcast(buffer, src=source)
    return buffer.cpu().numpy().tobytes()


# What a collective raises once a peer process is gone: NCCL's DistBackendError, gloo's plain
# RuntimeError naming its transport (a read or write on the pair's socket: reset, closed, broken pipe).
_PEER_LOST_MARKS = ("gloo/transport", "Connection reset by peer", "Connection closed by peer", "Broken pipe")


def lost_peer(exc: BaseException) -> str:
    """One line for the user when `exc`, or an exception it was raised while handling (the group's
    teardown fails the same way), is a collective that failed because another rank of this sharded run
    is gone; "" for anything else."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if isinstance(current, dist.DistError) or (
            isinstance(current, RuntimeError) and any(mark in text for mark in _PEER_LOST_MARKS)
        ):
            return _lost_line()
        current = current.__cause__ or current.__context__
    return ""


def _lost_line() -> str:
    rank, world = int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
    # Two processes: the peer is the other one. More: the error names a socket, not a rank.
    peer = f"rank {1 - rank}" if world == 2 and rank in (0, 1) else f"another of its {world} ranks"
    return (
        f"rank {rank}: {peer} stopped (killed, or ended by an error of its own) and the run cannot go on "
        "without it; run the same command again: the run resumes from its last checkpoint"
    )
