"""Hints name commands the way they run from where the user stands: `rewind log RUN` in a shell whose
PATH finds this environment's rewind, `.venv/bin/rewind log RUN` in a new shell after the quick start."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rewind.tools.invocation import invocation
from rewind.tools.train_cmd import summary
from tests.conftest import REPO

BIN = Path(sys.executable).parent  # where the environment installed its scripts

pytestmark = pytest.mark.skipif(
    not (BIN / "rewind").is_file(), reason="rewind is not installed as a script beside this Python"
)


def path_without_this_environment() -> str:
    """The PATH of a new shell that never activated the environment."""
    entries = os.environ.get("PATH", "").split(os.pathsep)
    kept = [entry for entry in entries if not (Path(entry).is_dir() and os.path.samefile(entry, BIN))]
    return os.pathsep.join(kept)


def runs(hint: str, *args: str) -> int:
    """The exit code of the hinted command with `args`, started as a shell would (the PATH as it is)."""
    return subprocess.run([*shlex.split(hint), *args], capture_output=True, timeout=300).returncode


def test_off_the_path_a_hint_is_the_script_s_path_and_it_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", path_without_this_environment())
    monkeypatch.chdir(REPO)
    assert shutil.which("rewind") is None or not os.path.samefile(shutil.which("rewind"), BIN / "rewind")
    hint = invocation("rewind")
    assert hint == os.path.relpath(BIN / "rewind")  # `.venv/bin/rewind` after the quick start
    assert runs(hint, "--version") == 0
    monkeypatch.chdir(tmp_path)  # not under the working directory: the whole path
    assert invocation("rewind") == shlex.quote(str(BIN / "rewind"))
    assert runs(invocation("rewind"), "--version") == 0


def test_on_the_path_a_hint_is_the_bare_name(monkeypatch):
    monkeypatch.setenv("PATH", os.pathsep.join([str(BIN), path_without_this_environment()]))
    assert invocation("rewind") == "rewind" and invocation("tensorboard") == "tensorboard"


def test_another_rewind_first_on_the_path_is_not_taken_for_this_one(monkeypatch, tmp_path):
    other = tmp_path / "bin" / "rewind"
    other.parent.mkdir()
    other.write_text("#!/bin/sh\nexit 3\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", os.pathsep.join([str(other.parent), str(BIN)]))
    monkeypatch.chdir(tmp_path)
    assert invocation("rewind") == shlex.quote(str(BIN / "rewind"))


def test_a_program_this_environment_did_not_install_keeps_its_name():
    assert invocation("no-such-program-here") == "no-such-program-here"


def test_the_run_summary_s_hints_run_in_a_new_shell(straight, monkeypatch):
    monkeypatch.setenv("PATH", path_without_this_environment())
    monkeypatch.chdir(REPO)
    text = summary(str(straight))
    log_hint = re.search(r"\((.+) log (\S+)\)$", text, re.MULTILINE)
    assert log_hint is not None and log_hint.group(2) == str(straight), text
    assert runs(log_hint.group(1), "log", str(straight), "--type", "RunFinished") == 0
    board = re.search(r"\((.+) --logdir (\S+)\)$", text, re.MULTILINE)
    assert board is not None and board.group(2) == f"{straight}/tb", text
    program = shutil.which(shlex.split(board.group(1))[0])  # as the shell looks it up (a path: itself)
    assert program is not None and os.path.samefile(program, BIN / "tensorboard")
