"""`rewind bench gpu --out DIR`: every CUDA claim rewind makes, checked by one command in under 8 minutes.

Six parts (rewind.tools.bench.gpu_schema.PART_NAMES), each in a process of its own
(rewind.tools.bench.gpu_part) with a time budget: a part that runs past it is killed with everything it
started, recorded as timed out with what it was doing and what it had measured, and the next part
starts. Nothing here imports torch: a probe process says whether CUDA is usable.

Where there is none (or with --dry-run, which hides it), each part runs its CPU form instead, at sizes
a CPU finishes in seconds: the orchestration, the parts' code and the JSON are exercised the same way, so
the check works the day a GPU is at hand (CI runs it: tests/tools/bench/test_gpu.py).

DIR/gpu.json (the schema: gpu_schema.GpuReport) is rewritten after every part, so a check cut off
midway leaves what it finished; DIR/summary.txt is the same in a few lines; DIR/parts/NAME/ holds each
part's output (log.txt) and its runs.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import msgspec

from rewind.tools.bench.gpu_part import ROOT, kill_tree, read_progress
from rewind.tools.bench.gpu_schema import (
    FIGURES,
    PART_NAMES,
    SCHEMA_VERSION,
    TITLES,
    GpuReport,
    PartReport,
    Progress,
)
from rewind.tools.bench.gpu_summary import summary
from rewind.tools.errors import CommandError, UsageError

# Seconds per part. CUDA: 445 in all, 475 with the probe's 30, under the 8 minutes the check promises
# (estimates for an H100, none measured yet: a cold torch.compile of the 375M model is most of mfu's). The
# CPU forms finish in seconds to a minute; their budgets only stop a hang on a busy machine.
BUDGETS_S = {
    "cuda": {"gpu_tests": 90, "kernels": 45, "mfu": 130, "exactness": 60, "progressive": 65, "fsdp": 55},
    "cpu": dict.fromkeys(PART_NAMES, 300),
}
PROBE_TIMEOUT_S = 30


def parse_parts(text: str | None) -> list[str]:
    """--parts a,b: the parts to run (default: all), each checked against PART_NAMES."""
    if text is None:
        return list(PART_NAMES)
    parts = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in parts if name not in PART_NAMES]
    if unknown or not parts:
        raise UsageError(f"--parts {text!r}: expected a comma-separated list of {', '.join(PART_NAMES)}")
    return parts


def run_gpu_check(out: str, *, dry_run: bool, parts: list[str], as_json: bool = False) -> int:
    out_dir = Path(out)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UsageError(f"--out {out}: exists and is not an empty directory (a check writes a new one)")
    began, date = time.monotonic(), datetime.now(UTC).isoformat(timespec="seconds")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # a part's log is whole up to the moment it is killed
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # every process of the check, pytest and torchrun's included
    found = _probe(env)
    device = "cuda" if found["cuda"] else "cpu"
    if device == "cpu":
        # Runs compared bit for bit across processes need one thread count; one is also far the fastest
        # on a busy machine (OpenMP threads that wait for a core spin).
        env.setdefault("OMP_NUM_THREADS", "1")
    out_dir.mkdir(parents=True, exist_ok=True)  # once torch is known to start
    commit, dirty = _git_state()
    report = GpuReport(
        schema=SCHEMA_VERSION,
        finished=False,
        dry_run=dry_run,
        device=f"cuda:{found['device_name']}" if found["cuda"] else "cpu",
        cuda_skipped=None if found["cuda"] else ("--dry-run (CUDA hidden)" if dry_run else "no CUDA device"),
        torch_version=found["torch_version"],
        cuda_version=found["cuda_version"],
        python_version=platform.python_version(),
        rewind_version=_rewind_version(),
        git_commit=commit,
        git_dirty=dirty,
        date=date,
        duration_s=0.0,
        budget_s=float(PROBE_TIMEOUT_S + sum(BUDGETS_S[device][name] for name in parts)),
        parts=[],
    )
    for name in PART_NAMES:
        if name in parts:
            try:
                part = _run_part(name, device, report.cuda_skipped, out_dir, env)
            except KeyboardInterrupt:
                report.parts.append(_not_run(name, "interrupted (Ctrl-C)", status="error"))
                _write(out_dir, report, began)
                raise
        else:
            part = _not_run(name, "not asked for (--parts)")
        report.parts.append(part)
        _write(out_dir, report, began)
    report.finished = True
    _write(out_dir, report, began)
    print((out_dir / "gpu.json").read_text() if as_json else summary(report), end="")
    unwell = [
        f"{p.name} {p.status.replace('_', ' ')}"
        for p in report.parts
        if p.status not in ("passed", "skipped")
    ]
    if unwell:
        raise CommandError(f"bench gpu: {', '.join(unwell)} (see {out_dir / 'summary.txt'})", exit_code=1)
    return 0


def _probe(env: dict[str, str]) -> dict:
    command = [sys.executable, "-m", "rewind.tools.bench.gpu_part", "probe"]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CommandError(
            f"bench gpu: torch did not start within {PROBE_TIMEOUT_S} s", exit_code=1
        ) from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CommandError(f"bench gpu: torch does not start: {last}", exit_code=1)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run_part(name: str, device: str, cuda_skipped: str | None, out: Path, env: dict[str, str]) -> PartReport:
    work = (out / "parts" / name).resolve()  # resolved: the part runs in it
    part = [name, "--device", device, "--work", str(work)]
    command = [sys.executable, "-m", "rewind.tools.bench.gpu_part", *part]
    budget = BUDGETS_S[device][name]
    return run_part_process(
        name, command, budget=budget, device=device, cuda_skipped=cuda_skipped, out_dir=out, env=env
    )


def run_part_process(
    name: str,
    command: list[str],
    *,
    budget: float,
    device: str,
    cuda_skipped: str | None,
    out_dir: Path,
    env: dict[str, str],
) -> PartReport:
    """Run `command` as part `name` in OUT/parts/NAME (where it writes progress.json and log.txt), killed
    with everything it started once `budget` seconds have passed; its report."""
    work = (out_dir / "parts" / name).resolve()
    work.mkdir(parents=True)
    log = work / "log.txt"
    began = time.monotonic()
    with open(log, "wb") as output:
        # From its own directory: the repository's top-level names (kernels/, tools/) shadow nothing there.
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, cwd=work)
        try:
            code = process.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            code = None
        except KeyboardInterrupt:
            kill_tree(process.pid)
            process.wait()
            raise
        finally:
            if process.poll() is None:
                kill_tree(process.pid)
                process.wait()
    duration = time.monotonic() - began
    progress = read_progress(work) or Progress()
    schema_error = None
    try:
        figures = msgspec.convert(progress.figures, type=FIGURES[name])
    except msgspec.ValidationError as exc:  # a part that writes what the schema does not know is broken
        figures, schema_error = FIGURES[name](), f"its figures do not fit the schema: {exc}"
    status, reason = _outcome(code, progress, budget, log, schema_error)
    return PartReport(
        name=name,
        title=TITLES[name],
        status=status,
        device=device,
        cuda_skipped=cuda_skipped,
        reason=reason,
        budget_s=float(budget),
        duration_s=duration,
        figures=figures,
        checks=progress.checks,
        goals=progress.goals,
        log=str(log.relative_to(out_dir.resolve())),
    )


def _outcome(code: int | None, progress: Progress, budget: float, log: Path, schema_error: str | None):
    failed = [check.name for check in progress.checks if not check.passed]
    if code is None:
        return "timed_out", f"ran past its budget of {budget:g} s, while: {progress.doing or 'starting'}"
    if code != 0:
        return "error", f"exited with {code}: {_last_line(log)}"
    if schema_error:
        return "error", schema_error
    if progress.skipped:
        return "skipped", progress.skipped
    if failed:
        return "failed", "; ".join(failed)
    if not progress.checks:
        return "error", "it checked nothing"
    return "passed", None


def _not_run(name: str, reason: str, status: str = "skipped") -> PartReport:
    return PartReport(
        name=name,
        title=TITLES[name],
        status=status,
        device=None,
        cuda_skipped=None,
        reason=reason,
        budget_s=0.0,
        duration_s=0.0,
        figures=FIGURES[name](),
        checks=[],
        goals=[],
        log=None,
    )


def _write(out_dir: Path, report: GpuReport, began: float) -> None:
    report.duration_s = time.monotonic() - began
    for name, text in (
        ("gpu.json", msgspec.json.format(msgspec.json.encode(report))),
        ("summary.txt", summary(report)),
    ):
        tmp = out_dir / f".{name}.tmp"
        tmp.write_bytes(text if isinstance(text, bytes) else text.encode())
        os.replace(tmp, out_dir / name)


def _last_line(log: Path) -> str:
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def _git_state() -> tuple[str | None, bool | None]:
    """The commit measured and whether the work tree differed from it; None outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None, None
        status = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    return head.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None


def _rewind_version() -> str:
    from rewind.tools.cli import version

    return version()
