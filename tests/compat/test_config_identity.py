"""A config's identity (`config_hash`) did not change when a stage became a `[[stages]]` record: the
examples, now written as records, hash as they did written flat, and every compat fixture's logged config
(flat, upcast by schema 8) hashes to what its RunStarted recorded. Checkpoint and activation-cache names
depend on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewind.states.config_identity import config_hash
from rewind.states.events import ConfigChanged, RunStarted
from rewind.stores.eventlog import EventLog
from rewind.tools.configfile import load_config
from tests.conftest import EXAMPLES

FIXTURES = Path(__file__).resolve().parent / "fixtures"
RELEASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").exists())
# config_hash of each example as written with the flat per-stage lists, computed by rewind 0.3.0's code
# (f138f76, before [[stages]]).
# 0.1 labelled its configs with a hash of another canonical form; the code before [[stages]] computed
# this for its logged config, as the runs of every later release recorded for theirs.
HASH_BEFORE_RECORDS = {"0.1.0": "1c8535123d00b6ec3ebb70af0134455b0d1663444c003717ea66158d1a613af1"}
FLAT_HASHES = {
    "abcd": "a1f9f65f705a3be07380c9b016325e0f1075453d417d2f1ea46ea024f829e5f0",
    "abcd_nokl": "01af32d1b59f42236e83bd6f4d439542d720d88fb51b48cf13ed8f6b80a132e2",
    "progressive": "2869e0f3df87ae433057e89d24cbfe956c0d83cf4f57501dad160c6899c2d7d8",
    "text": "434ef86d6c4663945d316617e1ca4438ef0803a180a78507a2a224dc9751977a",
    "tiny": "a9afe55947acbf6d4fc46c9c9a66f61e28d521eabc6f07a5536e01d2bfc980ce",
}
# Examples written after stages became records (post-training strategies have no flat form): no hash before.
RECORDS_ONLY = {"posttrain", "distill"}


def test_every_example_is_written_as_records_and_hashes_as_it_did_flat():
    assert sorted(p.stem for p in EXAMPLES.glob("*.toml")) == sorted([*FLAT_HASHES, *RECORDS_ONLY])
    for name, expected in FLAT_HASHES.items():
        path = EXAMPLES / f"{name}.toml"
        text = path.read_text(encoding="utf-8")
        assert "[[stages]]" in text and "tokens = [" not in text
        assert config_hash(load_config(path)) == expected, name


@pytest.mark.parametrize("release", RELEASES)
def test_every_logged_config_of_an_old_run_hashes_as_recorded(release):
    configs = [
        r.event
        for r in EventLog.open(FIXTURES / release).records(check=False)
        if isinstance(r.event, RunStarted | ConfigChanged)
    ]
    assert configs and isinstance(configs[0], RunStarted) and configs[0].config.stages
    for event in configs:
        expected = HASH_BEFORE_RECORDS.get(release, event.config_hash)
        assert config_hash(event.config) == expected, (release, type(event).__name__)


def test_the_fixtures_config_file_hashes_as_the_runs_recorded():
    (started,) = [
        r.event
        for r in EventLog.open(FIXTURES / "0.3.0").records(check=False)
        if isinstance(r.event, RunStarted)
    ]
    assert config_hash(load_config(FIXTURES / "run.toml")) == started.config_hash
