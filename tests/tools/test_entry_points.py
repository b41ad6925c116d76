"""`python -m rewind` is the `rewind` command (so `torchrun -m rewind` is too), from any directory."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import EXAMPLES


def python_m_rewind(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rewind", *args], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_python_m_rewind_runs_the_command_with_its_exit_codes(tmp_path):
    version = python_m_rewind("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.startswith("rewind "), version.stderr
    schedule = python_m_rewind("schedule", str(EXAMPLES / "tiny.toml"), "--json", cwd=tmp_path)
    assert schedule.returncode == 0, schedule.stderr
    assert json.loads(schedule.stdout)["events"]
    missing = python_m_rewind("state", str(tmp_path / "no-run"), cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "Traceback" not in missing.stderr


def test_the_subpackages_import_beside_the_main_module_which_runs_nothing_when_imported(tmp_path):
    code = (
        "import rewind.__main__, rewind.states.fold, rewind.stores.eventlog, rewind.engine.run.session, "
        "rewind.kernels.losses, rewind.tools.cli"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
