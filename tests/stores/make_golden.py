"""Regenerate tests/stores/golden/run/ (run: python tests/stores/make_golden.py).

Only when adding a golden log for a *new* schema version: the committed one is the record of what
version-1 logs look like, and the golden test exists to notice when they stop reading.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `tests.stores`

import msgspec

from rewind.states.config import Config, config_hash
from rewind.states.events import EVENT_TYPES
from rewind.stores.eventlog import EventLog
from tests.stores.test_golden import (
    DEFAULT_CONFIG_HASH,
    GOLDEN_CONFIG,
    GOLDEN_RUN,
    GOLDEN_SEGMENT_BYTES,
    golden_events,
)


def main() -> None:
    config = Config()  # today's defaults, kept next to the log for the test to compare against
    if config_hash(config) != DEFAULT_CONFIG_HASH:
        raise SystemExit(f"set DEFAULT_CONFIG_HASH in test_golden.py to {config_hash(config)!r} first")
    events = golden_events(config)
    missing = set(EVENT_TYPES) - {type(e).__name__ for e in events}
    if missing:
        raise SystemExit(f"golden_events() lacks event types: {', '.join(sorted(missing))}")
    shutil.rmtree(GOLDEN_RUN, ignore_errors=True)
    GOLDEN_CONFIG.write_bytes(msgspec.json.format(msgspec.json.encode(config)) + b"\n")
    with EventLog.open(GOLDEN_RUN, "w", segment_bytes=GOLDEN_SEGMENT_BYTES) as log:
        for i, event in enumerate(events):
            log.append(event)
            if i % 3 == 2:  # group commits, as the engine does at step boundaries
                log.commit()
        log.commit()
    print(f"wrote {len(events)} events to {GOLDEN_RUN}")


if __name__ == "__main__":
    main()
