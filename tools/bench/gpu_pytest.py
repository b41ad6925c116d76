"""Part 1 of `rewind bench gpu`: `pytest -m gpu` with a time limit per test.

This module is also the pytest plugin that enforces the limit (`-p rewind.tools.bench.gpu_pytest`):
before each test it arms faulthandler to dump every thread's stack and end the process if the test is
still running after REWIND_GPU_TEST_TIMEOUT seconds, and it appends one JSON line per test to
REWIND_GPU_TEST_LOG as the test starts and finishes (with each phase's outcome). A hung test thus costs
its limit, not the part's budget: the driver sees which test started and never finished, records it as
timed out, and runs the tests not yet run in a new pytest.

On a machine without CUDA the gpu tests skip themselves: the CPU form is the same command, and shows
that they are collected and import.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

LOG_ENV = "REWIND_GPU_TEST_LOG"
TIMEOUT_ENV = "REWIND_GPU_TEST_TIMEOUT"
PER_TEST_TIMEOUT_S = 60.0
POLL_S = 0.5
GPU_MARK = "mark.gpu"  # how a test is marked: @pytest.mark.gpu, pytestmark = pytest.mark.gpu, marks=...
PYTEST_DONE = (0, 1, 5)  # all passed, some failed, none collected: pytest ran to its end
# The stack dump of a hung test goes to the real stderr (the part's log), not to pytest's capture of the
# test's output, which dies with the process: a copy of fd 2 taken when pytest loads this plugin (-p),
# before its capture begins.
_STDERR = os.fdopen(os.dup(2), "w") if TIMEOUT_ENV in os.environ else None


def _log(record: dict) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _log({"test": item.nodeid, "event": "started"})
    timeout = float(os.environ.get(TIMEOUT_ENV, "0") or 0)
    if timeout > 0:
        faulthandler.dump_traceback_later(timeout, exit=True, file=_STDERR or sys.stderr)
    try:
        return (yield)
    finally:
        if timeout > 0:
            faulthandler.cancel_dump_traceback_later()
        _log({"test": item.nodeid, "event": "finished"})


def pytest_runtest_logreport(report):
    reason = ""
    if report.skipped and isinstance(report.longrepr, tuple):  # (file, line, "Skipped: why")
        reason = str(report.longrepr[2]).removeprefix("Skipped: ")
    _log(
        {
            "test": report.nodeid,
            "event": "report",
            "when": report.when,
            "outcome": report.outcome,
            "seconds": report.duration,
            "reason": reason,
        }
    )


def outcomes(log: Path) -> dict[str, dict]:
    """test -> {"outcome": one of OUTCOMES, "seconds", "reason"}, in the
    order the tests started."""
    tests: dict[str, dict] = {}
    # Whole lines only: pytest may be writing the last one now.
    lines = log.read_text().split("\n")[:-1] if log.exists() else []
    for line in lines:
        record = json.loads(line)
        test = tests.setdefault(record["test"], {"finished": False, "reports": []})
        if record["event"] == "finished":
            test["finished"] = True
        elif record["event"] == "report":
            test["reports"].append(record)
    result = {}
    for name, test in tests.items():
        reports = test["reports"]
        seconds = sum(r["seconds"] for r in reports)
        reason = next((r["reason"] for r in reports if r["outcome"] == "skipped"), "")
        if not test["finished"]:
            outcome = "timed_out"
        elif any(r["outcome"] == "failed" for r in reports):
            call_failed = any(r["outcome"] == "failed" and r["when"] == "call" for r in reports)
            outcome = "failed" if call_failed else "errors"
        elif any(r["outcome"] == "skipped" for r in reports):
            outcome = "skipped"
        else:
            outcome = "passed"
        result[name] = {"outcome": outcome, "seconds": seconds, "reason": reason}
    return result


def gpu_tests_part(rec, device: str, work: Path) -> None:
    from rewind.tools.bench.gpu_part import ROOT

    if not (ROOT / "tests").is_dir():
        rec.skip(f"no tests/ in {ROOT} (an installed copy, not a checkout)")
        return
    # Only the files that mention the marker: `pytest -m gpu tests` would import every test module to
    # read the markers, several times the cost of the few that hold gpu tests.
    files = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if GPU_MARK in p.read_text()
    )
    rec.figures(test_files=files)
    if not files:
        rec.check("the gpu tests are collected", False, f"no test file under tests/ mentions {GPU_MARK}")
        return
    counts = run_marked_tests(rec, ROOT, files, work, PER_TEST_TIMEOUT_S)
    if counts is not None and device == "cuda":
        rec.check("no gpu test skipped on CUDA", counts["skipped"] == 0, _counts_text(counts))


def run_marked_tests(rec, root: Path, files: list[str], work: Path, per_test_timeout: float) -> dict | None:
    """`pytest -m gpu FILES` from `root`, each test limited to `per_test_timeout` seconds; after a test
    that hung, a new pytest for the tests not run yet. Records the figures and checks; returns the counts
    of each outcome (None when pytest did not run to its end)."""
    log = work / "tests.jsonl"
    env = {**os.environ, LOG_ENV: str(log), TIMEOUT_ENV: str(per_test_timeout)}
    rec.figures(per_test_timeout_s=per_test_timeout)
    runs, hung, results = 0, set(), {}
    while True:
        runs += 1
        leave_out = [f"--deselect={name}" for name in results]  # run already, or hung
        command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
        command += ["-p", "rewind.tools.bench.gpu_pytest", *leave_out, *files]
        process = subprocess.Popen(command, cwd=root, env=env)
        while process.poll() is None:  # kept up to date, should the part's budget run out mid-test
            so_far = outcomes(log)
            running = [name for name, r in so_far.items() if r["outcome"] == "timed_out" and name not in hung]
            _record(rec, so_far, runs)
            rec.doing(f"pytest run {runs}" + (f", in {running[-1]}" if running else ""))
            with contextlib.suppress(subprocess.TimeoutExpired):  # back at once when pytest ends
                process.wait(timeout=POLL_S)
        code = process.returncode
        results = outcomes(log)
        counts = _record(rec, results, runs)
        now_hung = {name for name, r in results.items() if r["outcome"] == "timed_out"}
        if now_hung == hung:  # no new test hung: this pytest ran to its end
            break
        hung = now_hung  # a test hung and faulthandler ended pytest: on with those not run yet
    if code not in PYTEST_DONE:
        rec.check(
            "pytest ran to its end", False, f"pytest exited with {code} (collection errors? see the log)"
        )
        return None
    rec.check("the gpu tests are collected", bool(results), f"{len(results)} tests")
    bad = counts["failed"] + counts["errors"] + counts["timed_out"]
    rec.check("no gpu test failed, errored or timed out", bad == 0, _counts_text(counts))
    return counts


OUTCOMES = ("passed", "skipped", "failed", "errors", "timed_out")


def _record(rec, results: dict[str, dict], runs: int) -> dict[str, int]:
    counts = {outcome: sum(r["outcome"] == outcome for r in results.values()) for outcome in OUTCOMES}
    slowest = sorted(results.items(), key=lambda item: -item[1]["seconds"])[:5]
    rec.figures(
        pytest_runs=runs,
        tests=len(results),
        **counts,
        failed_tests=[
            name for name, r in results.items() if r["outcome"] in ("failed", "errors", "timed_out")
        ],
        skip_reasons=_skip_reasons(results),
        slowest_tests={name: r["seconds"] for name, r in slowest},
    )
    return counts


def _skip_reasons(results: dict[str, dict]) -> dict[str, int]:
    reasons: dict[str, int] = {}
    for r in results.values():
        if r["outcome"] == "skipped":
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    return reasons


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {outcome.replace('_', ' ')}" for outcome, n in counts.items() if n)
