"""`rewind bench gpu`: its dry run (every part's CPU form, CUDA hidden) writes a report that fits the
schema (rewind.tools.bench.gpu_schema, the one the writer uses), and the orchestration keeps its word: a
part past its budget is killed with everything it started and kept as timed out with what it measured,
a part that crashes, fails a check or writes figures the schema does not know is said so, the others go
on; a hung gpu test costs its own limit and the tests after it still run.

The dry run is split in two commands (--parts) so that each test stays under a minute on two cores."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgspec
import pytest

from rewind.tools.bench.gpu import BUDGETS_S, PROBE_TIMEOUT_S, run_part_process
from rewind.tools.bench.gpu_part import Recorder
from rewind.tools.bench.gpu_pytest import run_marked_tests
from rewind.tools.bench.gpu_schema import PART_NAMES, GpuReport, GpuTestsFigures, decode_report
from rewind.tools.cli import main


def dry_run(tmp_path: Path, parts: tuple[str, ...]) -> tuple[GpuReport, Path]:
    out = tmp_path / "check"
    command = [sys.executable, "-m", "rewind.tools.cli", "bench", "gpu", "--out", str(out), "--dry-run"]
    done = subprocess.run(
        [*command, "--parts", ",".join(parts)], capture_output=True, text=True, cwd=tmp_path, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = decode_report((out / "gpu.json").read_bytes())
    assert done.stdout == (out / "summary.txt").read_text()
    assert report.finished and report.dry_run and report.device == "cpu"
    assert report.cuda_skipped == "--dry-run (CUDA hidden)" and report.torch_version
    assert [part.name for part in report.parts] == list(PART_NAMES)
    for part in report.parts:
        if part.name in parts:
            assert (part.status, part.device, part.reason) == ("passed", "cpu", None), part
            assert part.cuda_skipped == report.cuda_skipped and part.checks
            assert all(check.passed for check in part.checks)
            assert (out / part.log).is_file() and part.name in done.stdout
        else:
            assert (part.status, part.reason, part.device) == ("skipped", "not asked for (--parts)", None)
    return report, out


@pytest.mark.slow
def test_the_dry_run_of_the_tests_kernels_mfu_and_exactness_parts(tmp_path):
    report, _ = dry_run(tmp_path, ("gpu_tests", "kernels", "mfu", "exactness"))
    tests, kernels, mfu, exactness = (part.figures for part in report.parts[:4])
    # Collected and imported, skipped without CUDA.
    assert tests.tests > 0 and tests.skipped == tests.tests and tests.pytest_runs == 1
    assert "tests/kernels/test_triton_losses.py" in tests.test_files
    assert {(a.implementation, a.dtype) for a in kernels.agreement} == {
        (i, d) for i in ("triton", "chunked") for d in ("float32", "bfloat16")
    }
    assert [k.implementation for k in kernels.fused] == ["chunked"] and kernels.fused[0].memory_ratio < 1
    assert [goal.name for goal in report.parts[1].goals] == ["chunked memory ratio"]
    assert mfu.precision == "bf16-mixed" and mfu.eager.tokens_per_second > 0 and mfu.eager.mfu is None
    assert mfu.compiled is None and mfu.compiled_skipped
    assert exactness.rerun.bitwise and exactness.resumed.bitwise and exactness.fork.bitwise
    assert 0 < exactness.killed_after_checkpoint < exactness.num_steps
    assert exactness.fork_step == 4 and exactness.fork.steps_compared == exactness.num_steps - 4
    assert exactness.replay_exit == 0


@pytest.mark.slow
def test_the_dry_run_of_the_progressive_and_fsdp_parts(tmp_path):
    report, _ = dry_run(tmp_path, ("progressive", "fsdp"))
    progressive, fsdp = report.parts[4].figures, report.parts[5].figures
    assert progressive.resumed.bitwise and progressive.killed_after_checkpoint == 6
    assert fsdp.resumed.bitwise and fsdp.recorded_world_sizes == [1, 1]
    assert 'compute.precision="bf16-mixed"' in fsdp.overrides


# --- the orchestration, with stand-in parts ------------------------------------------------------


def stand_in(tmp_path: Path, body: str, budget: float = 60.0):
    """Run a Python script as the gpu_tests part; `work` and `Recorder` are defined for it."""
    work = (tmp_path / "parts" / "gpu_tests").resolve()
    prelude = f"from rewind.tools.bench.gpu_part import Recorder\nfrom pathlib import Path\nwork = Path({str(work)!r})\n"
    command = [sys.executable, "-c", prelude + textwrap.dedent(body)]
    return run_part_process(
        "gpu_tests",
        command,
        budget=budget,
        device="cpu",
        cuda_skipped=None,
        out_dir=tmp_path,
        env=dict(os.environ),
    )


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: killed, not yet reaped
    except FileNotFoundError:
        return True


def test_a_part_past_its_budget_is_killed_with_what_it_started_and_keeps_what_it_measured(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    report = stand_in(
        tmp_path,
        f"""
        import subprocess, time
        rec = Recorder(work)
        rec.figures(tests=3, passed=3)
        child = subprocess.Popen(["sleep", "120"])
        Path({str(pid_file)!r}).write_text(str(child.pid))
        rec.doing("waiting for nothing")
        time.sleep(120)
        """,
        budget=3,  # the stand-in is at its sleep within a fraction of a second (no torch to import)
    )
    assert report.status == "timed_out" and report.duration_s < 60
    assert report.reason == "ran past its budget of 3 s, while: waiting for nothing"
    assert isinstance(report.figures, GpuTestsFigures) and (report.figures.tests, report.figures.passed) == (
        3,
        3,
    )
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild)


def test_a_part_that_crashes_is_an_error_with_its_last_line(tmp_path):
    report = stand_in(tmp_path, "rec = Recorder(work)\nraise SystemExit('the device fell off the bus')")
    assert report.status == "error"
    assert report.reason == "exited with 1: the device fell off the bus"


def test_a_failed_check_fails_the_part_and_names_it(tmp_path):
    report = stand_in(
        tmp_path,
        """
        rec = Recorder(work)
        rec.check("collected", True)
        rec.check("nothing failed", False, "2 failed")
        """,
    )
    assert (report.status, report.reason) == ("failed", "nothing failed")
    assert [(c.name, c.passed, c.detail) for c in report.checks] == [
        ("collected", True, ""),
        ("nothing failed", False, "2 failed"),
    ]


def test_figures_the_schema_does_not_know_make_the_part_an_error(tmp_path):
    report = stand_in(tmp_path, "rec = Recorder(work)\nrec.figures(testz=3)\nrec.check('collected', True)")
    assert report.status == "error" and report.reason.startswith("its figures do not fit the schema")
    assert report.figures == GpuTestsFigures()


def test_a_part_that_checks_nothing_does_not_pass(tmp_path):
    report = stand_in(tmp_path, "rec = Recorder(work)\nrec.figures(tests=0)")
    assert (report.status, report.reason) == ("error", "it checked nothing")


def test_the_schema_refuses_what_the_writer_must_not_write(tmp_path):
    report = stand_in(tmp_path, "rec = Recorder(work)\nrec.check('collected', True)")
    assert report.status == "passed"
    part = msgspec.to_builtins(report)
    msgspec.convert(part, type=type(report))  # as written: fits
    bad = [
        {**part, "reason": "passed, but with a reason"},
        {**part, "figures": {**part["figures"], "part": "kernels"}},  # another part's figures
        {**part, "name": "warp_drive"},
        {**part, "status": "mostly_passed"},
        {**part, "surprise": 1},
    ]
    for case in bad:
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(case, type=type(report))
    header = {
        "schema": 1, "finished": True, "dry_run": True, "device": "cpu", "cuda_skipped": "no CUDA device",
        "torch_version": "2.13.0", "cuda_version": None, "python_version": "3.11", "rewind_version": "0.2.0",
        "git_commit": None, "git_dirty": None, "date": "2026-01-01T00:00:00+00:00", "duration_s": 1.0,
        "budget_s": 2.0,
    }  # fmt: skip
    with pytest.raises(msgspec.ValidationError, match="finished report names every part"):
        decode_report(msgspec.json.encode({**header, "parts": [part]}))
    unfinished = {**header, "finished": False, "parts": [part]}
    assert decode_report(msgspec.json.encode(unfinished)).parts[0].name == "gpu_tests"
    with pytest.raises(msgspec.ValidationError, match="out of order or repeated"):
        decode_report(msgspec.json.encode({**unfinished, "parts": [part, part]}))


def test_a_hung_test_costs_its_own_limit_and_the_tests_after_it_still_run(tmp_path, monkeypatch):
    # The stand-in repository needs no installed pytest plugin: not loading them (zarr's, anyio's,
    # hypothesis', xdist) saves each of the two pytest runs a second or more.
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    root = tmp_path / "repo"
    root.mkdir()
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    (root / "test_marked.py").write_text(
        textwrap.dedent(
            """
            import time
            import pytest

            @pytest.mark.gpu
            def test_a():
                pass

            @pytest.mark.gpu
            def test_b_hangs():
                time.sleep(120)

            @pytest.mark.gpu
            def test_c():
                assert 1 + 1 == 3

            def test_unmarked():
                pass
            """
        )
    )
    work = tmp_path / "work"
    work.mkdir()
    rec = Recorder(work)
    began = time.monotonic()
    counts = run_marked_tests(rec, root, ["test_marked.py"], work, per_test_timeout=2.0)
    assert time.monotonic() - began < 60
    assert counts == {"passed": 1, "skipped": 0, "failed": 1, "errors": 0, "timed_out": 1}
    figures = msgspec.convert(rec.progress.figures, type=GpuTestsFigures)
    assert figures.pytest_runs == 2 and figures.tests == 3
    assert figures.failed_tests == ["test_marked.py::test_b_hangs", "test_marked.py::test_c"]
    assert [(c.name, c.passed) for c in rec.progress.checks] == [
        ("the gpu tests are collected", True),
        ("no gpu test failed, errored or timed out", False),
    ]


# --- the command line --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "gpu"], "bench gpu needs --out DIR"),
        (["bench", "gpu", "--out", "{out}", "--parts", "kernels,warp"], "--parts 'kernels,warp': expected"),
        (["bench", "gpu", "--out", "{out}", "--quick"], "bench gpu has no --quick"),
        (["bench", "schedule", "--dry-run"], "options of bench gpu, not of bench schedule"),
        (["bench", "gpu", "--out", "{full}"], "exists and is not an empty directory"),
    ],
)
def test_bad_usage_is_one_line_and_writes_nothing(tmp_path, capsys, args, message):
    full = tmp_path / "full"
    full.mkdir()
    (full / "gpu.json").write_text("{}")
    words = [a.format(out=tmp_path / "new", full=full) for a in args]
    assert main(words) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "new").exists() and [p.name for p in full.iterdir()] == ["gpu.json"]


def test_the_help_of_bench_gpu_imports_no_torch(tmp_path):
    code = (
        "import sys\nfrom rewind.tools.cli import main\ntry:\n    main(['bench', 'gpu', '--help'])\n"
        "except SystemExit:\n    pass\nprint('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--dry-run" in done.stdout and done.stdout.splitlines()[-1] == "False"


def test_the_cuda_budgets_fit_in_eight_minutes():
    assert set(BUDGETS_S["cuda"]) == set(PART_NAMES)
    assert PROBE_TIMEOUT_S + sum(BUDGETS_S["cuda"].values()) < 8 * 60


def test_a_torch_that_does_not_start_is_one_line_and_writes_nothing(tmp_path):
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no torch here')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}
    out = tmp_path / "check"
    command = [sys.executable, "-m", "rewind.tools.cli", "bench", "gpu", "--out", str(out), "--dry-run"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == "rewind: bench gpu: torch does not start: ImportError: no torch here\n"
    assert not out.exists()
