"""Regenerate the golden runs and outputs of tests/tools/test_golden_outputs.py.

Run by hand from anywhere: python tests/tools/golden/make_golden_runs.py

It rewrites golden/runs/ (the three event logs, from `simulate_run`) and golden/expected/ (what each
command printed, and exit_codes.json). Do it only for a change that is meant to alter what the
read-side tools print, or what the simulator writes; then review the diff of expected/ as what users
will see, and commit it with that change.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repo root, for `tests.tools`

from rewind.states.events import Event, StepCommitted
from rewind.stores.eventlog import EventLog
from tests.tools.test_golden_outputs import (
    COMMANDS,
    EXIT_CODES,
    EXPECTED_DIR,
    RUNS_DIR,
    golden_name,
    golden_runs,
    machine_dependent,
    run_rewind,
)


def write_run(run_dir: Path, events: Sequence[Event]) -> None:
    with EventLog.open(run_dir, "w") as log:
        for event in events:
            if isinstance(event, StepCommitted):  # group commits at step boundaries, as the engine does
                log.commit()
            log.append(event)
        log.commit()


def main() -> None:
    shutil.rmtree(RUNS_DIR, ignore_errors=True)
    shutil.rmtree(EXPECTED_DIR, ignore_errors=True)
    EXPECTED_DIR.mkdir(parents=True)
    for name, events in golden_runs().items():
        write_run(RUNS_DIR / name, events)
        print(f"wrote {len(events)} events to {RUNS_DIR / name}")

    exit_codes: dict[str, int] = {}
    for args in COMMANDS:
        name = golden_name(args)
        code, out, err = run_rewind(args)
        if err:
            raise SystemExit(f"`rewind {' '.join(args)}` wrote to stderr (exit {code}):\n{err}")
        if places := machine_dependent(out):
            raise SystemExit(f"`rewind {' '.join(args)}` prints {places}: not usable as a golden")
        (EXPECTED_DIR / f"{name}.txt").write_bytes(out.encode("utf-8"))
        exit_codes[name] = code
        print(f"rewind {' '.join(args)}: exit {code}, {len(out.splitlines())} lines")
    EXIT_CODES.write_text(json.dumps(exit_codes, indent=1, sort_keys=True) + "\n", encoding="utf-8")

    within_rtol = (EXPECTED_DIR / "diff_straight_perturbed_rtol_1e_5.txt").read_text(encoding="utf-8")
    if "no divergence" not in within_rtol:
        raise SystemExit("diff straight perturbed --rtol 1e-5 should find no divergence:\n" + within_rtol)


if __name__ == "__main__":
    main()
