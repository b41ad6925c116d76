"""An argument that is not UTF-8 (a path or a prompt of bytes in another encoding) is refused in one
line naming it, exit 2, before any command runs (rewind.tools.cli.undecodable_argument). Python hands
such bytes over as lone surrogates, which nothing downstream can encode: `rewind sample`'s prompt,
`schedule --set` and `log --type` gave tracebacks, and `train --run-dir` recorded RunStarted and then
crashed, on every retry (issue 33, point 11). A config file whose content is not UTF-8 is refused by
the config reader (tests/tools/test_cli_input.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import EXAMPLES, REPO

TINY = EXAMPLES / "tiny.toml"
WHY = ": not UTF-8 text; rewind takes its arguments, paths included, as UTF-8\n"


def raw(data: bytes) -> str:
    """`data` as Python decodes a command-line argument (surrogateescape)."""
    return os.fsdecode(data)


CASES = [
    (["sample", "{run}", "--prompt", raw(b"ab\xc3")], "--prompt ab\\xc3"),
    (["export", "{run}", "--to", "{tmp}/" + raw(b"w\xff.safetensors")], "--to {tmp}/w\\xff.safetensors"),
    (["schedule", str(TINY), "--set", raw(b"run.name=\xff")], "--set run.name=\\xff"),
    (
        ["train", str(TINY), "--run-dir", "{tmp}/" + raw(b"run\xff"), "--no-progress"],
        "--run-dir {tmp}/run\\xff",
    ),
    (["train", str(TINY), "--run-dir={tmp}/" + raw(b"r\xfe")], "--run-dir {tmp}/r\\xfe"),
    (["log", "{run}", "--type", raw(b"\xff")], "--type \\xff"),
    (["schedule", raw(b"x\xff.toml")], "x\\xff.toml"),
]


@pytest.mark.parametrize(("argv", "named"), CASES, ids=[a[0] + " " + n.split()[0] for a, n in CASES])
def test_an_argument_that_is_not_utf8_is_one_line_naming_it(rewind_cli, straight, tmp_path, argv, named):
    before = set(straight.rglob("*"))
    args = [a.replace("{run}", str(straight)).replace("{tmp}", str(tmp_path)) for a in argv]
    code, out, err = rewind_cli(*args)
    assert code == 2, err
    assert err == "rewind: " + named.replace("{tmp}", str(tmp_path)) + WHY
    assert out == ""
    assert list(tmp_path.iterdir()) == []  # no run directory, no export
    assert set(straight.rglob("*")) == before


def test_a_lone_surrogate_that_is_no_byte_is_shown_escaped(rewind_cli):
    code, _, err = rewind_cli("schedule", str(TINY), "--set", "run.name=\ud800")
    assert (code, err) == (2, "rewind: --set run.name=\\ud800" + WHY)


def test_the_bytes_of_a_real_command_line_are_refused_before_anything_is_recorded(tmp_path):
    run = os.fsencode(tmp_path) + b"/run\xff"
    done = subprocess.run(
        [sys.executable, "-m", "rewind", "train", os.fsencode(TINY), "--run-dir", run, "--max-steps", "1"],
        capture_output=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == b"rewind: --run-dir " + os.fsencode(tmp_path) + b"/run\\xff" + WHY.encode()
    assert list(tmp_path.iterdir()) == []
