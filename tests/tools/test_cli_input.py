"""Bad input at the command line, as a new user types it: config paths that are not config files,
run directories that are empty or name a filesystem rewind cannot use, `--version` and the help.
Each refusal is one line starting "rewind: ", exit 2, and nothing written anywhere."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from importlib import metadata
from pathlib import Path

import pytest

from rewind.tools.configfile import MAX_CONFIG_BYTES
from tests.conftest import EXAMPLES

TINY = EXAMPLES / "tiny.toml"


def refused(result: tuple[int, str, str], code: int = 2, *needles: str) -> str:
    """The one line of a refusal, after checking its exit code, that nothing went to stdout, and needles."""
    exit_code, out, err = result
    assert exit_code == code, err
    assert out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rewind: "), err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# --- the config file ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["schedule", "train"])
def test_a_character_device_is_refused_without_being_read(rewind_cli, tmp_path, command):
    run = tmp_path / "run"
    args = ["--run-dir", run] if command == "train" else []
    refused(rewind_cli(command, "/dev/zero", *args), 2, "/dev/zero", "not a regular file", "character device")
    assert not run.exists()


def test_a_fifo_is_refused_without_blocking(rewind_cli, tmp_path):
    fifo = tmp_path / "config.toml"
    os.mkfifo(fifo)
    results = []
    # Opening a FIFO for reading blocks until a writer comes; the command must not wait for one.
    worker = threading.Thread(target=lambda: results.append(rewind_cli("schedule", fifo)), daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():  # unblock the command so the test process can end, then fail
        with open(fifo, "w"):
            pass
        pytest.fail("rewind schedule blocked on a FIFO")
    refused(results[0], 2, str(fifo), "FIFO")


def test_a_config_file_over_the_size_limit_is_refused(rewind_cli, tmp_path):
    huge = tmp_path / "huge.toml"
    with open(huge, "wb") as handle:
        handle.truncate(MAX_CONFIG_BYTES + 1)  # sparse: nothing written, nothing to read
    refused(rewind_cli("schedule", huge), 2, str(huge), "too large", f"{MAX_CONFIG_BYTES:,}")
    # The control: a config padded with a comment to exactly the limit is read and used.
    at_limit = tmp_path / "at_limit.toml"
    text = TINY.read_bytes() + b"#"
    at_limit.write_bytes(text + b"#" * (MAX_CONFIG_BYTES - len(text) - 1) + b"\n")
    assert at_limit.stat().st_size == MAX_CONFIG_BYTES
    code, out, err = rewind_cli("schedule", at_limit)
    assert code == 0 and "RunFinished" in out, err


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: p.mkdir(), "is a directory"),
        (lambda p: p.write_bytes(b"\xff\xfe[run]\n"), "not UTF-8"),
        (lambda p: None, "no such config file"),
    ],
    ids=["directory", "binary", "missing"],
)
def test_other_files_that_are_no_config_are_one_line(rewind_cli, tmp_path, make, needle):
    config, run = tmp_path / "config.toml", tmp_path / "run"
    make(config)
    refused(rewind_cli("train", config, "--run-dir", run), 2, str(config), needle)
    assert not run.exists()


# --- version and help --------------------------------------------------------------------------------


def test_version_is_the_installed_package_version(rewind_cli):
    code, out, _ = rewind_cli("--version")
    assert code == 0
    assert out.strip() == f"rewind {metadata.version('rewind')}"


def test_help_opens_with_what_rewind_is(rewind_cli):
    code, out, _ = rewind_cli("--help")
    assert code == 0
    opening = " ".join(out.split("\n\n", 2)[1].split())  # the paragraph after the usage line
    for words in ("state machine", "append-only", "log", "resume", "inspect", "diff", "replay"):
        assert words in opening, words
    assert "imported" not in opening and "torch" not in opening  # not a note on lazy imports
    assert "--version" in out


@pytest.mark.parametrize("command", ["train", "schedule", "fork"])
def test_set_has_help_saying_its_syntax(rewind_cli, command):
    code, out, _ = rewind_cli(command, "--help")
    assert code == 0
    text = " ".join(out.split("--set PATH=VALUE", 2)[2].split())  # the option's help, past the usage
    assert "dotted" in text and "[i]" in text and "TOML" in text
    assert "stages[1].tokens" in text and "training.tokens" in text  # the record's path, and the flat list's


def test_stage_paths_reach_the_schedule(rewind_cli):
    code, out, err = rewind_cli(
        "schedule", TINY, "--json", "--set", "stages[1].tokens=25600", "--set", "stages[2].beta=0.5",
        "--set", "stages[2].datasets[0].name=grammar", "--set", "stages[1].reset_optimizer=true",
    )
    assert code == 0, err
    stages = json.loads(out)["stages"]
    assert stages[1]["budget"] == 25600 and stages[2]["beta"] == 0.5
    assert stages[2]["mixture"][0]["name"] == "grammar" and stages[1]["reset_optimizer"]
    code, _, err = rewind_cli("schedule", TINY, "--set", "stages[0].reset_optimizer=true")
    assert code == 2 and err.count("\n") == 1 and "stages[0].reset_optimizer: stage 0 has no moments" in err


def test_indexed_set_paths_reach_the_schedule(rewind_cli):
    code, out, err = rewind_cli(
        "schedule", TINY, "--json", "--set", "training.tokens[1]=25600", "--set", "optimization.kl.betas[2]=0.5",
        "--set", "training.datasets[2][0].name=grammar",
    )
    assert code == 0, err
    stages = json.loads(out)["stages"]
    assert stages[1]["budget"] == 25600 and stages[2]["beta"] == 0.5
    assert stages[2]["mixture"][0]["name"] == "grammar"
    refused(
        rewind_cli("schedule", TINY, "--set", "training.datasets[3][0].name=sort"),
        2,
        "training.datasets[3]: index out of range",
    )


# --- the run directory -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["train", str(TINY), "--run-dir", ""],
        ["train", str(TINY), "--run-dir", "  "],
        ["resume", ""],
        ["log", ""],
        ["fork", "", "child", "--at-step", "0"],
        ["export", "", "--to", "model.safetensors"],
    ],
    ids=["train", "train-blank", "resume", "log", "fork", "export"],
)
def test_an_empty_run_directory_is_refused_and_nothing_lands_in_the_current_one(rewind_cli, tmp_path, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    refused(rewind_cli(*args), 2, "an empty path")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("url", "package", "extra"),
    [
        ("s3://bucket/run", "s3fs", "rewind[s3]"),
        ("gcs://bucket/run", "gcsfs", "rewind[gcs]"),
        ("simplecache::s3://bucket/run", "s3fs", "rewind[s3]"),
    ],
)
def test_a_url_whose_backend_is_not_installed_names_the_extra(rewind_cli, url, package, extra):
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    for args in (["train", str(TINY), "--run-dir", url, "--no-progress"], ["log", url], ["state", url]):
        refused(rewind_cli(*args), 2, url, "not installed", package, extra)


def test_an_unknown_protocol_is_refused(rewind_cli, tmp_path):
    for args in (["train", str(TINY), "--run-dir", "s4://bucket/run"], ["diff", str(tmp_path), "s4://b/run"]):
        refused(rewind_cli(*args), 2, "s4://", "unknown protocol 's4'")


@pytest.mark.parametrize("args", [["train", str(TINY), "--run-dir", "memory://runs/a"], ["log", "memory://runs/a"]])
def test_memory_urls_are_refused_since_they_keep_nothing_past_the_process(rewind_cli, args):
    import fsspec

    refused(rewind_cli(*args), 2, "memory://runs/a", "keeps nothing once this process exits")
    assert not fsspec.filesystem("memory").exists("/runs/a")


def test_a_plain_file_url_still_passes_the_checks(rewind_cli, tmp_path):
    """The control for the refusals above: file:// is a filesystem rewind uses, so the command runs
    (and finds no run there)."""
    refused(rewind_cli("log", f"file://{tmp_path}/run"), 2, "no run here")


# --- export --to -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "needle"),
    [
        (lambda tmp: "/dev/full", "not a regular file"),
        (lambda tmp: str(tmp), "is a directory"),
        (lambda tmp: str(tmp / "file" / "model.safetensors"), "is not a directory"),
        (lambda tmp: "", "an empty path"),
    ],
    ids=["device", "directory", "under-a-file", "empty"],
)
def test_export_to_a_place_that_is_no_file_is_refused(rewind_cli, straight, tmp_path, target, needle):
    (tmp_path / "file").write_text("in the way")
    before = sorted(p.name for p in tmp_path.iterdir())
    refused(rewind_cli("export", straight, "--to", target(tmp_path)), 2, needle)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_export_on_a_full_disk_fails_and_leaves_nothing(rewind_cli, straight, tmp_path, monkeypatch):
    import errno

    from rewind.stores import fsio

    target = tmp_path / "out" / "model.safetensors"
    target.parent.mkdir()
    target.write_bytes(b"the previous export")

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fsio, "write_all", full)
    refused(rewind_cli("export", straight, "--to", target, "--overwrite"), 1, str(target), "No space left")
    assert target.read_bytes() == b"the previous export"  # untouched: the new file never replaced it
    assert [p.name for p in target.parent.iterdir()] == ["model.safetensors"]  # no temporary file left


def test_export_replaces_a_previous_file_whole(rewind_cli, straight, tmp_path):
    from safetensors.torch import load_file

    target = tmp_path / "model.safetensors"
    target.write_bytes(b"the previous export")
    code, out, err = rewind_cli("export", straight, "--to", target, "--overwrite")
    assert code == 0, err
    assert "wrote" in out and load_file(target)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_export_creates_missing_parent_directories(rewind_cli, straight, tmp_path):
    target = tmp_path / "a" / "b" / "model.safetensors"
    code, _, err = rewind_cli("export", straight, "--to", target)
    assert code == 0, err
    assert Path(target).stat().st_size > 0
