"""`rewind bench startup`: its plumbing (a restart that resumed and took one step, both baselines, a
ratio per repeat from the same repeat's processes), not its timing."""

from __future__ import annotations

import json
import sys

import pytest

from rewind.tools import bench_startup


def test_a_restart_that_did_not_resume_and_step_is_an_error(straight, tmp_path):
    # A finished run: `rewind resume` exits 0 with nothing to do, which is no restart to time.
    with pytest.raises(RuntimeError, match="did not resume"):
        bench_startup.restart(straight, tmp_path / "copy")


def test_a_failing_process_is_an_error_with_what_it_said():
    with pytest.raises(RuntimeError, match="exited 3: said so"):
        bench_startup.timed([sys.executable, "-c", "import sys; print('said so', file=sys.stderr); sys.exit(3)"])


@pytest.mark.slow
def test_the_quick_bench_times_a_restart_against_both_baselines(rewind_cli):
    code, out, err = rewind_cli("bench", "startup", "--quick", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["repeats"] == 1 and result["ratio_goal"] == 1.5
    (torch_s,), (floor_s,), (resume_s,) = result["import_torch_s"], result["floor_s"], result["resume_s"]
    assert min(torch_s, floor_s, resume_s) > 0
    assert result["ratios"] == [result["ratio_min"]] == [result["ratio_max"]]
    assert result["ratio_min"] == pytest.approx(resume_s / torch_s, abs=0.01)
    assert result["floor_ratio_min"] == pytest.approx(floor_s / torch_s, abs=0.01)
    assert result["resume_over_floor_min"] == pytest.approx(resume_s / floor_s, abs=0.01)
