"""Make a compatibility fixture: a run directory left by this release, for every later one to resume.

    python tests/compat/make_fixture.py VERSION [CONFIG] [--stop-at STEP] [--crash-at STEP]

writes tests/compat/fixtures/VERSION/: the run of fixtures/run.toml, stopped cleanly after step 17 (a
RunStopped and a "stop" checkpoint), resumed, and then crashed after step 27 with steps 22..24 committed
past its last checkpoint (so the next resume supersedes records), plus expected.json: the sha256 of every
tensor of the final model of the same run trained straight through, and the CPU it was made on. With
CONFIG (another config than fixtures/run.toml, to pin a behaviour that config exercises), a copy of it
goes into the fixture as run.toml, and the tests resume the fixture under that one; the Python files
beside it (a grpo stage's reward modules) go with it, and the runs are made from its directory (where a
release before reward modules were looked for beside the config imported them from). --stop-at and
--crash-at move the stop and the crash (a grpo fixture's into its rollout windows).

A fixture is made once, by the release it is named after, and committed; it is never regenerated (that
would test nothing). This script uses only the CLI and the stores' reader, so it keeps working.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "fixtures" / "run.toml"
STOP_AT, CRASH_AT = 17, 27


def rewind(*args: str, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "rewind.tools.cli", *args]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd)
    if check and done.returncode != 0:
        raise SystemExit(f"rewind {' '.join(args)} failed ({done.returncode}): {done.stderr}")
    return done


def last_step(run_dir: Path) -> int:
    from rewind.stores.runs import read_seq_events

    steps = [e.step for _, e in read_seq_events(str(run_dir)) if type(e).__name__ == "StepCommitted"]
    return steps[-1] if steps else 0


def crash_after(run_dir: Path, step: int, config: Path = CONFIG, cwd: Path | None = None) -> None:
    """Resume the run and SIGKILL the process once `step` is logged (committed or not: the records past
    the last group commit are lost, those before it stay and get superseded on the next resume)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = [sys.executable, "-m", "rewind.tools.cli", "train", str(config), "--run-dir", str(run_dir), "--no-progress"]
    # --max-steps makes the kill deterministic: the process stops (cleanly) at the step we want to
    # crash at, but we kill it first while it is still before that point. Simpler and exact: run to
    # the crash step with a throttled process and kill it when the log shows the step.
    process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    try:
        while process.poll() is None:
            if last_step(run_dir) >= step - 3:  # the group commit at step 24 is on disk
                os.kill(process.pid, signal.SIGKILL)
                break
            time.sleep(0.002)
    finally:
        process.wait()


def tensor_hashes(file: Path) -> dict[str, str]:
    from safetensors.torch import load_file

    return {name: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for name, t in sorted(load_file(file).items())}


def main() -> None:
    parser = argparse.ArgumentParser(description="Make a compatibility fixture (see the module's doc).")
    parser.add_argument("version")
    parser.add_argument("config", nargs="?", type=Path, default=CONFIG)
    parser.add_argument("--stop-at", type=int, default=STOP_AT)
    parser.add_argument("--crash-at", type=int, default=CRASH_AT)
    given = parser.parse_args()
    version, config = given.version, given.config.resolve()
    home = config.parent if config != CONFIG else None  # where the runs are made from
    out = HERE / "fixtures" / version
    if out.exists():
        raise SystemExit(f"{out} exists: fixtures are made once and never regenerated")
    with tempfile.TemporaryDirectory() as tmp:
        straight, run = Path(tmp) / "straight", Path(tmp) / "run"
        rewind("train", str(config), "--run-dir", str(straight), "--no-progress", cwd=home)
        rewind("export", str(straight), "--to", str(Path(tmp) / "final.safetensors"), cwd=home)
        rewind("train", str(config), "--run-dir", str(run), "--no-progress", "--max-steps", str(given.stop_at), cwd=home)
        crash_after(run, given.crash_at, config, cwd=home)
        (run / "events" / "LOCK").unlink(missing_ok=True)  # a dead writer's lock: not part of the format
        out.mkdir(parents=True)
        # snapshots: a later release must cope with ours; trunks and cache: a grown run's frozen stacks and
        # activations; rollouts: a grpo run's sampled batches
        for part in ("events", "checkpoints", "snapshots", "trunks", "cache", "rollouts"):
            if (run / part).exists():
                shutil.copytree(run / part, out / part, ignore=shutil.ignore_patterns(".tmp-*", "*.tmp-*"))
        expected = {
            "made_by": version,
            "machine": platform.machine(),
            "processor": platform.processor() or "unknown",
            "logged_last_step": last_step(run),
            "final_model_sha256": tensor_hashes(Path(tmp) / "final.safetensors"),
        }
        (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
        if home is not None:
            shutil.copyfile(config, out / "run.toml")
            for module in sorted(home.glob("*.py")):
                shutil.copyfile(module, out / module.name)
    print(f"wrote {out} (logged up to step {expected['logged_last_step']})")


if __name__ == "__main__":
    main()
