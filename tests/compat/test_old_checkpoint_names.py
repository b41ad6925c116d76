"""Old runs keep their checkpoints' names. A run started before "content_named_checkpoints" writes
manifest format 1 (which holds the log position) for life: what it has on disk keeps its names and
verifies, its resumes and its forks write format 1 again, and a fork copies its checkpoints under the
names its parent's log gives them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rewind.states.events import CheckpointCommitted, RunResumed
from rewind.stores.checkpoints import FORMAT_WITH_LOG_SEQ, MANIFEST, WRITTEN, CheckpointStore
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import one_torch_thread

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _format_one(fixture: Path) -> bool:
    """Left by a release before content-named checkpoints (0.3 and later write format 2)."""
    manifests = sorted((fixture / "checkpoints").glob("*/manifest.json"))
    return bool(manifests) and all(json.loads(m.read_text())["format_version"] == 1 for m in manifests)


RELEASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").exists() and _format_one(p))


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


@pytest.fixture(params=RELEASES)
def old_run(request, tmp_path) -> Path:
    copy = tmp_path / request.param  # the committed fixture is never written to
    shutil.copytree(
        FIXTURES / request.param, copy, ignore=shutil.ignore_patterns("expected.json", "run.toml")
    )
    return copy


def _names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir() if p.name[0].isdigit())


def _formats(run: Path) -> set[int]:
    return {
        json.loads((run / "checkpoints" / n / MANIFEST).read_text())["format_version"] for n in _names(run)
    }


def test_an_old_runs_checkpoints_keep_their_names_and_a_resume_writes_its_format(old_run, rewind_cli):
    before = _names(old_run)
    store = CheckpointStore(old_run)
    assert before and all(store.load_manifest(name).format_version == FORMAT_WITH_LOG_SEQ for name in before)
    code, _, err = rewind_cli("resume", old_run, "--no-progress", "--max-steps", "2")
    assert code == 0, err
    written = [e.checkpoint for _, e in read_seq_events(old_run) if isinstance(e, CheckpointCommitted)]
    assert set(written) - set(before), "the resume wrote no checkpoint"
    assert set(before) <= set(_names(old_run))  # on disk under the names they had
    assert _formats(old_run) == {FORMAT_WITH_LOG_SEQ}
    assert not any((old_run / "checkpoints" / n / WRITTEN).exists() for n in _names(old_run))
    code, out, err = rewind_cli("verify", old_run)
    assert code == 0, out + err


def test_a_fork_of_an_old_run_copies_its_checkpoint_under_its_name(old_run, rewind_cli, tmp_path):
    """The copy is written in the parent's format: in today's format it would get another name, and the
    fork would be refused as unfaithful."""
    last = _names(old_run)[-1]
    child = tmp_path / "child"
    code, _, err = rewind_cli(
        "fork", old_run, child, "--at-step", str(int(last[:8])), "--no-progress", "--max-steps", "1"
    )
    assert code == 0, err
    resumed = next(e for _, e in read_seq_events(child) if isinstance(e, RunResumed))
    assert resumed.checkpoint == last
    parent_manifest = (old_run / "checkpoints" / last / MANIFEST).read_bytes()
    assert (child / "checkpoints" / last / MANIFEST).read_bytes() == parent_manifest
    assert _formats(child) == {FORMAT_WITH_LOG_SEQ}  # and its own checkpoint (the stop) too
    assert len(_names(child)) == 2
    code, out, err = rewind_cli("verify", child)
    assert code == 0, out + err
