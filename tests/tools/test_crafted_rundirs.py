"""A run directory is untrusted input: crafted ones end as one line and exit 1, read nothing outside
the run, and change nothing inside it.

Each test forges one thing into a copy of a short real run: a manifest whose file entry leaves the run,
a checkpoint file that is a link out, /dev/zero, a FIFO or bigger than recorded, a RunStarted whose
config no config file could have (batch_size = 0) or whose thread count would crash OpenMP, a fork seed
past the end of the run. Logs are forged with the stores' own writer (tests/tools/rundir_forgery.py),
so only the content is wrong, never the framing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import pytest

from rewind.states.events import (
    CheckpointCommitted,
    CheckpointDeleted,
    ReferenceRefreshed,
    RunResumed,
    RunStarted,
)
from rewind.states.fold import fold
from rewind.stores.checkpoints import CheckpointStore
from rewind.stores.manifest import FileEntry, encode_manifest
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import run_cli, train_args
from tests.tools.rundir_forgery import nine_step_run, opened_paths, rewrite_log, tree_state

replace = msgspec.structs.replace


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    return nine_step_run(tmp_path_factory.mktemp("crafted"))


@pytest.fixture
def run(base_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(base_run, copy, symlinks=True)
    return copy


@pytest.fixture
def outside(tmp_path) -> Path:
    """A file beside the run (not in it) that no command may open."""
    sentinel = tmp_path / "outside"
    sentinel.write_bytes(b"not part of any run")
    return sentinel


def restore_checkpoint(run: Path) -> tuple[str, dict[str, str]]:
    ref = fold(e for _, e in read_seq_events(run)).last_checkpoint
    assert ref is not None
    return ref.checkpoint, dict(ref.files)


def assert_refused(run: Path, outside: Path, *args: str, expect: str) -> str:
    """`rewind ARGS` fails with one line naming `expect`, opens nothing outside the run, changes nothing."""
    before = tree_state(run)
    with opened_paths() as seen:
        code, out, err = run_cli(*args)
    assert code == 1, (out, err)
    assert len(err.strip().splitlines()) == 1 and expect in err, err
    assert "Traceback" not in err
    assert os.path.realpath(outside) not in seen
    assert tree_state(run) == before
    return err


def assert_verify_fails(run: Path, outside: Path, expect: str) -> None:
    before = tree_state(run)
    with opened_paths() as seen:
        code, out, err = run_cli("verify", run)
    assert code == 1 and err == "", (out, err)
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM")]
    assert problems and any(expect in line for line in problems), out
    assert os.path.realpath(outside) not in seen
    assert tree_state(run) == before


# --- checkpoint files --------------------------------------------------------------------------------


@pytest.mark.parametrize("entry_name", ["../../../outside", "ABSOLUTE"])
def test_a_manifest_entry_that_leaves_the_run_is_never_followed(run, outside, entry_name):
    entry_name = str(outside) if entry_name == "ABSOLUTE" else entry_name
    assert (run / "checkpoints" / "NAME" / entry_name).resolve() == outside.resolve()  # it would lead there
    store = CheckpointStore(run)
    old, _ = restore_checkpoint(run)
    manifest = store.load_manifest(old)
    # The forged entry pins the outside file's real size and hash: a reader that followed it would
    # find everything in order and call the checkpoint clean.
    data = outside.read_bytes()
    import hashlib

    forged = FileEntry(
        name=entry_name, num_bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), tensors=[]
    )
    entries = [forged if e.name == "model.safetensors" else e for e in manifest.files]
    manifest_bytes, written = encode_manifest(manifest.step, entries, manifest.meta)
    new_dir = run / "checkpoints" / written.name
    new_dir.mkdir()
    (new_dir / "manifest.json").write_bytes(manifest_bytes)
    shutil.copy(run / "checkpoints" / old / "optimizer.safetensors", new_dir / "optimizer.safetensors")
    shutil.rmtree(run / "checkpoints" / old)

    def renamed(seq, event):
        if isinstance(event, CheckpointCommitted) and event.checkpoint == old:
            return replace(
                event, checkpoint=written.name, manifest_sha256=written.manifest_sha256, files=written.files
            )
        if isinstance(event, CheckpointDeleted | ReferenceRefreshed) and event.checkpoint == old:
            return replace(event, checkpoint=written.name)
        return event

    rewrite_log(run, renamed)
    with opened_paths() as seen:
        problems = store.verify(written.name, written.files)
        with pytest.raises(Exception, match="not a plain"):
            store.load(written.name)
    assert problems and "not a plain" in problems[0]
    assert os.path.realpath(outside) not in seen
    assert_verify_fails(run, outside, "not a plain <group>.safetensors name")
    assert_refused(
        run, outside, "resume", run, "--no-progress", expect="not a plain <group>.safetensors name"
    )


def _link_out(path: Path, outside: Path) -> None:
    outside.write_bytes(path.read_bytes())  # the same bytes: only where they are is wrong
    path.unlink()
    path.symlink_to(outside)


def _dev_zero(path: Path, outside: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _fifo(path: Path, outside: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _grown(path: Path, outside: Path) -> None:
    with open(path, "ab") as handle:
        handle.write(b"\0" * 4096)


@pytest.mark.parametrize(
    ("craft", "expect"),
    [
        (_link_out, "leads outside the run directory"),
        (_dev_zero, "leads outside the run directory"),
        (_fifo, "is not a regular file"),
        (_grown, "bytes, but"),
    ],
    ids=["symlink-out", "dev-zero", "fifo", "oversized"],
)
def test_a_checkpoint_file_that_is_not_a_file_of_the_run_is_refused_without_reading_it(
    run, outside, craft, expect
):
    name, _ = restore_checkpoint(run)
    craft(run / "checkpoints" / name / "model.safetensors", outside)
    assert_verify_fails(run, outside, expect)
    assert_refused(run, outside, *train_args(run), expect=expect)


# --- records whose content no rewind run could have written ------------------------------------------


def _started(change):
    def forge(seq, event):
        return change(event) if isinstance(event, RunStarted) else event

    return forge


def test_a_logged_config_gets_the_checks_a_config_file_gets(run, outside):
    rewrite_log(
        run,
        _started(
            lambda e: replace(e, config=replace(e.config, training=replace(e.config.training, batch_size=0)))
        ),
    )
    expect = "training.batch_size: must be positive, got 0"
    assert_verify_fails(run, outside, expect)
    readers = (
        ["log", run],
        ["timeline", run],
        ["diff", run, run],
        ["replay", run],
        ["export", run, "--to", run.parent / "w.safetensors"],
    )
    for args in (train_args(run), ["resume", run, "--no-progress"], ["state", run], *readers):
        err = assert_refused(run, outside, *args, expect=expect)
        assert "record 0 (RunStarted" in err


def test_a_run_started_with_behaviours_this_release_lacks_is_refused(run, outside):
    """A newer release gates what it computes differently on a feature name: this one cannot do it, so
    resuming or replaying such a run here would silently compute something else."""
    rewrite_log(run, _started(lambda e: replace(e, features=[*e.features, "from_the_future"])))
    expect = "behaviours this release does not have (from_the_future)"
    assert_verify_fails(run, outside, expect)
    for args in (train_args(run), ["replay", run]):
        assert_refused(run, outside, *args, expect=expect)


def test_a_logged_thread_count_is_never_handed_to_openmp(run, outside, monkeypatch):
    import torch

    rewrite_log(run, _started(lambda e: replace(e, num_threads=100_000)))
    asked: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    assert_verify_fails(run, outside, "num_threads 100000 is out of range")
    assert_refused(run, outside, *train_args(run), expect="num_threads 100000 is out of range")
    assert_refused(
        run, outside, "fork", run, run.parent / "child", "--at-step", "8", expect="num_threads 100000"
    )
    assert 100_000 not in asked and not (run.parent / "child").exists()  # (the 1s are run_cli's own)


@pytest.fixture
def child(run, tmp_path) -> Path:
    """A fork of the run at its restore point: its log carries a seed."""
    child = tmp_path / "child"
    code, _, err = run_cli("fork", run, child, "--at-step", "8", "--max-steps", "0", "--no-progress")
    assert code == 0, err
    assert any(isinstance(e, RunResumed) and e.seed is not None for _, e in read_seq_events(child))
    return child


def _forge_seed(change):
    def forge(seq, event):
        if isinstance(event, RunResumed) and event.seed is not None:
            return change(event)
        return event

    return forge


def _far_future(event: RunResumed) -> RunResumed:
    step = 10**9
    name = f"{step:08d}-{event.checkpoint.split('-')[1]}"
    tokens = event.tokens // event.step * step
    live = [
        replace(c, checkpoint=name, step=step, tokens=tokens) if c.checkpoint == event.checkpoint else c
        for c in event.seed.live_checkpoints
    ]
    return replace(
        event, step=step, tokens=tokens, checkpoint=name, seed=replace(event.seed, live_checkpoints=live)
    )


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        (_far_future, "past the run's end"),
        (lambda e: replace(e, seed=replace(e.seed, cursors={"grammar": -5})), "cursors must be >= 0"),
        (lambda e: replace(e, seed=replace(e.seed, cursors={"grammar": 10**12})), "more samples than"),
    ],
    ids=["step-1e9", "negative-cursor", "impossible-cursor"],
)
def test_a_forged_fork_seed_is_refused_by_verify_and_train(child, outside, change, expect):
    rewrite_log(child, _forge_seed(change))
    assert_verify_fails(child, outside, expect)
    assert_refused(child, outside, "resume", child, "--no-progress", expect=expect)
