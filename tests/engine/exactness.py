"""The exactness harness: train a run straight, train it again through SIGKILLs and resumes, and say
what differs.

The run (`OVERRIDES` on examples/tiny.toml, 40 steps) has everything a resume must restore: dropout,
two micro-batches per step, fades between the stages, two reference refreshes with KL beta > 0.
Group commits (every 3 steps) and checkpoints (every 5) fall on different steps, so a process killed
a few steps after a checkpoint leaves committed steps past it: the resume must restart from the
checkpoint and supersede them, and recompute them bit for bit.

Kills are drawn over the whole run: one target step in each of `num_kills` equal bands of the run,
each reached by polling the log of the process being killed (so a loaded machine delays a kill but
does not move it to another part of the run), and then, by mode: "anywhere" (a random fraction of up to three steps
later: mid-step, mid-commit, mid-validation), "in-checkpoint" (while a checkpoint directory is being
written or deleted) or "past-checkpoint" (as soon as a step after the last checkpoint is committed:
retried, up to 4 times, until the log really holds one: every schedule makes a non-empty superseded
range).

`check` compares and returns every problem by name instead of raising at the first, so that the
regression checks (test_breakages.py) can say *which* check caught a deliberate breakage.
"""

from __future__ import annotations

import atexit
import random
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from rewind.states.events import StepCommitted
from tests.conftest import EXAMPLES
from tests.engine.breakage_launcher import Launcher
from tests.engine.exactness_checks import (
    Killed,
    Straight,
    check,
    checkpoint_in_flight,
    committed,
    committed_past_checkpoint,
)

TINY = EXAMPLES / "tiny.toml"
NUM_STEPS = 40  # 20 + 10 + 10 steps of 8 rows x 32 tokens
REPORT_INTERVAL = 3  # group commits ...
CHECKPOINT_INTERVAL = 5  # ... and checkpoints coincide only every 15 steps
OVERRIDES = (
    "training.tokens=[5120,2560,2560]",
    "architecture.dropout=0.1",
    "training.per_device_batch_size=4",  # two micro-batches per step
    "optimization.kl.reference_update_stages=[1,2]",
    f"logging.report_interval={REPORT_INTERVAL}",
    f"logging.checkpoint_interval={CHECKPOINT_INTERVAL}",
    "logging.validation_interval=7",
    "logging.keep_last_checkpoints=2",
)
KILLED = -9  # a child's exit code when our SIGKILL ended it
MAX_PAST_CHECKPOINT_TRIES = 4
HUNT_TIMEOUT_S = 120.0  # a kill not due by then is made anyway


def train_argv(run_dir: Path) -> list[str]:
    sets = [part for override in OVERRIDES for part in ("--set", override)]
    return ["train", str(TINY), "--run-dir", str(run_dir), "--no-progress", *sets]


_LAUNCHER: list[Launcher] = []


def launcher(factory: pytest.TempPathFactory) -> Launcher:
    """One server per test session (it costs a torch import), shut down when the session ends."""
    if not _LAUNCHER:
        _LAUNCHER.append(Launcher(factory.mktemp("launcher")))
        atexit.register(_LAUNCHER[0].close)
    return _LAUNCHER[0]


# --- the runs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    step: int  # kill once the process has committed this step ...
    mode: str  # ... and then: "anywhere" | "in-checkpoint" | "past-checkpoint"


def kill_schedule(seed: int, num_kills: int) -> list[Kill]:
    """One kill in each of `num_kills` equal bands of the run, modes shuffled, one past-checkpoint."""
    rng = random.Random(seed)
    bands = [(1 + i * NUM_STEPS // num_kills, (i + 1) * NUM_STEPS // num_kills) for i in range(num_kills)]
    modes = ["past-checkpoint"] + [rng.choice(["anywhere", "in-checkpoint"]) for _ in range(num_kills - 1)]
    rng.shuffle(modes)
    return [Kill(rng.randint(low, high), mode) for (low, high), mode in zip(bands, modes, strict=True)]


def train_straight(server: Launcher, run_dir: Path) -> Straight:
    began = time.monotonic()
    code, output = server.run("rewind", train_argv(run_dir))
    assert code == 0, output
    return Straight(run_dir, (time.monotonic() - began) / NUM_STEPS)


def train_killed(
    server: Launcher, run_dir: Path, schedule: list[Kill], seconds_per_step: float, *, seed: int,
    breakage: str = "", marks: Path | None = None,
) -> Killed:
    """Train through the kills of `schedule`, then to the end. Unexpected exits go to `problems`."""
    try:
        return _train_killed(server, run_dir, schedule, seconds_per_step, random.Random(seed), breakage, marks)
    finally:
        server.stop()


def _train_killed(
    server: Launcher, run_dir: Path, schedule: list[Kill], seconds_per_step: float, rng: random.Random,
    breakage: str, marks: Path | None,
) -> Killed:
    killed = Killed(run_dir)
    pending = list(schedule)
    tries = 0
    while True:
        before = committed(run_dir)
        output = server.start("rewind", train_argv(run_dir), breakage, marks)
        code = _hunt(server, run_dir, len(before), pending[0], seconds_per_step, rng) if pending else server.wait()
        in_flight = checkpoint_in_flight(run_dir)  # the dead process's, before the next one cleans up
        after = committed(run_dir)
        if before:
            killed.resumes.append((before, after[len(before):]))
        if code not in (0, KILLED):
            killed.problems["exit"] = f"exit code {code}: {output.read_text()[-1500:]}"
            return killed
        if code == 0:
            return killed  # finished (maybe before a kill could land)
        killed.num_kills += 1
        kill = pending[0]
        reached = max((e.step for _, e in after[len(before):] if isinstance(e, StepCommitted)), default=None)
        killed.kills.append(
            f"{kill}: last committed step {reached}, {'a checkpoint in flight' if in_flight else 'no checkpoint in flight'}, "
            f"{'steps past the last checkpoint' if committed_past_checkpoint(after) else 'nothing past the last checkpoint'}"
        )
        tries += 1
        if kill.mode == "past-checkpoint" and not committed_past_checkpoint(after) and tries < MAX_PAST_CHECKPOINT_TRIES:
            continue  # a checkpoint was committed between seeing the step and the kill: again
        pending.pop(0)
        tries = 0


def _hunt(server: Launcher, run_dir: Path, num_before: int, kill: Kill, seconds_per_step: float, rng) -> int:
    """Poll the running child's log until `kill` is due, kill it; its exit code (0: it finished first)."""
    deadline = time.monotonic() + HUNT_TIMEOUT_S
    while time.monotonic() < deadline:
        code = server.exit_code()
        if code is not None:
            return code
        records = committed(run_dir)
        steps = [e.step for _, e in records[num_before:] if isinstance(e, StepCommitted)]
        reached = max(steps, default=-1)
        if reached >= kill.step:
            if kill.mode == "anywhere":
                time.sleep(rng.uniform(0.0, 3 * seconds_per_step))
                break
            if kill.mode == "past-checkpoint" and committed_past_checkpoint(records):
                break
            if kill.mode == "in-checkpoint" and (
                checkpoint_in_flight(run_dir) or reached >= kill.step + 2 * CHECKPOINT_INTERVAL
            ):
                break
        time.sleep(0.002)
    return server.kill()


# --- shared by the test modules (each run is trained once per session) ------------------------------

KILL_SEED = 20261121
CI_SCHEDULE = kill_schedule(KILL_SEED, 3)
_SHARED: dict[str, object] = {}


def shared_straight(factory: pytest.TempPathFactory) -> tuple[Launcher, Straight]:
    server = launcher(factory)
    if "straight" not in _SHARED:
        _SHARED["straight"] = train_straight(server, factory.mktemp("exact") / "straight")
    return server, _SHARED["straight"]  # type: ignore[return-value]


def shared_killed(factory: pytest.TempPathFactory) -> tuple[Killed, dict[str, str]]:
    """The run trained through CI_SCHEDULE with no breakage, and what `check` says of it."""
    if "killed" not in _SHARED:
        server, straight = shared_straight(factory)
        run_dir = factory.mktemp("exact") / "killed"
        killed = train_killed(server, run_dir, CI_SCHEDULE, straight.seconds_per_step, seed=KILL_SEED)
        _SHARED["killed"] = (killed, check(server, straight, killed))
    return _SHARED["killed"]  # type: ignore[return-value]
