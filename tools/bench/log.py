"""`rewind bench log`: event-log throughput as ratios against raw baselines measured in the same run.

- append: `append` + `commit` every event, and every 100 events, against a loop that writes the very
  same frame bytes with os.write + fdatasync per group (`append_ratio_commit_<k>`, goal >= 0.5).
  Only meaningful where fdatasync reaches stable storage: on tmpfs the baseline is a memcpy.
- replay: reading the log back (file read, framing, CRC and sequence checks, decoding) and folding
  it into the control state, against msgspec decoding of the same payloads from memory plus the
  same fold (`replay_ratio`, goal >= 0.8), in CPU time. `decode_ratio` is the same without the fold
  on either side: the log's whole read overhead, which the fold dilutes in a real replay.

Prints nothing; returns a flat dict of floats and ints (the CLI prints it).
"""

from __future__ import annotations

import functools
import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import msgspec

from rewind.states.config import Config, Sampling
from rewind.states.config_identity import config_hash
from rewind.states.events import AnyEvent, RunStarted, StageEntered, StepCommitted
from rewind.states.stages import PretrainStage
from rewind.stores import fsio
from rewind.stores.codec import HEADER_SIZE, TRAILER, encode_frame
from rewind.stores.eventlog import EventLog, read_events

_DATASETS = ("grammar", "reverse", "sort", "add")


def bench_events(num_steps: int) -> list:
    """A foldable log: RunStarted, StageEntered, then `num_steps` realistic StepCommitted events."""
    base = Config()
    tokens_per_step = base.tokens_per_step
    stage = PretrainStage(
        tokens=max(num_steps, 1) * tokens_per_step,
        datasets=[Sampling(name="grammar", rate=0.5), Sampling(name="sort", rate=0.5)],
    )
    config = msgspec.structs.replace(base, stages=[stage])
    events: list = [
        RunStarted(step=0, tokens=0, config=config, config_hash=config_hash(config)),
        StageEntered(step=0, tokens=0, stage=0),
    ]
    for step in range(1, num_steps + 1):
        events.append(
            StepCommitted(
                step=step,
                tokens=step * tokens_per_step,
                stage=0,
                lr=3e-4 * min(1.0, step / 100),
                beta=0.05,
                loss=2.5 / (1 + step / 1000) + 1e-7 * (step % 97),
                kl=0.0125 + 1e-8 * step,
                grad_norm=0.75 + 1e-6 * (step % 13),
                rows=[6, 2],
                cursors={name: step * (i + 3) for i, name in enumerate(_DATASETS)},
            )
        )
    return events


def best_times(runs: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Best of `repeats` seconds for each run, interleaved so that a busy spell hits all alike."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(repeats):
        for key, run in runs.items():
            gc.collect()
            best[key] = min(best[key], run())
    return best


def _cpu_timed(work: Callable[[], Any]) -> Callable[[], float]:
    """CPU seconds of this thread: replay is CPU-bound, and other processes on a busy machine then
    disturb the ratio far less than they disturb wall time."""

    def run() -> float:
        start = time.thread_time()
        work()
        return time.thread_time() - start

    return run


def _log_appends(path: str, events: list, commit_every: int) -> float:
    shutil.rmtree(path, ignore_errors=True)
    with EventLog.open(path, "w") as log:
        start = time.perf_counter()
        for i, event in enumerate(events):
            log.append(event)
            if (i + 1) % commit_every == 0:
                log.commit()
        log.commit()
        return time.perf_counter() - start


def _raw_writes(path: str, groups: list[bytes]) -> float:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    try:
        start = time.perf_counter()
        for group in groups:
            fsio.write_all(fd, group)
            fsio.sync_fd(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)


def run_log_bench(num_events: int = 20_000, tmpdir: str | None = None, repeats: int = 5) -> dict:
    """Measure the event log; `tmpdir` picks the filesystem (a fresh temporary directory by default)."""
    events = bench_events(max(num_events - 2, 1))
    encode = msgspec.msgpack.Encoder().encode
    frames = [encode_frame(seq, encode(event)) for seq, event in enumerate(events)]
    payloads = [frame[HEADER_SIZE : -TRAILER.size] for frame in frames]
    # One sync per event costs a disk flush each (milliseconds on a busy disk): fewer events and
    # repeats are plenty to measure it.
    num_synced = min(len(events), max(50, len(events) // 40))
    result: dict[str, Any] = {
        "num_events": len(events),
        "num_events_commit_1": num_synced,
        "bytes_per_event": sum(map(len, frames)) / len(frames),
    }
    with tempfile.TemporaryDirectory(dir=tmpdir, prefix="rewind-bench-log-") as root:
        for commit_every, count in ((1, num_synced), (100, len(events))):
            run = os.path.join(root, f"log-{commit_every}")
            groups = [
                b"".join(frames[i : min(i + commit_every, count)]) for i in range(0, count, commit_every)
            ]
            best = best_times(
                {
                    "ours": functools.partial(_log_appends, run, events[:count], commit_every),
                    "raw": functools.partial(_raw_writes, os.path.join(root, "raw"), groups),
                },
                repeats if commit_every > 1 else min(repeats, 3),
            )
            result[f"append_events_per_s_commit_{commit_every}"] = count / best["ours"]
            result[f"raw_events_per_s_commit_{commit_every}"] = count / best["raw"]
            result[f"append_ratio_commit_{commit_every}"] = best["raw"] / best["ours"]
        result.update(_replay(run, payloads, len(events), repeats))  # `run` holds every event now
    return result


def _replay(run: str, payloads: list[bytes], num_events: int, repeats: int) -> dict[str, Any]:
    decode = msgspec.msgpack.Decoder(AnyEvent).decode
    if read_events(run) != [decode(p) for p in payloads]:  # the two sides must do the same work
        raise RuntimeError("bench: the log does not hold the benchmark's events")
    try:
        from rewind.states.fold import fold
    except ImportError:  # the fold is not there yet: a replay is the decode alone
        fold = None
    runs = {
        "decode": _cpu_timed(lambda: read_events(run)),
        "raw_decode": _cpu_timed(lambda: [decode(p) for p in payloads]),
    }
    if fold is not None:
        runs["replay"] = _cpu_timed(lambda: fold(read_events(run)))
        runs["raw_replay"] = _cpu_timed(lambda: fold([decode(p) for p in payloads]))
    best = best_times(runs, repeats)
    best.setdefault("replay", best["decode"])
    best.setdefault("raw_replay", best["raw_decode"])
    figures: dict[str, Any] = {"replay_includes_fold": fold is not None}
    for kind in ("decode", "replay"):
        figures[f"{kind}_events_per_s"] = num_events / best[kind]
        figures[f"raw_{kind}_events_per_s"] = num_events / best[f"raw_{kind}"]
        figures[f"{kind}_ratio"] = best[f"raw_{kind}"] / best[kind]
    return figures
