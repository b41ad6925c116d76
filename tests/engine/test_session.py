"""Opening a run under a newer rewind: config identity is computed by the code that reads the log.

A run's log stores its config as that release encoded it, and a label (`config_hash`) that release
computed. Neither may decide whether a later release accepts the same config file: it decodes the
logged config (filling in fields added since, at their defaults) and compares canonical hashes it
computes itself.
"""

from __future__ import annotations

import msgspec
import pytest
import torch
from safetensors.torch import load_file

from rewind.states.config_reading import loads_config
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


def test_a_crash_just_after_a_reference_refresh_resumes_to_the_same_weights(tmp_path, monkeypatch):
    """Found in review: retention deleted the old reference right after a refresh, while the restore
    point (the checkpoint before the refresh) still named it; a crash there stranded the run."""
    from rewind.engine.run import loop
    from rewind.states.events import CheckpointDeleted, ReferenceRefreshed

    overrides = (*OVERRIDES, "optimization.kl.betas=[0.1,0.2,0.2]", "optimization.kl.reference_update_stages=[0,1]",
                 "logging.report_interval=1")
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    assert run_cli(*train_args(straight, overrides=overrides))[0] == 0
    refreshes = [e for _, e in read_seq_events(straight) if isinstance(e, ReferenceRefreshed)]
    crash_at = refreshes[-1].step  # dies in the first step after the refresh: no checkpoint since
    real = loop.execute_step

    def dies(parts, state):
        if state.step == crash_at:
            raise RuntimeError("killed")
        return real(parts, state)

    with monkeypatch.context() as patch:
        patch.setattr(loop, "execute_step", dies)
        with pytest.raises(RuntimeError, match="killed"):
            run_cli(*train_args(crashed, overrides=overrides))
    assert any(isinstance(e, CheckpointDeleted) for _, e in read_seq_events(crashed))
    code, _, err = run_cli(*train_args(crashed, overrides=overrides))
    assert code == 0, err
    for run in (straight, crashed):
        assert run_cli("export", run, "--to", run / "final.safetensors")[0] == 0
    a, b = load_file(straight / "final.safetensors"), load_file(crashed / "final.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert run_cli("verify", crashed)[0] == 0


def test_verify_names_a_restore_point_whose_reference_is_gone(tmp_path, monkeypatch, rewind_cli):
    """A log written under the retention bug found in review (the old reference deleted right after a
    refresh): `rewind verify` must say that a resume could not load it, not "clean"."""
    from rewind.states import plan
    from rewind.states.events import CheckpointDeleted, ReferenceRefreshed
    from rewind.states.strategies import simulate_run
    from rewind.stores.eventlog import EventLog

    def without_the_restore_points_files(state, keep_last):
        live = sorted(state.live_checkpoints, key=lambda c: c.step)
        protected = {c.checkpoint for c in live[-keep_last:]} | {c.checkpoint for c in live if c.reason != "interval"}
        protected -= {c.checkpoint for c in live if c.reason == "reference"}
        if state.reference is not None:
            protected.add(state.reference.checkpoint)
        return [c.checkpoint for c in live if c.checkpoint not in protected]

    config = loads_config(
        TINY.read_text(),
        overrides=[*OVERRIDES, "optimization.kl.betas=[0.1,0.2,0.2]", "optimization.kl.reference_update_stages=[0,1]"],
    )
    monkeypatch.setattr(plan, "checkpoints_to_delete", without_the_restore_points_files)
    events = simulate_run(config)
    references = {e.checkpoint for e in events if isinstance(e, ReferenceRefreshed)}
    cut = next(i for i, e in enumerate(events) if isinstance(e, CheckpointDeleted) and e.checkpoint in references) + 1
    with EventLog.open(tmp_path / "run", "w") as log:
        for event in events[:cut]:
            log.append(event)
        log.commit()
    code, out, _ = rewind_cli("verify", tmp_path / "run")
    assert code == 1
    assert "PROBLEM restore point: its KL reference" in out and "a resume could not load it" in out


def test_a_resume_does_not_train_from_a_forged_snapshot(tmp_path):
    """Found in review: a snapshot with its cursors changed (CRC recomputed) was used by a resume, which
    then drew other data. A resume starts only from a snapshot whose digest a checkpoint's record
    carries, and says which snapshot disagrees with the log."""
    import warnings

    from rewind.states.events import StepCommitted
    from rewind.stores import snapshots
    from rewind.stores.folding import SnapshotsIgnored

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_cli(*train_args(straight, "--max-steps", "8"))[0] == 0
    assert run_cli(*train_args(stopped, "--max-steps", "6"))[0] == 0
    newest = max(snapshots.list_seqs(str(stopped)))
    snapshot = snapshots.read(str(stopped), newest)
    assert snapshot is not None and snapshot.state.cursors
    cursors = {name: count + 1 for name, count in snapshot.state.cursors.items()}
    forged = msgspec.structs.replace(snapshot, state=msgspec.structs.replace(snapshot.state, cursors=cursors))
    (stopped / "snapshots" / f"{newest:012d}.state").write_bytes(snapshots.encode(forged))
    with warnings.catch_warnings():
        warnings.simplefilter("always", SnapshotsIgnored)
        code, _, err = run_cli(*train_args(stopped, "--max-steps", "2"))
    assert code == 0 and f"snapshot {newest:012d}: differs from the fold of the log" in err, err

    def steps(run):
        return {e.step: e for _, e in read_seq_events(run) if isinstance(e, StepCommitted)}

    assert steps(stopped)[8].cursors == steps(straight)[8].cursors
    assert msgspec.msgpack.encode(steps(stopped)[8]) == msgspec.msgpack.encode(steps(straight)[8])


def test_a_resume_folds_only_the_tail_after_the_snapshot_its_last_checkpoint_vouches_for(tmp_path, monkeypatch):
    """A checkpoint's record carries the digest of the state folded up to the record before it, and the
    engine caches that state: a resume starts there (the log's tail, not the whole log) and goes on
    exactly as the straight run did; `rewind verify` finds every digest and snapshot right."""
    from rewind.engine.run import entry
    from rewind.states.events import CheckpointCommitted, StepCommitted
    from rewind.stores import snapshots

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_cli(*train_args(straight, "--max-steps", "8"))[0] == 0
    assert run_cli(*train_args(stopped, "--max-steps", "6"))[0] == 0
    records = read_seq_events(stopped)
    last = max(seq for seq, e in records if isinstance(e, CheckpointCommitted))
    assert records[last][1].state_sha256 and last - 1 in snapshots.list_seqs(str(stopped))
    folds, fold_log = [], entry.fold_log
    monkeypatch.setattr(entry, "fold_log", lambda *args: folds.append(fold_log(*args)) or folds[-1])
    code, _, err = run_cli("resume", stopped, "--no-progress", "--max-steps", "2")
    assert code == 0, err
    assert folds[0].snapshot_seq == last - 1 and [seq for seq, _ in folds[0].tail] == list(range(last, len(records)))

    def steps(run):
        return {e.step: msgspec.msgpack.encode(e) for _, e in read_seq_events(run) if isinstance(e, StepCommitted)}

    assert steps(stopped) == steps(straight)
    code, out, _ = run_cli("verify", stopped)
    assert code == 0 and "PROBLEM" not in out, out


def test_a_resume_reads_and_folds_the_log_once(tmp_path, monkeypatch):
    """Found in review (issue 34): `rewind resume` folded the log for its config, then the resume folded
    it again; every entry reads a run's log once (rewind.engine.run.entry.read_log), its writer's open
    apart. Counted where every fold a resume makes goes through, whoever imported it."""
    from rewind.stores import folding
    from rewind.stores.eventlog import EventLog

    run = tmp_path / "run"
    assert run_cli(*train_args(run, "--max-steps", "6"))[0] == 0
    folds, fold_for_resume = [], folding._fold_for_resume
    monkeypatch.setattr(folding, "_fold_for_resume", lambda *args: folds.append(args) or fold_for_resume(*args))
    opened, open_log = [], EventLog.open.__func__

    def counted(cls, run_url, mode="r", **kw):
        opened.append(mode)
        return open_log(cls, run_url, mode, **kw)

    monkeypatch.setattr(EventLog, "open", classmethod(counted))
    code, _, err = run_cli("resume", run, "--no-progress", "--max-steps", "1")
    assert code == 0, err
    assert len(folds) == 1
    assert opened == ["r", "w"]  # read once to decide, then opened for writing


def test_rewind_resume_takes_its_config_from_no_snapshot_the_log_does_not_vouch_for(tmp_path):
    """Found in review: `rewind resume` read the config in force from the newest snapshot unchecked, so a
    snapshot forged to hold another config (its checksum recomputed) changed what the resume did (here:
    another seed, so a refusal). It folds as the resume does: only a vouched snapshot is read."""
    import warnings

    from rewind.stores import snapshots
    from rewind.stores.folding import SnapshotsIgnored

    run = tmp_path / "run"
    assert run_cli(*train_args(run, "--max-steps", "6"))[0] == 0
    for seq in snapshots.list_seqs(str(run)):
        snapshot = snapshots.read(str(run), seq)
        other = msgspec.structs.replace(snapshot.config, run=msgspec.structs.replace(snapshot.config.run, seed=99))
        (run / "snapshots" / f"{seq:012d}.state").write_bytes(snapshots.encode(msgspec.structs.replace(snapshot, config=other)))
    with warnings.catch_warnings():
        warnings.simplefilter("always", SnapshotsIgnored)
        code, _, err = run_cli("resume", run, "--no-progress", "--max-steps", "1")
    assert code == 0, err
    said = [line for line in err.splitlines() if "SnapshotsIgnored" in line or "differs from the fold" in line]
    assert len(said) == 1, err  # said once, by the resume
    from rewind.states.events import ConfigChanged, RunResumed

    events = [e for _, e in read_seq_events(run)]
    assert any(isinstance(e, RunResumed) for e in events) and not any(isinstance(e, ConfigChanged) for e in events)


def test_a_fork_in_place_trains_with_its_new_optimizer_settings_and_never_opens_the_old_data(tmp_path):
    """Found in review: restoring a checkpoint copied the saved weight decay and betas over the new
    config's, and an in-place fork opened the old config's datasets (gone once a file has moved)."""
    from rewind.engine.run.session import open_run

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "line {i} of a small corpus for the test"}}\n' for i in range(300)))
    data = ["data.corpus.kind='jsonl'", f"data.corpus.path='{corpus}'"]
    mixture = ["training.datasets=[[{name='corpus'}],[{name='reverse'}],[{name='sort'}]]", "training.evaluations=[]"]
    first = (*OVERRIDES, *data, *mixture)
    run = tmp_path / "run"
    assert run_cli(*train_args(run, "--max-steps", "5", overrides=first))[0] == 0
    moved = corpus.rename(tmp_path / "moved.jsonl")
    changed = [*OVERRIDES, *mixture, "data.corpus.kind='jsonl'", f"data.corpus.path='{moved}'",
               "optimization.weight_decay=0.25", "optimization.beta2=0.9"]
    config = loads_config(TINY.read_text(), overrides=changed)
    opened, _, how = open_run(config, str(run), fork=True)
    try:
        assert how == "resumed"
        assert [(g["weight_decay"], g["betas"]) for g in opened.parts.optimizer.param_groups] == [
            (0.25, (0.9, 0.9)),
            (0.0, (0.9, 0.9)),
        ]
    finally:
        opened.journal.close()
