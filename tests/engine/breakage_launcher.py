"""A fork server that runs `rewind` commands for the exactness harness, optionally with a named breakage.

    python -m tests.engine.breakage_launcher        (the harness starts it; one JSON request a line)

Importing torch costs ~1.5 s of a 2-core machine, and the harness starts a dozen processes per run it
trains (one per kill), so this process imports everything once and forks a child per command. A
child is a whole process: SIGKILL takes it down mid-write like any other, and its lock dies with it.
The server never computes (no torch thread pool exists to be copied into a child half-alive), and
it pins one torch thread before any fork, so every child, straight or resumed, sums the same way.

A breakage is a deliberate engine bug, patched into the child before `rewind.tools.cli.main` runs:
the regression checks of tests/engine/test_breakages.py prove that the harness catches each. Every
patched function notes in the child's marks file when it actually changed what the engine did, so a
check cannot pass because the patch was never reached.

Requests ({"op": ...}) and replies, one JSON object a line each:
    start {command, argv, output, marks, breakage}  -> {pid}   fork a child (one at a time)
    poll                                            -> {running} or {exit_code}
    kill                                            -> {exit_code}   SIGKILL unless it already ended
    wait                                            -> {exit_code}
A child's exit_code is negative for a signal (-9: our SIGKILL). command is "rewind" (argv for
`rewind`) or "effective-steps" (argv = [RUN, OUT]: the effective StepCommitted records of RUN as
msgpack bytes, as `rewind.states.history.effective` leaves them, written to OUT). `Launcher` is the
harness's end of this protocol.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 300.0

BREAKAGES: dict[str, Callable[[Marks], None]] = {}


class Marks:
    """What a breakage's patches did in one child: distinct lines appended to a file."""

    def __init__(self, path: str):
        self.path = path
        self._seen: set[str] = set()

    def add(self, line: str) -> None:
        if line in self._seen:
            return
        self._seen.add(line)
        with open(self.path, "a", encoding="utf-8") as out:
            out.write(line + "\n")


def breakage(name: str):
    def register(patch: Callable[[Marks], None]) -> Callable[[Marks], None]:
        BREAKAGES[name] = patch
        return patch

    return register


@breakage("resume-from-start")
def resume_from_start(marks: Marks) -> None:
    """Resume ignores every checkpoint: it restarts from step 0, superseding everything after RunStarted.
    The folded state it resumes from is the start's, so the RunResumed it writes is a legal one and the
    run goes on to finish (a resume from the start retrains every step the same way): only where the
    resume restarted gives the bug away."""
    from rewind.engine.run import entry
    from rewind.states.events import CheckpointCommitted
    from rewind.states.fold import fold
    from rewind.stores.folding import FoldedLog

    def fold_from_start(log, run_dir, store=None):
        records = [(r.seq, r.event) for r in log.records()]
        if any(isinstance(event, CheckpointCommitted) for _, event in records):
            marks.add("resume-from-start: a resume ignored the log's checkpoints")
        started = records[:1]
        return FoldedLog(fold(e for _, e in started), started[0][1].config, started, records[-1][0], -1)

    entry.fold_log = fold_from_start  # the one reader of a resume's log (rewind.engine.run.entry.read_log)


@breakage("effective-counts-superseded")
def effective_counts_superseded(marks: Marks) -> None:
    """`effective()` keeps the records a resume superseded (wherever it was imported by name)."""
    from rewind.states import history

    correct = history.effective

    def effective_with_superseded(records):
        records = list(records)
        if len(correct(records)) != len(records):
            marks.add("effective-counts-superseded: superseded records were counted")
        return records

    for module in list(sys.modules.values()):
        if vars(module).get("effective") is correct:
            module.effective = effective_with_superseded


@breakage("dropout-seed-from-counter")
def dropout_seed_from_counter(marks: Marks) -> None:
    """The dropout seed keyed by the number of steps this process has run instead of the step: the
    classic lost-RNG bug, invisible in a run that never stops (there the two agree)."""
    from rewind.engine.step import step as step_module
    derive_seed = step_module.derive_seed
    steps_here = itertools.count()
    current = 0

    def derive_from_counter(seed, *parts):
        nonlocal current
        if not parts or parts[0] != "dropout":
            return derive_seed(seed, *parts)
        _, step, rank, micro_batch = parts
        if micro_batch == 0:
            current = next(steps_here)
        if current != step:
            marks.add("dropout-seed-from-counter: a step drew another step's dropout masks")
        return derive_seed(seed, "dropout", current, rank, micro_batch)

    step_module.derive_seed = derive_from_counter


def write_effective_steps(run_dir: str, out: str) -> int:
    import msgspec

    from rewind.states import history
    from rewind.states.events import StepCommitted
    from rewind.stores.runs import read_seq_events

    records = history.effective(read_seq_events(run_dir))  # looked up now: a breakage may have patched it
    steps = [msgspec.msgpack.encode(event) for _, event in records if isinstance(event, StepCommitted)]
    with open(out, "wb") as file:
        file.write(msgspec.msgpack.encode(steps))
    return 0


def _child(request: dict) -> None:
    """Never returns: runs the request in this forked process and exits with its code."""
    code = 70
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)  # the server's requests are not the child's input
        output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(output, 1)
        os.dup2(output, 2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if request.get("breakage"):
            BREAKAGES[request["breakage"]](Marks(request["marks"]))
        if request["command"] == "effective-steps":
            code = write_effective_steps(*request["argv"])
        else:
            from rewind.tools.cli import main

            code = main(request["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 2
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _exit_code(status: int) -> int:
    return os.waitstatus_to_exitcode(status)


def serve() -> None:
    import torch

    torch.set_num_threads(1)
    # What every child needs, imported once here (the point of the server): rewind, matplotlib (the
    # schedule plot of every start) and torch._dynamo (torch imports it on the first optimizer built),
    # some 5 s a child otherwise. Importing starts no thread, so forking stays safe.
    import matplotlib
    import torch._dynamo

    import rewind.engine.run.session
    import rewind.tools.cli
    import rewind.tools.export_cmd
    import rewind.tools.replay_cmd
    import rewind.tools.train_cmd  # noqa: F401

    matplotlib.use("Agg")
    import matplotlib.pyplot

    replies = sys.stdout
    child: int | None = None
    exit_code: int | None = None

    def reply(**fields) -> None:
        replies.write(json.dumps(fields) + "\n")
        replies.flush()

    reply(ready=True)
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "start":
            if child is not None and exit_code is None:
                reply(error="a child is still running")
                continue
            pid = os.fork()
            if pid == 0:
                _child(request)
            child, exit_code = pid, None
            reply(pid=pid)
            continue
        if child is None:
            reply(error="no child")
            continue
        if exit_code is None and op == "poll":
            done, status = os.waitpid(child, os.WNOHANG)
            if done:
                exit_code = _exit_code(status)
        elif exit_code is None and op in ("kill", "wait"):
            if op == "kill":
                # Unreaped, so the pid is still ours: no risk of signalling a stranger.
                os.kill(child, signal.SIGKILL)
            exit_code = _exit_code(os.waitpid(child, 0)[1])
        reply(running=True) if exit_code is None else reply(exit_code=exit_code)
    if child is not None and exit_code is None:  # the harness went away mid-run: leave nothing behind
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


# --- the harness's end ------------------------------------------------------------------------------


class Launcher:
    """Starts the server and speaks its protocol (module docstring): one child at a time."""

    def __init__(self, scratch: Path):
        scratch.mkdir(parents=True, exist_ok=True)
        self.scratch = scratch
        self._num_children = 0
        self._running = False
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
        self._stderr = open(scratch / "server.err", "w")  # noqa: SIM115 -- lives as long as the server
        self._server = subprocess.Popen(
            [sys.executable, "-m", "tests.engine.breakage_launcher"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, cwd=REPO, env=env,
        )
        assert self._reply().get("ready"), (scratch / "server.err").read_text()

    def _reply(self) -> dict:
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError(f"the launcher died: {(self.scratch / 'server.err').read_text()[-2000:]}")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"launcher: {reply['error']}")
        return reply

    def _request(self, op: str, **fields) -> dict:
        self._server.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self._server.stdin.flush()
        return self._reply()

    def start(self, command: str, argv: list[str], breakage: str = "", marks: Path | None = None) -> Path:
        """Fork a child; returns the file its stdout and stderr go to."""
        self._num_children += 1
        output = self.scratch / f"child-{self._num_children:03d}.out"
        marks = marks or self.scratch / "marks"
        self._request("start", command=command, argv=argv, output=str(output), marks=str(marks), breakage=breakage)
        self._running = True
        return output

    def exit_code(self) -> int | None:
        """The child's exit code, None while it runs."""
        code = self._request("poll").get("exit_code")
        self._running = code is None
        return code

    def kill(self) -> int:
        self._running = False
        return self._request("kill")["exit_code"]

    def wait(self, timeout_s: float = CHILD_TIMEOUT_S) -> int:
        """The child's exit code once it ends; a child still running after `timeout_s` is killed and
        the harness stops (a hang must not hang the test session)."""
        deadline = time.monotonic() + timeout_s
        while (code := self.exit_code()) is None:
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"a child ran for more than {timeout_s} s; it was killed")
            time.sleep(0.01)
        return code

    def stop(self) -> None:
        """Kill the child if one runs (a harness that failed half way leaves none behind)."""
        if self._running:
            self.kill()

    def run(self, command: str, argv: list[str], breakage: str = "", marks: Path | None = None) -> tuple[int, str]:
        output = self.start(command, argv, breakage, marks)
        code = self.wait()
        return code, output.read_text()

    def close(self) -> None:
        if self._server.poll() is None:
            self._server.stdin.close()
            self._server.wait(timeout=30)
        self._stderr.close()


if __name__ == "__main__":
    serve()
