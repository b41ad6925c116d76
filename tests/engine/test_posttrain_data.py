"""A post-training stage's own files are data on record like any other: a dpo run on a jsonl file of
prompt/chosen/rejected rows records the file's identity, and a resume after the file changed is refused
in one line before anything is recorded."""

from __future__ import annotations

import json

from rewind.states.events import RunStarted
from rewind.stores.runs import read_seq_events
from tests.conftest import EXAMPLES
from tests.engine.test_loop import run_cli

TINY = (EXAMPLES / "tiny.toml").read_text()
ROWS = [{"q": f"rev {w}=", "good": w[::-1], "bad": w} for w in ("abc", "hello", "xyzzy", "plugh", "frob", "quux")] * 8


def test_a_dpo_file_is_on_record_and_a_change_to_it_stops_a_resume(tmp_path):
    rows = tmp_path / "prefs.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    config = TINY[: TINY.index("[[stages]]")] + (
        '[[stages]]\ntokens = 2_560\ndatasets = [{ name = "reverse", rate = 1.0 }]\noverlap = 0.0\n'
        "refresh_reference = true\n\n"
        '[[stages]]\nstrategy = "dpo"\ntokens = 2_560\ndatasets = [{ name = "prefs", rate = 1.0 }]\n\n'
        f'[data.prefs]\nkind = "jsonl"\npath = "{rows}"\nprompt_field = "q"\nchosen_field = "good"\n'
        'rejected_field = "bad"\nvalidation_fraction = 0.25\n'
    )
    path, run = tmp_path / "dpo.toml", tmp_path / "run"
    path.write_text(config)
    code, _, err = run_cli("train", path, "--run-dir", run, "--no-progress", "--max-steps", "15")
    assert code == 0, err
    started = next(e for _, e in read_seq_events(run) if isinstance(e, RunStarted))
    assert started.data["prefs"].sources[0].path.endswith("prefs.jsonl")
    rows.write_text("".join(json.dumps({**r, "bad": r["bad"] + "!"}) + "\n" for r in ROWS))
    before = read_seq_events(run)
    code, _, err = run_cli("train", path, "--run-dir", run, "--no-progress")
    assert code == 1 and err.count("\n") == 1 and "prefs" in err, err
    assert read_seq_events(run) == before
