"""The CPU threads of a `rewind` process, chosen before torch is imported: torch's OpenMP runtime
(libgomp) reads its settings once, when torch loads it.

- How many: the cores this process may use, which is the smaller of its affinity mask and its cgroup's
  CPU quota (a container limited to 1.5 CPUs on a 64-core host gets 2, not 64). OMP_NUM_THREADS, when
  set, is the user's choice and stays.
- How idle threads wait: OMP_WAIT_POLICY=PASSIVE, so a thread with nothing to do sleeps instead of
  spinning. By default libgomp spins for a while after every parallel region; on a machine whose cores
  other jobs keep busy, the spinning takes the cores the other threads of the same run need, and a run
  went 10-20x slower (`rewind bench threads` measures it). The user's own OMP_WAIT_POLICY stays.

A new run records the count it computes with; a resume computes with the count on record (or, with
--threads, the one asked for): rewind.engine.model.placement.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, MutableMapping
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cores(
    affinity: Callable[[], set[int]] = lambda: os.sched_getaffinity(0),
    cgroup_root: Path = CGROUP_ROOT,
    proc_cgroup: Path = PROC_CGROUP,
) -> int:
    """The cores this process may use: its affinity mask, capped by its cgroup's CPU quota (rounded up)."""
    cores = len(affinity())
    quota = cgroup_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def cgroup_quota(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The CPU quota, in cores, of this process's cgroup and the cgroups above it (the smallest), from
    cgroup v2's cpu.max or v1's cpu.cfs_quota_us / cpu.cfs_period_us; None when there is none."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            quotas += [
                q for d in _cgroup_dirs(cgroup_root, path) if (q := _v2_quota(d / "cpu.max")) is not None
            ]
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own hierarchy
            mount = next(
                (
                    m
                    for m in (cgroup_root / controllers, cgroup_root / "cpu,cpuacct", cgroup_root / "cpu")
                    if m.is_dir()
                ),
                None,
            )
            if mount is not None:
                quotas += [q for d in _cgroup_dirs(mount, path) if (q := _v1_quota(d)) is not None]
    return min(quotas, default=None)


def _cgroup_dirs(mount: Path, path: str) -> list[Path]:
    """The directory of cgroup `path` under `mount` and every one above it up to the mount. Inside a
    container the mount is often the container's own cgroup while /proc/self/cgroup names the host's
    path: then only the mount itself is there to read."""
    here = mount / path.strip("/")
    if not here.is_dir():
        return [mount]
    return [here, *[p for p in here.parents if p.is_relative_to(mount)]]


def _v2_quota(cpu_max: Path) -> float | None:
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else _ratio(quota, period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = (directory / "cpu.cfs_quota_us").read_text().strip()
        period = (directory / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return None if quota.startswith("-") else _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def prepare_threads(
    environ: MutableMapping[str, str] = os.environ, cores: Callable[[], int] = usable_cores
) -> None:
    """Set, where the user has not, how many threads torch's OpenMP runtime starts with and that its idle
    threads sleep: call before torch is imported (`rewind` does, first thing)."""
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    environ.setdefault("OMP_NUM_THREADS", str(cores()))
