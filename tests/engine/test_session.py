"""Opening a run under a newer rewind: config identity is computed by the code that reads the log.

A run's log stores its config as that release encoded it, and a label (`config_hash`) that release
computed. Neither may decide whether a later release accepts the same config file: it decodes the
logged config (filling in fields added since, at their defaults) and compares canonical hashes it
computes itself.
"""

from __future__ import annotations

import msgspec

from rewind.states.config import loads_config
from rewind.stores.codec import encode_frame
from rewind.stores.runs import read_seq_events
from tests.engine.test_loop import OVERRIDES, TINY, run_cli, train_args


def _older_release_start(run_dir, drop: list[str]) -> None:
    """A log holding only the RunStarted an older release would have written for the tiny config: its
    config payload lacks the fields in `drop` (they did not exist yet) and its label is that release's."""
    config = msgspec.to_builtins(loads_config(TINY.read_text(), overrides=list(OVERRIDES)))
    for path in drop:
        section, name = path.split(".")
        del config[section][name]
    payload = {"type": "RunStarted", "step": 0, "tokens": 0, "config": config, "config_hash": "0" * 64}
    (run_dir / "events").mkdir(parents=True)  # framed as rewind 0.1 (schema 1) framed it
    (run_dir / "events" / "00000000.log").write_bytes(encode_frame(0, msgspec.msgpack.encode(payload), version=1))


def test_a_run_whose_config_predates_fields_added_since_resumes_under_its_config_file(tmp_path):
    run = tmp_path / "run"
    _older_release_start(run, drop=["architecture.rope_base", "architecture.activation_checkpointing"])
    code, _, err = run_cli(*train_args(run, "--max-steps", "2"))
    assert code == 0, err
    assert "the config differs" not in err and f"resuming {run}" in err
    started = read_seq_events(run)[0][1]
    assert started.config.architecture.rope_base == 10000.0  # filled in from today's default


def test_a_really_different_config_is_refused_naming_the_field(tmp_path):
    run = tmp_path / "run"
    _older_release_start(run, drop=["architecture.rope_base"])
    code, _, err = run_cli(*train_args(run, overrides=(*OVERRIDES, "run.seed=99")))
    assert code == 2
    assert "the config differs from the run's (run.seed: 7 -> 99)" in err
    assert len(read_seq_events(run)) == 1  # nothing was written
