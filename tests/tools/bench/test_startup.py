"""`rewind bench startup`: its plumbing (a restart that resumed and took one step, both baselines, a
ratio per repeat from the same repeat's processes), not its timing."""

from __future__ import annotations

import json
import sys

import pytest

from rewind.tools.bench import startup as bench_startup


def test_a_restart_that_did_not_resume_and_step_is_an_error(straight, tmp_path):
    # A finished run: `rewind resume` exits 0 with nothing to do, which is no restart to time.
    with pytest.raises(RuntimeError, match="did not resume"):
        bench_startup.restart(straight, tmp_path / "copy")


def test_a_failing_process_is_an_error_with_what_it_said():
    with pytest.raises(RuntimeError, match="exited 3: said so"):
        bench_startup.timed(
            [sys.executable, "-c", "import sys; print('said so', file=sys.stderr); sys.exit(3)"]
        )


@pytest.mark.slow
def test_the_quick_bench_times_a_restart_against_import_torch(rewind_cli):
    code, out, err = rewind_cli("bench", "startup", "--quick", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["repeats"] == 1 and result["ratio_goal"] == 1.5
    (torch_s,), (resume_s,) = result["import_torch_s"], result["resume_s"]
    assert min(torch_s, resume_s) > 0
    assert result["ratios"] == [pytest.approx(resume_s / torch_s, abs=0.01)]
    assert result["ratios_range"] == result["ratios"] * 2
    low, high = result["ratios_cpu_range"]
    assert 0 < low == high


def test_cpu_time_is_the_child_s_own():
    # A child that sleeps takes wall time and next to no CPU; one that computes takes both.
    sleeper = bench_startup.timed([sys.executable, "-c", "import time; time.sleep(1)"])
    worker = bench_startup.timed(
        [
            sys.executable,
            "-c",
            "import time\nend = time.process_time() + 1\nwhile time.process_time() < end: pass",
        ]
    )
    assert sleeper.wall_s >= 1 and sleeper.cpu_s < 0.5
    assert worker.cpu_s >= 1
