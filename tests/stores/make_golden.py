"""Write the golden log of today's schema version and frame format (run: python tests/stores/make_golden.py).

Only when adding a golden log for a *new* schema version or frame format: the committed ones are the
record of what logs of their versions look like, and the golden test exists to notice when they stop
reading. It refuses to overwrite one. (`run/` and `run-v2/` predate frame format 2; `run-vS-fF` is schema S in frame format F.)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `tests.stores`

from rewind.states.events import EVENT_TYPES, SCHEMA_VERSION
from rewind.stores.codec import FRAME_FORMAT
from rewind.stores.eventlog import EventLog
from tests.stores.test_golden import GOLDEN_DIR, GOLDEN_SEGMENT_BYTES, golden_events


def main() -> None:
    events = golden_events()  # the default config of the first log's day, with today's schema's stages
    missing = set(EVENT_TYPES) - {type(e).__name__ for e in events}
    if missing:
        raise SystemExit(f"golden_events() lacks event types: {', '.join(sorted(missing))}")
    out = GOLDEN_DIR / f"run-v{SCHEMA_VERSION}-f{FRAME_FORMAT}"
    if out.exists():
        raise SystemExit(f"{out} exists: golden logs are written once per schema version and frame format")
    with EventLog.open(out, "w", segment_bytes=GOLDEN_SEGMENT_BYTES) as log:
        for i, event in enumerate(events):
            log.append(event)
            if i % 3 == 2:  # group commits, as the engine does at step boundaries
                log.commit()
        log.commit()
    print(f"wrote {len(events)} events to {out}")


if __name__ == "__main__":
    main()
