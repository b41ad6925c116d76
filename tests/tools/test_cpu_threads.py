"""The CPU threads a `rewind` process computes with: as many as the cores it may use (affinity mask,
cgroup quota), chosen before torch loads its OpenMP runtime, whose idle threads then sleep, not spin; a
new run computes with as many of them as its steps keep busy (rewind.states.cpu_threads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rewind.states.events import RunStarted
from rewind.stores.runs import read_records
from rewind.tools.cpu_threads import cgroup_quota, prepare_threads, usable_cores
from tests.conftest import EXAMPLES

EIGHT = lambda: set(range(8))  # noqa: E731 - an affinity mask of eight cores


def _v2(tmp_path: Path, path: str, limits: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup v2 tree under tmp_path (cpu.max per directory) and a /proc/self/cgroup naming `path`."""
    root = tmp_path / "cgroup"
    (root / path.strip("/")).mkdir(parents=True)
    for directory, cpu_max in limits.items():
        (root / directory / "cpu.max").write_text(cpu_max + "\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"0::{path}\n")
    return root, proc


def _v1(tmp_path: Path, controllers: str, path: str, quota: str, period: str = "100000") -> tuple[Path, Path]:
    """A cgroup v1 cpu hierarchy mounted as the container's own cgroup (the host's path is not under it)."""
    root = tmp_path / "cgroup"
    mount = root / controllers
    mount.mkdir(parents=True)
    (mount / "cpu.cfs_quota_us").write_text(quota + "\n")
    (mount / "cpu.cfs_period_us").write_text(period + "\n")
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"9:name=systemd:{path}\n6:cpuset:{path}\n4:{controllers}:{path}\n0::/\n")
    return root, proc


def test_without_a_quota_the_affinity_mask_decides(tmp_path):
    root, proc = _v2(tmp_path, "/job", {"job": "max 100000"})
    assert usable_cores(EIGHT, root, proc) == 8
    assert usable_cores(lambda: {3}, root, proc) == 1
    assert usable_cores(EIGHT, tmp_path / "none", tmp_path / "no-proc-file") == 8


def test_a_v2_quota_caps_the_count_rounded_up(tmp_path):
    root, proc = _v2(tmp_path, "/job", {"job": "150000 100000"})
    assert cgroup_quota(root, proc) == 1.5
    assert usable_cores(EIGHT, root, proc) == 2
    assert usable_cores(lambda: {0}, root, proc) == 1  # the mask is smaller still


def test_the_smallest_quota_on_the_way_to_the_root_counts(tmp_path):
    root, proc = _v2(tmp_path, "/slice/job", {"slice": "300000 100000", "slice/job": "max 100000"})
    assert usable_cores(EIGHT, root, proc) == 3
    root, proc = _v2(tmp_path / "b", "/slice/job", {".": "50000 100000", "slice/job": "400000 100000"})
    assert usable_cores(EIGHT, root, proc) == 1


def test_a_v1_quota_is_read_from_the_cpu_hierarchy(tmp_path):
    root, proc = _v1(tmp_path, "cpu,cpuacct", "/docker/abc", "250000")
    assert usable_cores(EIGHT, root, proc) == 3
    root, proc = _v1(tmp_path / "none", "cpu", "/", "-1")
    assert cgroup_quota(root, proc) is None
    assert usable_cores(EIGHT, root, proc) == 8


@pytest.mark.parametrize("junk", ["", "garbage", "max", "0 100000", "100000 0"])
def test_an_unreadable_quota_is_no_quota(tmp_path, junk):
    root, proc = _v2(tmp_path, "/", {".": junk})
    assert usable_cores(EIGHT, root, proc) == 8


def test_prepare_sets_the_count_and_passive_waiting_where_the_user_did_not():
    environ: dict[str, str] = {}
    prepare_threads(environ, cores=lambda: 3)
    assert environ == {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "3"}
    chosen = {"OMP_WAIT_POLICY": "active", "OMP_NUM_THREADS": "5"}
    prepare_threads(chosen, cores=lambda: 3)
    assert chosen == {"OMP_WAIT_POLICY": "active", "OMP_NUM_THREADS": "5"}


PROBE = """
import json, os, sys
from unittest import mock
import rewind.tools.cli as cli

def main():
    import torch
    print(json.dumps({"seen": SEEN, "threads": torch.get_num_threads()}))
    return 0

SEEN = {}
def record():  # what the environment holds when the command's main starts, and whether torch is loaded
    SEEN.update(policy=os.environ.get("OMP_WAIT_POLICY"), count=os.environ.get("OMP_NUM_THREADS"),
                torch="torch" in sys.modules)
    return main()

with mock.patch.object(cli, "main", record):
    cli.entry()
"""


def test_the_command_chooses_before_torch_loads_and_torch_computes_with_it():
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, check=True
    )
    probed = json.loads(done.stdout)
    cores = usable_cores()
    assert probed["seen"] == {"policy": "PASSIVE", "count": str(cores), "torch": False}
    assert probed["threads"] == cores


def test_a_new_run_records_the_threads_its_steps_keep_busy_unless_told(tmp_path):
    """The tiny example in a fresh process whose OpenMP runtime has 2 threads: a new run computes with 1
    (its steps keep no second thread busy: rewind.states.cpu_threads), --threads 2 with 2; both recorded."""
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"OMP_NUM_THREADS": "2"}
    recorded = []
    for run, extra in (("chosen", []), ("told", ["--threads", "2"])):
        subprocess.run(
            [sys.executable, "-m", "rewind", "train", str(EXAMPLES / "tiny.toml"), "--run-dir", str(tmp_path / run),
             "--max-steps", "1", "--no-progress", *extra],
            env=environ, capture_output=True, text=True, check=True,
        )  # fmt: skip
        started = read_records(str(tmp_path / run))[0].event
        assert isinstance(started, RunStarted)
        recorded.append(started.num_threads)
    assert recorded == [1, 2]
