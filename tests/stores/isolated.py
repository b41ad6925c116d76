"""Calling a reader in a worker process with a deadline and a memory limit, for tests that feed readers
hostile files: a reader that regresses to blocking on a FIFO, or to reading /dev/zero whole, must fail
its test, not hang it or take the machine's memory. An alarm in the test's own process cannot promise
that: a C-level read loop (`file.read()` of /dev/zero) never returns to let the signal handler run.

    with Isolated(setup="tests.tools.test_hostile_files:shrink_caps") as worker:
        outcome = worker.call("tests.tools.test_hostile_files:read_with", "tokenizer.json", path)

The worker is one spawned interpreter, reused across calls; a call past its deadline kills it (the next
call starts another). Targets are "module:function" names, imported by the worker.
"""

from __future__ import annotations

import importlib
import multiprocessing
import resource
from typing import NamedTuple

# Address space the worker may add to what it has after its imports: a reader that tries to hold a
# file without end gets a MemoryError here instead of the machine's memory.
EXTRA_ADDRESS_SPACE = 2 << 30


class Outcome(NamedTuple):
    """What a call did: "returned" (`value`), "raised" (`types`: the exception's class names, its own
    first, and `message`), "timeout" or "died" (the worker ended: `message` says how)."""

    kind: str
    types: tuple[str, ...] = ()
    message: str = ""
    value: object = None

    def raised(self, error: type[BaseException]) -> bool:
        return self.kind == "raised" and error.__name__ in self.types


def _resolve(target: str):
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def _serve(conn, setup: str | None) -> None:
    if setup is not None:
        _resolve(setup)()
    with open("/proc/self/statm") as handle:
        size = int(handle.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (size + EXTRA_ADDRESS_SPACE, resource.RLIM_INFINITY))
    while (request := conn.recv()) is not None:
        target, args = request
        try:
            value = _resolve(target)(*args)
        except BaseException as exc:  # everything goes back: the test decides what was expected
            names = tuple(cls.__name__ for cls in type(exc).__mro__)
            conn.send(Outcome("raised", names, str(exc)[:2000]))
        else:
            conn.send(Outcome("returned", value=value))


class Isolated:
    def __init__(self, *, timeout: float = 30, setup: str | None = None):
        self.timeout = timeout
        self.setup = setup
        self._process = None

    def __enter__(self) -> Isolated:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, self.setup), daemon=True)
        self._process.start()

    def call(self, target: str, *args) -> Outcome:
        """`target(*args)` in the worker, within the deadline (the first call includes its start)."""
        if self._process is None or not self._process.is_alive():
            self._start()
        self._conn.send((target, args))
        if self._conn.poll(self.timeout):
            try:
                return self._conn.recv()
            except EOFError:
                pass
        self._process.kill()
        self._process.join()
        code = self._process.exitcode
        self._process = None
        return Outcome("timeout" if code == -9 else "died", message=f"worker exit code {code}")

    def close(self) -> None:
        if self._process is not None and self._process.is_alive():
            self._conn.send(None)
            self._process.join(10)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._process = None
