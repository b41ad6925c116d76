"""Shared fixtures: the repository root and a runner for the `rewind` command in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Speed is measured by `rewind bench`, never by a unit test: no hypothesis example fails for taking long
# (on a shared 2-core machine a slow example is load, not a defect).
settings.register_profile("rewind", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("rewind")

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


@pytest.fixture
def rewind_cli(capsys):
    """Run `rewind ARGS...` in-process; returns (exit_code, stdout, stderr)."""
    from rewind.tools.cli import main

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse usage errors
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run
