"""The log against an in-memory model through random append / commit / crash / reopen sequences.

A crash abandons the writer like kill -9 (nothing flushed, the lock left behind); it may strike in
the middle of a commit, after some bytes were written and before they were synced, and then a random
part of those unsynced bytes is lost too. Invariant: the log holds exactly the committed records;
after a crash mid-commit it may also hold a prefix of that commit's records (they were in doubt), but
never anything else.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import warnings

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rewind.stores import fsio
from rewind.stores.eventlog import EVENTS_DIR, EventLog, StaleLockBroken, TornTailTruncated, verify_log
from tests.stores.conftest import abandon, remove_memory_root, skip_syncs
from tests.stores.samples import events_strategy

SEGMENT_BYTES = 300


class SimulatedCrash(BaseException):
    """The process dies at this point: no except or finally block of the writer gets to clean up."""


@functools.cache
def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


class LogMachine(RuleBasedStateMachine):
    backend = "local"

    def __init__(self) -> None:
        super().__init__()
        if self.backend == "local":
            self.root = tempfile.mkdtemp(prefix="rewind-stateful-")
            self.url = os.path.join(self.root, "run")
        else:
            self.root = f"/rewind-stateful/{uuid.uuid4().hex}"
            self.url = f"memory://{self.root}/run"
        self.events_dir = fsio.filesystem(self.url).join(EVENTS_DIR)
        self.saved_syncs = skip_syncs()  # crashes are simulated by cutting files, not by power loss
        self.log = EventLog.open(self.url, "w", segment_bytes=SEGMENT_BYTES)
        self.committed: list = []
        self.pending: list = []

    def teardown(self) -> None:
        for name, function in self.saved_syncs.items():
            setattr(fsio, name, function)
        self.log.close()
        if self.backend == "local":
            shutil.rmtree(self.root)
        else:
            remove_memory_root(self.root)

    @rule(events=st.lists(events_strategy(), min_size=1, max_size=6))
    def append(self, events) -> None:
        for event in events:
            assert self.log.append(event) == len(self.committed) + len(self.pending)
            self.pending.append(event)

    @rule()
    def commit(self) -> None:
        assert self.log.commit() == len(self.pending)
        self.committed += self.pending
        self.pending = []

    @rule(check=st.sampled_from(["all", "tail"]))
    def reopen(self, check) -> None:
        self.log.close()  # drops what was not committed
        self.pending = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a clean close leaves nothing to recover
            self.log = EventLog.open(self.url, "w", segment_bytes=SEGMENT_BYTES, check=check)

    @rule(data=st.data())
    def crash(self, data) -> None:
        self._crash(data, in_flight=[])

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def crash_in_the_middle_of_a_commit(self, data) -> None:
        sizes = {name: self.events_dir.join(name).size() for name in self.events_dir.list_names()}
        in_flight = self.pending
        if self.backend == "local":
            patches = {(fsio, "sync_fd"): _raise_crash}  # dies after the first write, before its sync
        else:  # dies after the first object put, however the commit puts it
            patches = {(fsio.Location, put): _put_then_crash(put) for put in ("write_atomic", "create_exclusive")}
        originals = {key: getattr(*key) for key in patches}
        for (target, name), replacement in patches.items():
            setattr(target, name, replacement)
        try:
            self.log.commit()
            raise AssertionError("the commit should have crashed")
        except SimulatedCrash:
            pass
        finally:
            for (target, name), original in originals.items():
                setattr(target, name, original)
        if self.backend == "local":  # power loss: part of what was never synced is gone too
            for segment in sorted(self.events_dir.list_names()):
                path = self.events_dir.join(segment).path
                before, after = sizes.get(segment, 0), os.path.getsize(path)
                if after > before:
                    os.truncate(path, data.draw(st.integers(before, after), label=f"cut {segment}"))
        self._crash(data, in_flight=in_flight)

    def _crash(self, data, in_flight: list) -> None:
        abandon(self.log, dead_pid())
        self.pending = []
        check = data.draw(st.sampled_from(["all", "tail"]), label="check")  # both must see the crash
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.log = EventLog.open(self.url, "w", segment_bytes=SEGMENT_BYTES, check=check)
        kinds = [type(w.message) for w in caught]
        assert StaleLockBroken in kinds and set(kinds) <= {StaleLockBroken, TornTailTruncated}
        found = self.log.events()
        assert found[: len(self.committed)] == self.committed  # nothing committed is ever lost
        in_doubt = found[len(self.committed) :]
        assert in_doubt == in_flight[: len(in_doubt)]  # and nothing appears that was not written
        self.committed = found

    @invariant()
    def log_matches_model(self) -> None:
        assert self.log.num_committed == len(self.committed)
        assert self.log.next_seq == len(self.committed) + len(self.pending)
        assert self.log.events() == self.committed

    @invariant()
    def index_files_match_their_segments(self) -> None:
        # Written at each seal from the writer's running stats, or on reopen from a scan: whatever
        # crashed in between, each must say exactly what a scan of its segment finds.
        report = verify_log(self.url)
        assert report.ok, report
        with EventLog.open(self.url) as reader:
            summaries = reader.segment_summaries()
        assert summaries == [] or summaries[-1].next_seq == len(self.committed)


def _put_then_crash(name: str):
    real_put = getattr(fsio.Location, name)

    def replacement(location, payload):
        real_put(location, payload)
        raise SimulatedCrash

    return replacement


def _raise_crash(*args: object) -> None:
    raise SimulatedCrash


class MemoryLogMachine(LogMachine):
    backend = "memory"


STATEFUL_SETTINGS = settings(max_examples=50, stateful_step_count=40, deadline=None)
TestLocalLog = LogMachine.TestCase
TestLocalLog.settings = STATEFUL_SETTINGS
TestMemoryLog = MemoryLogMachine.TestCase
TestMemoryLog.settings = STATEFUL_SETTINGS
