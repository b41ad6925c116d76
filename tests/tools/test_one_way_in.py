"""One way into a run (issue 34): every entry (start, resume, fork in place, fork, replay, sample, eval,
export) is decided by rewind.states.entry and carried out by rewind.engine.run.entry.enter, so a failure
reads the same from every command, and the records an entry appends are built in one place each."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

from tests.engine.test_loop import one_line, run_cli
from tests.tools.test_data_runs import documents_setup, flip_byte, token_setup, train

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    """A run stopped at step 4 (a checkpoint there) on its own copy of a token file."""
    folder = tmp_path_factory.mktemp("entry")
    code, _, err = train(token_setup(folder), folder / "run", "--max-steps", "4")
    assert code == 0, err
    return folder / "run"


ENTRIES = {
    "resume": lambda run: ["resume", run, "--no-progress"],
    "fork in place": lambda run: ["train", run.parent / "run.toml", "--run-dir", run, "--fork", "--no-progress",
                                  "--set", "optimization.lr=0.002"],
    "fork": lambda run: ["fork", run, run.parent / "child", "--at-step", "4", "--no-progress"],
    "replay": lambda run: ["replay", run, "--no-progress"],
    "eval": lambda run: ["eval", run, "--dataset", "corpus"],
}  # fmt: skip


def test_changed_data_is_one_line_worded_once_for_every_entry(stopped):
    """Before, four wordings: "changed under it" (resume), "its data changed since it recorded it"
    (fork, without the verify hint), "... (`rewind verify --data`)" (replay, without the run), and eval's
    without the run's name in front."""
    assert (stopped.parent / "run.toml").exists()
    data = stopped.parent / "corpus.bin"
    original = data.read_bytes()
    try:
        flip_byte(data, 7)
        for name, args in ENTRIES.items():
            code, _, err = run_cli(*args(stopped))
            line = one_line(err)
            assert code == 1, (name, err)
            assert line.startswith(f"rewind: {stopped}: dataset 'corpus': "), (name, line)
            assert line.endswith(f"; the run's data changed under it (`rewind verify --data {stopped}`)"), (name, line)
        assert not (stopped.parent / "child").exists()
    finally:
        data.write_bytes(original)


def test_an_unreadable_run_tokenizer_is_the_runs_state_for_every_entry(tmp_path):
    """Before, a resume, a fork and a replay said it as a config problem (exit 2, the bare message), eval as
    the run's (exit 1, the run named)."""
    code, _, err = train(documents_setup(tmp_path), tmp_path / "run", "--max-steps", "4")
    assert code == 0, err
    run = tmp_path / "run"
    (run / "data" / "tokenizer.json").write_bytes(b"\xff\xfe not a tokenizer")
    for name, args in ENTRIES.items():
        code, _, err = run_cli(*args(run))
        line = one_line(err)
        assert code == 1 and line.startswith(f"rewind: {run}: the run's tokenizer: "), (name, line)
        assert "not a tokenizer.json" in line, (name, line)


def test_a_replay_reads_its_log_and_adopts_its_site_once(stopped, monkeypatch):
    """Before, `rewind replay` adopted the compute site twice (the command the run's latest, then the
    replay its start's) and folded the log twice."""
    from rewind.engine.run import assemble
    from rewind.states import fold as folding

    adopted, adopt = [], assemble.adopt_cpu_capability
    monkeypatch.setattr(assemble, "adopt_cpu_capability", lambda recorded: adopted.append(recorded) or adopt(recorded))
    folds, fold = [], folding.fold

    def counted(events, state=None):
        events = list(events)
        if len(events) > 2:  # a log's, not an entry's own few records
            folds.append(len(events))
        return fold(events) if state is None else fold(events, state)

    for name in ("rewind.states.fold", "rewind.engine.run.entry", "rewind.engine.run.replay"):
        if importlib.util.find_spec(name) is not None:  # (whichever modules bind it, before and after)
            monkeypatch.setattr(importlib.import_module(name), "fold", counted, raising=False)
    code, out, err = run_cli("replay", stopped, "--no-progress")
    assert code == 0 and out.endswith("replay: reproducible\n"), err
    assert len(adopted) == 1 and len(folds) == 1


def test_a_missing_run_is_one_line_for_every_entry(tmp_path):
    missing = tmp_path / "nothing"
    for args in [
        ["resume", missing],
        ["fork", missing, tmp_path / "child", "--at-step", "0"],
        ["replay", missing],
        ["sample", missing, "--prompt", "a"],
        ["eval", missing, "--dataset", "corpus"],
        ["export", missing, "--to", tmp_path / "out.safetensors"],
    ]:
        code, _, err = run_cli(*args)
        assert (code, one_line(err)) == (2, f"rewind: {missing}: no run here (no event log)"), args


def constructed(path: Path, names: set[str]) -> list[str]:
    """'file: Name' for every call that constructs one of `names` in the module at `path`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [
        f"{path.relative_to(ROOT)}: {node.func.id}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
    ]


def test_the_records_an_entry_appends_are_built_in_one_place_each():
    """RunStarted and RunResumed are built by rewind.states.opening alone among the modules a run is
    entered through (before: the session built a start's RunStarted, states.entry a fork's and a resume's).
    What else builds them is no entry: the dry-run plan of `rewind schedule`, the test strategies' simulated
    runs, the synthetic logs of tests and benches."""
    not_entries = {"states/plan.py", "states/strategies.py", "stores/synthetic.py"}
    sources = [
        p
        for folder in ("states", "engine", "stores", "tools")
        for p in sorted((ROOT / folder).rglob("*.py"))
        if str(p.relative_to(ROOT)) not in not_entries and "bench" not in p.relative_to(ROOT).parts
    ]
    found = [line for p in sources for line in constructed(p, {"RunStarted", "RunResumed"})]
    assert found == ["states/opening.py: RunStarted", "states/opening.py: RunResumed"]
