"""`rewind bench threads`: its plumbing (competitors start, compete and are gone afterwards; a ratio per
repeat from the same repeat's two runs; a failing run is an error), not its timing."""

from __future__ import annotations

import json
import os
import sys

import pytest

from rewind.states.config_reading import loads_config
from rewind.states.cpu_threads import threads_worth
from rewind.tools.bench import threads as bench_threads
from rewind.tools.bench.threads import competitors, measure, recorded_threads, timed, train_command
from rewind.tools.cpu_threads import usable_cores

# A stand-in for the training command: counts the competitors running beside it (its siblings, the
# bench's other children, running the competitor's code) and takes no time worth measuring.
PROBE = """
import os, sys
beside = 0
for pid in set(filter(str.isdigit, os.listdir("/proc"))) - {str(os.getpid())}:
    try:
        with open(f"/proc/{pid}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            beside += parent == os.getppid() and sys.argv[2].encode() in f.read()
    except OSError:
        pass
with open(sys.argv[1], "w") as f:
    f.write(str(beside))
"""


def test_competitors_run_inside_the_block_and_are_gone_after_it():
    with competitors(2, 60) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.returncode is not None for p in procs)  # killed and reaped


def test_a_competitor_ends_by_itself_at_its_deadline():
    with competitors(1, 0.2) as procs:
        assert procs[0].wait(timeout=30) == 0


def test_each_repeat_runs_alone_then_beside_the_competitors(tmp_path):
    seen = {}

    def probe(run_dir):
        seen[run_dir.name] = run_dir
        return [sys.executable, "-c", PROBE, str(run_dir), bench_threads.COMPETITOR]

    result = measure(probe, tmp_path, repeats=2)
    assert sorted(seen) == ["alone-0", "alone-1", "contended-0", "contended-1"]
    beside = {name: int(path.read_text()) for name, path in seen.items()}
    assert beside["alone-0"] == beside["alone-1"] == 0
    assert beside["contended-0"] == beside["contended-1"] == 2
    assert result["competitors"] == 2 and result["repeats"] == 2 and result["ratio_goal"] == 2.0
    for a, c, r in zip(result["alone_s"], result["contended_s"], result["ratios"], strict=True):
        # The times are reported rounded to milliseconds and the ratio from the unrounded ones: allow
        # for the rounding (the probe's times are a few tens of milliseconds).
        assert a > 0 and c > 0 and (c - 5e-4) / (a + 5e-4) - 1e-3 <= r <= (c + 5e-4) / (a - 5e-4) + 1e-3
    assert len(result["alone_cpu_s"]) == len(result["contended_cpu_s"]) == 2
    assert result["ratio_min"] == min(result["ratios"]) and result["ratio_max"] == max(result["ratios"])
    json.dumps(result)  # --json prints it


def test_the_cpu_time_is_the_commands_own():
    burn = "import time\nwhile time.process_time() < 0.3:\n    pass\ntime.sleep(0.3)"
    wall, cpu = timed([sys.executable, "-c", burn])
    assert 0.3 <= cpu < wall  # at least what it burned; the sleep is wall time only


def test_a_run_that_fails_is_an_error_with_what_it_said():
    with pytest.raises(RuntimeError, match="exited 3: no such luck"):
        timed([sys.executable, "-c", "import sys; print('no such luck', file=sys.stderr); sys.exit(3)"])


@pytest.mark.slow  # a real `rewind train` in a new process (imports torch)
def test_the_bench_trains_the_tiny_example_and_reads_the_count_it_recorded(tmp_path):
    command = train_command(tmp_path / "run", 0)  # RunStarted, then a clean stop before the first step
    assert command[-2:] == ["--max-steps", "0"] and str(bench_threads.EXAMPLE) in command
    timed(command)
    # The count the command chose for itself: what the example's steps keep busy, up to the process's cores
    # (or the count the environment told it).
    cores = int(os.environ.get("OMP_NUM_THREADS") or usable_cores())
    tiny = loads_config(bench_threads.EXAMPLE.read_text())
    assert recorded_threads(tmp_path / "run") == threads_worth(tiny, cores) == 1
    told = train_command(tmp_path / "told", 0, threads=2)
    assert told[-4:] == ["--threads", "2", "--max-steps", "0"]
    timed(told)
    assert recorded_threads(tmp_path / "told") == 2
