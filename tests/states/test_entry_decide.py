"""The one entry decision (rewind.states.entry.decide), for every way into a run: a start, a resume (as
logged, or forking in place), a fork, a replay and the reads of sample, eval and export, each from what
the run's log holds (a LogView): the restore point, the config in force, the compute site and the process
group, or the one line that refuses it; then what it appends (rewind.states.opening.opening_records)."""

from __future__ import annotations

import msgspec
import pytest

from rewind.states.config_identity import config_hash
from rewind.states.config_reading import loads_config
from rewind.states.entry import EntryRefused, Fork, LogView, ReadCheckpoint, Replay, Train, decide
from rewind.states.events import ConfigChanged, RunResumed, RunStarted
from rewind.states.fold import fold
from rewind.states.history import config_in_force, effective, point_of
from rewind.states.opening import opening_records
from rewind.states.strategies import simulate_run
from tests.states.test_entry import CONFIG, HERE, crashed_after

replace = msgspec.structs.replace
OTHER_SEED = replace(CONFIG, run=replace(CONFIG.run, seed=CONFIG.run.seed + 1))


def view_of(log: list, *, history: bool = False) -> LogView:
    """What the engine's reader hands the decision for `log` (history: every effective record too)."""
    records = list(enumerate(log))
    return LogView(
        "RUN", True, fold(log), config_in_force(records), len(log) - 1, effective(records) if history else ()
    )


def refused(ask, view: LogView, code: int) -> str:
    with pytest.raises(EntryRefused) as raised:
        decide(ask, view)
    assert raised.value.exit_code == code
    return str(raised.value)


def test_without_a_log_a_train_starts_and_every_other_entry_is_refused():
    for view in (LogView("RUN", found=False), LogView("RUN")):  # no log; a start that died before its first record
        entry = decide(Train(CONFIG), view)
        assert (entry.how, entry.point, entry.site, entry.config, entry.compute) == (
            "started", None, None, CONFIG, CONFIG.compute,
        )  # fmt: skip
    for ask in (Train(), Fork(0, lambda c: c), Replay(), ReadCheckpoint(), ReadCheckpoint(export=True)):
        assert refused(ask, LogView("RUN", found=False), 2) == "RUN: no run here (no event log)"
        assert refused(ask, LogView("RUN"), 1) == "RUN: the event log is empty"
        assert "does not start with RunStarted" in refused(ask, LogView("RUN", end_seq=3), 1)
    no_steps = loads_config(
        '[architecture]\nblock_size = 8\n[training]\nbatch_size = 2\ntokens = [8]\ndatasets = [[{ name = "grammar" }]]\n'
    )
    assert refused(Train(no_steps), LogView("RUN", found=False), 2).startswith("the run has no steps")


def test_a_resume_goes_on_under_the_logged_config_and_forks_in_place_only_when_asked():
    log = crashed_after(8)
    view = view_of(log)
    point = point_of(view.state)
    for ask in (Train(), Train(CONFIG)):  # `rewind resume`, `rewind train` with the run's own config
        entry = decide(ask, view)
        assert (entry.how, entry.point, entry.config, entry.changed) == ("resumed", point, CONFIG, False)
        assert entry.site is not None and entry.site.num_threads == point.state.num_threads
        assert not entry.site.reading and entry.compute == CONFIG.compute
    line = refused(Train(OTHER_SEED), view, 2)
    assert line.startswith("RUN: the config differs from the run's (run.seed: ") and line.endswith("pass --fork to continue under the new config")
    forked = decide(Train(OTHER_SEED, fork=True), view)
    assert (forked.how, forked.config, forked.logged, forked.changed) == ("resumed", OTHER_SEED, CONFIG, True)
    tokenizer = replace(CONFIG, tokenizer=replace(CONFIG.tokenizer, train_vocab_size=300))
    assert "RUN: tokenizer: a run's tokenizer is fixed" in refused(Train(tokenizer, fork=True), view, 2)
    resumed, change = opening_records(forked, HERE)
    assert isinstance(resumed, RunResumed) and isinstance(change, ConfigChanged)
    assert (resumed.superseded_first_seq, resumed.superseded_last_seq) == (point.seq + 1, len(log) - 1)
    assert change.config_hash == config_hash(OTHER_SEED)


def test_a_finished_run_is_entered_only_under_its_own_config():
    view = view_of(simulate_run(CONFIG))
    assert view.state.finished
    entry = decide(Train(), view)
    assert (entry.how, entry.point, entry.config) == ("finished", None, CONFIG)
    assert opening_records(entry, HERE) == ()
    line = refused(Train(OTHER_SEED, fork=True), view, 2)
    assert line.startswith(f"RUN: the run is already finished (step {view.state.step}), and the config given differs")


def test_a_fork_starts_from_the_last_intact_checkpoint_at_or_before_its_step():
    log = simulate_run(CONFIG)
    view = view_of(log, history=True)
    live = [c.step for c in view.state.live_checkpoints]
    last = max(live)
    entry = decide(Fork(last, lambda parent: OTHER_SEED), view)
    assert (entry.how, entry.point.state.step, entry.config, entry.logged) == ("forked", last, OTHER_SEED, CONFIG)
    assert entry.site is not None and entry.site.reading and entry.compute is None  # it joins no group
    older = decide(Fork(last, lambda c: c), view, intact=lambda point: point.state.step != last)
    assert older.point.state.step == sorted(live)[-2]  # the newest is damaged on disk: the one before it
    start = decide(Fork(last, lambda c: c), view, intact=lambda point: False)
    assert (start.point.checkpoint, start.point.state.step) == ("", 0)  # none intact: the run's start
    assert refused(Fork(last + 1, lambda c: c), view, 2) == (
        f"--at-step {last + 1}: RUN has reached step {last} (choose 0..{last})"
    )
    child, resumed, change = opening_records(entry, HERE, parent="/parent", version="9.9")
    assert isinstance(child, RunStarted) and child.parent.run == "/parent" and child.config == OTHER_SEED
    assert isinstance(resumed, RunResumed) and resumed.seed is not None and isinstance(change, ConfigChanged)


def test_a_replay_and_the_reads_choose_their_points_from_the_history():
    log = simulate_run(CONFIG)
    view = view_of(log, history=True)
    last = view.state.step
    replay = decide(Replay(), view)
    assert (replay.how, replay.point.state.step, replay.to_step) == ("replay", 0, last)  # from the seed
    assert replay.site is not None and replay.site.reading and replay.compute == CONFIG.compute
    assert "--to-step 999: must be after the start (step 0)" in refused(Replay(to_step=999), view, 2)
    live = sorted(c.step for c in view.state.live_checkpoints)
    read = decide(ReadCheckpoint(), view)
    assert (read.how, read.point.state.step, read.config) == ("read", live[-1], CONFIG)
    assert decide(ReadCheckpoint(at_step=live[0]), view).point.state.step == live[0]
    line = refused(ReadCheckpoint(at_step=1), view, 2)
    assert line == f"--at-step 1: no checkpoint at that step (retention keeps only some); checkpoints exist at steps {', '.join(map(str, live))}"
    export = decide(ReadCheckpoint(export=True), view)
    assert export.point == point_of(view.state) and export.site is None  # export computes nothing
    unfinished = view_of(simulate_run(CONFIG)[:3], history=True)  # started, no checkpoint yet
    assert refused(ReadCheckpoint(), unfinished, 1) == "RUN: the run has no committed checkpoint yet"
