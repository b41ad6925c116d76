"""An export writes only what is new, and all of it or nothing (rewind.tools.outfile): an existing --to file,
or an --hf or --adapters directory that is not empty, is refused in one line (exit 2) unless --overwrite is
given, and then a directory only if it holds an earlier export alone (replaced whole); a failure at any point
leaves no output and what --overwrite would have replaced as it was. A plot replaces the file it names.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from rewind.stores import fsio
from rewind.tools import export_adapters as adapters
from rewind.tools import outfile
from rewind.tools.export_hf import HF_FILES
from tests.conftest import REPO
from tests.engine.test_loop import TINY, one_line, run_cli
from tests.tools.rundir_forgery import tree_state
from tests.tools.test_export_hf import GROWTH, TWO_STAGES, write_config

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A run whose last checkpoint holds LoRA adapters (a grown LoRA trunk): --adapters has some to write."""
    base = tmp_path_factory.mktemp("export-overwrite")
    config = write_config(base, "lora", num_layers=1, stages=TWO_STAGES, extra=GROWTH)
    code, _, err = run_cli("train", config, "--run-dir", base / "run", "--no-progress")
    assert code == 0, err
    return base / "run"


@pytest.fixture(scope="module")
def earlier(lora_run, tmp_path_factory) -> Path:
    """What an earlier `export --to --hf --adapters` of the run wrote."""
    out = tmp_path_factory.mktemp("earlier")
    code, _, err = run_cli(*_export_all(lora_run, out))
    assert code == 0, err
    return out


def _export_all(run: Path, out: Path, *extra: str) -> list:
    return [
        "export",
        run,
        "--to",
        out / "w.safetensors",
        "--hf",
        out / "hf",
        "--adapters",
        out / "adapters",
        *extra,
    ]


def _refused(args: list, code: int, *needles: str) -> str:
    got, out, err = run_cli(*args)
    assert got == code and out == "", err
    line = one_line(err)
    for needle in needles:
        assert needle in line, (needle, line)
    return line


def _copy_of(earlier: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(earlier, tmp_path / "out")
    return tmp_path / "out"


# --- nothing that is there is replaced without --overwrite -----------------------------------------------


def test_an_existing_to_file_is_refused_without_overwrite_and_replaced_with_it(straight, tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"the user's file")
    _refused(["export", straight, "--to", target], 2, f"--to {target}: exists", "--overwrite")
    assert target.read_bytes() == b"the user's file" and os.listdir(tmp_path) == ["model.safetensors"]
    code, out, err = run_cli("export", straight, "--to", target, "--overwrite")
    assert code == 0 and f"to {target}" in out, err
    assert load_file(target) and os.listdir(tmp_path) == ["model.safetensors"]  # no temporary, nothing aside


@pytest.mark.parametrize("option", ["--hf", "--adapters"])
def test_a_directory_holding_the_users_files_is_never_filled_overwrite_or_not(lora_run, tmp_path, option):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "adapter_config.json" if option == "--adapters" else taken / "config.json").write_text("mine")
    (taken / "notes.txt").write_text("mine too")
    args = ["export", lora_run, "--hf", tmp_path / "hf", "--adapters", tmp_path / "adapters"]
    args[args.index(option) + 1] = taken
    before = tree_state(tmp_path)
    _refused(args, 2, f"{option} {taken}: exists and is not empty", "--overwrite")
    assert tree_state(tmp_path) == before
    _refused([*args, "--overwrite"], 2, f"{option} {taken}: holds what no export writes (notes.txt)")
    assert tree_state(tmp_path) == before


def test_overwrite_replaces_an_earlier_export_whole(lora_run, earlier, tmp_path):
    out = _copy_of(earlier, tmp_path)
    (out / "hf" / "tokenizer.json").write_text("{}")  # an earlier export's, of a run with a tokenizer
    _refused(_export_all(lora_run, out), 2, "--to", "exists")
    code, stdout, err = run_cli(*_export_all(lora_run, out, "--overwrite"))
    assert code == 0 and stdout.count("wrote") == 3, err
    assert tree_state(out).keys() == tree_state(earlier).keys()  # the stale tokenizer.json gone
    for name in ("w.safetensors", "hf/model.safetensors", "adapters/adapter_model.safetensors"):
        again, first = load_file(out / name), load_file(earlier / name)
        assert again.keys() == first.keys() and all(again[k].equal(first[k]) for k in first)
    assert sorted(os.listdir(tmp_path)) == ["out"] and sorted(os.listdir(out)) == [
        "adapters",
        "hf",
        "w.safetensors",
    ]


def test_outputs_inside_one_another_are_refused(straight, tmp_path):
    _refused(
        ["export", straight, "--hf", tmp_path / "hf", "--to", tmp_path / "hf" / "w.safetensors"],
        2,
        "inside --hf",
    )
    assert os.listdir(tmp_path) == []


# --- a failed export leaves nothing half written -------------------------------------------------------


def test_adapters_of_a_run_without_them_leave_no_hf_directory(straight, tmp_path):
    before = tree_state(tmp_path)
    outputs = ["--to", tmp_path / "w", "--hf", tmp_path / "hf", "--adapters", tmp_path / "a"]
    _refused(["export", straight, *outputs], 1, "has no adapters")
    assert tree_state(tmp_path) == before


def _failing_adapter_writes(monkeypatch) -> None:
    real = fsio.write_all

    def write_all(fd, data):
        if b"base_model.model." in bytes(data[:4096]):  # the adapters' weights (peft's key prefix)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(fsio, "write_all", write_all)


def test_a_failure_writing_the_adapters_leaves_no_output_at_all(lora_run, tmp_path, monkeypatch):
    _failing_adapter_writes(monkeypatch)
    line = _refused(
        _export_all(lora_run, tmp_path), 1, f"--adapters {tmp_path / 'adapters'}", "No space left"
    )
    assert line.endswith("nothing was written")
    assert os.listdir(tmp_path) == []  # no --to, no --hf, no temporary


def test_a_failure_under_overwrite_leaves_the_earlier_export_as_it_was(
    lora_run, earlier, tmp_path, monkeypatch
):
    out = _copy_of(earlier, tmp_path)
    (out / "hf" / "tokenizer.json").write_text("{}")
    before = tree_state(tmp_path)
    _failing_adapter_writes(monkeypatch)
    _refused(_export_all(lora_run, out, "--overwrite"), 1, "No space left")
    assert tree_state(tmp_path) == before


def test_a_failure_while_renaming_into_place_puts_back_what_was_replaced(
    lora_run, earlier, tmp_path, monkeypatch
):
    """The last step: the --to file and --hf are in place when --adapters cannot be renamed; both go back."""
    out = _copy_of(earlier, tmp_path)
    (out / "w.safetensors").write_bytes(b"an older export")
    before = tree_state(tmp_path)
    real = os.rename

    def rename(source, destination):
        if Path(destination) == out / "adapters" and Path(source).name.startswith(".adapters.tmp-"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(destination))
        real(source, destination)

    monkeypatch.setattr(outfile.os, "rename", rename)
    _refused(
        _export_all(lora_run, out, "--overwrite"), 1, f"--adapters {out / 'adapters'}", "Input/output error"
    )
    assert tree_state(tmp_path) == before


# --- what a killed export left is put right by the next -------------------------------------------------


def _dead_pid() -> int:
    """The id of a process that has ended: what a temporary of a killed export names."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_what_a_killed_export_left_is_put_right_by_the_next(lora_run, earlier, tmp_path):
    """kill -9 between the two renames of --overwrite leaves --to missing, the earlier export moved aside
    and the new one in its temporary; a kill while --hf is written, its temporary directory; a kill after
    --adapters is in place, the earlier one aside. The next export puts the earlier --to back (and so is
    refused without --overwrite), removes the rest, one line per output; nothing of another name, nor a
    temporary of a live process, is touched."""
    out = _copy_of(earlier, tmp_path)
    pid = _dead_pid()
    os.rename(out / "w.safetensors", out / f".w.safetensors.old-{pid}-0123abcd")
    (out / f".w.safetensors.tmp-{pid}-89abcdef").write_bytes(b"the killed export's")
    shutil.copytree(out / "hf", out / f".hf.tmp-{pid}-00ff00ff")
    shutil.copytree(out / "adapters", out / f".adapters.old-{pid}-11111111")
    others = [".w.safetensors.old-notes", f".w.safetensors.tmp-{pid}-notes", f"w.safetensors.old-{pid}-0123abcd",
              f".w.safetensors.tmp-{os.getpid()}-0123abcd", f".hf.old-{pid}-22222222/sub/x"]  # fmt: skip
    for other in others:
        (out / other).parent.mkdir(parents=True, exist_ok=True)
        (out / other).write_text("mine")
    code, _, err = run_cli(*_export_all(lora_run, out))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2, err
    assert lines[0] == (
        f"rewind: --to {out / 'w.safetensors'}: put back the earlier export a killed export had moved aside "
        f"(.w.safetensors.old-{pid}-0123abcd); removed what a killed export left beside it: "
        f".w.safetensors.tmp-{pid}-89abcdef"
    )
    assert lines[1].endswith("exists; name a new file, or give --overwrite to replace it"), err
    assert (out / "w.safetensors").read_bytes() == (earlier / "w.safetensors").read_bytes()
    code, stdout, err = run_cli(*_export_all(lora_run, out, "--overwrite"))
    assert code == 0 and stdout.count("wrote") == 3, err
    said = err.strip().splitlines()
    assert len(said) == 2 and said[0].startswith(f"rewind: --hf {out / 'hf'}: removed ") and said[1].startswith(
        f"rewind: --adapters {out / 'adapters'}: removed "
    ), err
    kept = [*others, f".hf.old-{pid}-22222222", f".hf.old-{pid}-22222222/sub"]  # and their directories
    assert sorted(tree_state(out)) == sorted([*tree_state(earlier), *kept])


# --- plots: the file named is drawn again ---------------------------------------------------------------


@pytest.mark.parametrize("command", ["timeline", "diff", "schedule"])
def test_a_plot_replaces_the_file_it_names(straight, tmp_path, command):
    """A plot is drawn to be looked at, and drawn again at will: --plot FILE replaces FILE (docs/export.md),
    unlike an export."""
    target = tmp_path / "picture.png"
    target.write_bytes(b"an older picture")
    args = {"timeline": [straight], "diff": [straight, straight], "schedule": [TINY]}[command]
    code, _, err = run_cli(command, *args, "--plot", target)
    assert code in (0, 1) and "rewind:" not in err, err  # (diff exits 1 only when the runs diverge)
    assert target.read_bytes().startswith(b"\x89PNG") and os.listdir(tmp_path) == ["picture.png"]


def test_the_docs_name_the_files_an_earlier_export_may_hold():
    section = (REPO / "docs" / "export.md").read_text().split("## What is there already")[1].split("\n## ")[0]
    named = set(re.findall(r"`([\w.]+\.(?:json|safetensors))`", section))
    assert named == {*HF_FILES, adapters.WEIGHTS_NAME, adapters.CONFIG_NAME}
