"""By hand, not a test: peak memory and time of `rewind diff` and `rewind timeline` on long logs.

    .venv/bin/python tests/tools/stream_bench.py [--steps 1000000] [--resumes 3] [--segment-mib M] [--dir DIR]

Writes (once; kept under DIR for the next run, keyed by their parameters) three logs with
`rewind.stores.synthetic.write_synthetic_run`: A trained straight through; B the same run crashed and
resumed `--resumes` times (so `rewind diff A B` compares every step and finds no divergence); C a copy
of B with every loss from the middle step on scaled by 1 + 1e-6 (so `rewind diff A C` has a divergence
to find and half a run of deltas to summarise). Then it runs each command in a fresh process under
`/usr/bin/time -v` and prints its wall time and peak resident memory. The command runs the `rewind`
that `sys.executable` imports: point PYTHONPATH at another checkout to measure that one on the same logs.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import msgspec

LOSS_FACTOR = 1 + 1e-6


def perturbed_copy(source: Path, dest: Path, from_step: int, segment_bytes: int | None) -> int:
    """`source`'s log record for record (so every seq, and every superseded range, stays as it was),
    with the loss of each StepCommitted from `from_step` on scaled by LOSS_FACTOR."""
    from rewind.states.events import StepCommitted
    from rewind.stores.eventlog import EventLog
    from rewind.stores.runs import iter_records

    sizing = {} if segment_bytes is None else {"segment_bytes": segment_bytes}
    count = 0
    with EventLog.open(dest, "w", **sizing) as log:
        for _, event in iter_records(source):
            if isinstance(event, StepCommitted) and event.step >= from_step:
                event = msgspec.structs.replace(event, loss=event.loss * LOSS_FACTOR)
            log.append(event)
            count += 1
            if count % 1_000 == 0:
                log.commit()
        log.commit()
    return count


def ensure_runs(root: Path, num_steps: int, num_resumes: int, segment_mib: int | None) -> Path:
    """The directory holding the logs a, b and c, written unless a previous run left them complete.
    (Imported here: measuring another checkout's commands on logs written before needs none of it.)"""
    from rewind.stores.synthetic import write_synthetic_run

    sizing = f"-segments{segment_mib}MiB" if segment_mib else ""  # default: the log's own segment size
    where = root / f"synthetic-steps{num_steps}-resumes{num_resumes}{sizing}"
    done = where / "complete.json"
    if done.exists():
        return where
    if where.exists():
        raise SystemExit(f"{where} holds an incomplete earlier attempt: remove it first")
    segment_bytes = segment_mib << 20 if segment_mib else None
    sizes = {} if segment_bytes is None else {"segment_bytes": segment_bytes}
    started = time.perf_counter()
    written = {
        "a": write_synthetic_run(where / "a", num_steps, **sizes)["num_records"],
        "b": write_synthetic_run(where / "b", num_steps, num_resumes, **sizes)["num_records"],
    }
    written["c"] = perturbed_copy(where / "b", where / "c", num_steps // 2, segment_bytes)
    size = {name: sum(p.stat().st_size for p in (where / name / "events").glob("*.log")) for name in "abc"}
    info = {"records": written, "bytes": size, "seconds": time.perf_counter() - started}
    done.write_text(json.dumps(info, indent=1))
    return where


def measure(args: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak RSS in MiB, exit code) of `rewind ARGS` in a fresh process."""
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "rewind.tools.cli", *args]
    started = time.perf_counter()
    done = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, check=False)
    wall = time.perf_counter() - started
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr)
    if found is None:
        raise SystemExit(f"no figures from /usr/bin/time:\n{done.stderr[-2000:]}")
    return wall, int(found.group(1)) // 1024, done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--resumes", type=int, default=3)
    parser.add_argument("--segment-mib", type=int, help="log segment size (default: the log's own)")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/rewind-stream-bench"))
    options = parser.parse_args()

    where = ensure_runs(options.dir, options.steps, options.resumes, options.segment_mib)
    info = json.loads((where / "complete.json").read_text())
    logs = ", ".join(
        f"{name.upper()} {info['records'][name]:,} records ({info['bytes'][name] / 2**20:.1f} MiB)"
        for name in "abc"
    )
    print(f"logs under {where}: {logs}")
    commands = [
        ["diff", "a", "b"],
        ["diff", "a", "c"],
        ["diff", "a", "c", "--json"],
        ["timeline", "b"],
        ["timeline", "b", "--plot", "timeline.png"],
    ]
    print(f"{'command':<34} {'wall s':>8} {'peak MiB':>9} {'exit':>5}")
    for args in commands:
        wall, peak, code = measure(
            [str(where / arg) if arg in ("a", "b", "c", "timeline.png") else arg for arg in args]
        )
        print(f"{' '.join(args):<34} {wall:>8.1f} {peak:>9} {code:>5}")


if __name__ == "__main__":
    main()
