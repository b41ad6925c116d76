"""Golden outputs of the read-side tools: `rewind state`, `timeline`, `log` and `diff` on committed logs.

`golden/runs/` holds three small event logs written by `golden/make_golden_runs.py` from
`simulate_run` (no torch, no checkpoint files: these tools only read the log):
- `straight`: the run of `golden/config.toml`, no crash;
- `crashed`: the same run dying after steps 6 and 13 and resuming, so it has RunResumed records and
  superseded records;
- `perturbed`: `straight` with every StepCommitted loss from step 9 on multiplied by 1 + 1e-6, so
  `rewind diff` has a divergence to find (and none within `--rtol 1e-5`).

`golden/expected/<name>.txt` is what each command in `COMMANDS` printed, run in-process from
`golden/runs/` so that the run paths in the output are the short names; `expected/exit_codes.json`
holds their exit codes. A change to any of them is a user-visible change of the command line: review
it, then regenerate with `python tests/tools/golden/make_golden_runs.py` and commit the new files with
the change that caused them.

The logs are also checked against what `simulate_run` produces today, so a change of the simulator or
of the event schema shows up here as well (and then the logs need regenerating too). `rewind verify`
is checked too, but not pinned: for the missing checkpoint files it names the absolute path of the
run's checkpoints/ directory, which differs between checkouts.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest

from rewind.states.config import Config
from rewind.states.config_reading import loads_config
from rewind.states.events import Event, StepCommitted
from rewind.states.fold import fold
from rewind.states.strategies import simulate_run
from rewind.stores.eventlog import EventLog
from rewind.tools.cli import main as rewind_main

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN_CONFIG = GOLDEN_DIR / "config.toml"
RUNS_DIR = GOLDEN_DIR / "runs"
EXPECTED_DIR = GOLDEN_DIR / "expected"
EXIT_CODES = EXPECTED_DIR / "exit_codes.json"

RUN_NAMES = ("straight", "crashed", "perturbed")
CRASH_AFTER = (6, 13)
PERTURBED_FROM_STEP = 9
LOSS_FACTOR = 1 + 1e-6  # well inside the --rtol 1e-5 of the last diff, far outside bitwise equality

# Every command whose output is pinned, run from RUNS_DIR. Its expected file is named by `golden_name`.
COMMANDS: tuple[tuple[str, ...], ...] = (
    ("state", "straight", "--json"),
    ("state", "crashed"),
    ("state", "crashed", "--at-step", "6"),
    ("state", "crashed", "--at-seq", "12"),
    ("timeline", "straight"),
    ("timeline", "crashed", "--json"),
    ("log", "crashed", "--effective"),
    ("diff", "straight", "crashed"),
    ("diff", "straight", "perturbed"),
    ("diff", "straight", "perturbed", "--rtol", "1e-5"),
)

REGENERATE = (
    "A change to these outputs is a user-visible change of the `rewind` command line: review it, and "
    "if it is intended, regenerate the goldens with `python tests/tools/golden/make_golden_runs.py` "
    "and commit them with the change."
)


def golden_name(args: Sequence[str]) -> str:
    """`state crashed --at-step 6` -> `state_crashed_at_step_6`: the stem of its expected file."""
    return "_".join(arg.lstrip("-").replace("-", "_") for arg in args)


def golden_config() -> Config:
    return loads_config(GOLDEN_CONFIG.read_text(encoding="utf-8"))


def perturb(events: Sequence[Event]) -> list[Event]:
    """The events with every StepCommitted loss from PERTURBED_FROM_STEP on scaled by LOSS_FACTOR."""
    return [
        msgspec.structs.replace(e, loss=e.loss * LOSS_FACTOR)
        if isinstance(e, StepCommitted) and e.step >= PERTURBED_FROM_STEP
        else e
        for e in events
    ]


def golden_runs() -> dict[str, list[Event]]:
    """The events of each golden run, as today's simulator makes them."""
    config = golden_config()
    straight = simulate_run(config)
    perturbed = perturb(straight)
    fold(perturbed)  # raises IllegalTransition if the perturbation broke the run's control flow
    return {
        "straight": straight,
        "crashed": simulate_run(config, crash_after=CRASH_AFTER),
        "perturbed": perturbed,
    }


def run_rewind(args: Sequence[str]) -> tuple[int, str, str]:
    """`rewind ARGS...` in-process from RUNS_DIR: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(RUNS_DIR), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = rewind_main(list(args))
        except SystemExit as exc:  # argparse usage errors
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def machine_dependent(text: str) -> list[str]:
    """The absolute paths of this checkout that `text` names: they would differ on another machine."""
    repo = GOLDEN_DIR.parents[2]
    places = {str(RUNS_DIR.absolute()), str(RUNS_DIR.resolve()), str(repo.absolute()), str(repo.resolve())}
    return sorted(place for place in places if place in text)


def files_under(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))


def _encoded(events: Sequence[Event]) -> list[bytes]:
    return [msgspec.json.encode(e) for e in events]  # tagged: the event type is part of the bytes


# --- the outputs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("args", COMMANDS, ids=golden_name)
def test_the_output_is_the_committed_one(args):
    name = golden_name(args)
    expected_file = EXPECTED_DIR / f"{name}.txt"
    exit_codes = json.loads(EXIT_CODES.read_bytes()) if EXIT_CODES.exists() else {}
    assert expected_file.exists() and name in exit_codes, (
        f"no golden output for `rewind {' '.join(args)}`. {REGENERATE}"
    )
    before = files_under(RUNS_DIR)

    code, out, err = run_rewind(args)

    assert out == expected_file.read_bytes().decode("utf-8"), (
        f"`rewind {' '.join(args)}` no longer prints what {expected_file.relative_to(GOLDEN_DIR.parents[2])} "
        f"holds. {REGENERATE}"
    )
    assert code == exit_codes[name], (
        f"`rewind {' '.join(args)}` exits {code}, the golden says {exit_codes[name]}. {REGENERATE}"
    )
    assert err == "", f"`rewind {' '.join(args)}` wrote to stderr: {err!r}"
    assert machine_dependent(out) == [], "an output names a place on this machine; it cannot be a golden"
    assert files_under(RUNS_DIR) == before, "a read-side command wrote into the run directories"


def test_every_expected_file_belongs_to_a_command():
    # A command dropped from COMMANDS must take its golden with it, or the goldens stop meaning anything.
    expected = {p.stem for p in EXPECTED_DIR.glob("*.txt")}
    assert expected == {golden_name(args) for args in COMMANDS}, REGENERATE
    assert set(json.loads(EXIT_CODES.read_bytes())) == expected, REGENERATE


def test_the_exit_codes_say_what_the_outputs_say():
    # diff(1) convention: 1 when the runs diverge, 0 when they do not; the others always succeed.
    exit_codes = json.loads(EXIT_CODES.read_bytes())
    assert exit_codes.pop("diff_straight_perturbed") == 1
    assert exit_codes.pop("diff_straight_perturbed_rtol_1e_5") == 0
    assert exit_codes.pop("diff_straight_crashed") == 0  # a resumed run redoes its lost steps exactly
    assert set(exit_codes.values()) == {0}
    within_rtol = (EXPECTED_DIR / "diff_straight_perturbed_rtol_1e_5.txt").read_text(encoding="utf-8")
    assert "no divergence: the runs agree within rtol 1e-05" in within_rtol
    diverged = (EXPECTED_DIR / "diff_straight_perturbed.txt").read_text(encoding="utf-8")
    assert f"at step {PERTURBED_FROM_STEP}: StepCommitted, field loss" in diverged


# --- the logs ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def simulated() -> dict[str, list[Event]]:
    return golden_runs()


@pytest.mark.parametrize("name", RUN_NAMES)
def test_the_committed_log_is_what_the_simulator_writes_today(name, simulated):
    with EventLog.open(RUNS_DIR / name) as log:
        records = list(log.records())
    assert [r.seq for r in records] == list(range(len(records)))
    logged, expected = _encoded([r.event for r in records]), _encoded(simulated[name])
    # The first seq where they differ (or where the shorter one ends), to name in the message.
    first = next(
        (i for i, (a, b) in enumerate(zip(logged, expected, strict=False)) if a != b),
        min(len(logged), len(expected)),
    )
    assert logged == expected, (
        f"golden/runs/{name} ({len(logged)} events) is no longer what simulate_run writes today "
        f"({len(expected)} events); first difference at seq {first}:\n"
        f"  logged:    {logged[first] if first < len(logged) else '(none)'}\n"
        f"  simulated: {expected[first] if first < len(expected) else '(none)'}\n"
        "The simulator or the event schema changed. If that is intended, regenerate the goldens with "
        "`python tests/tools/golden/make_golden_runs.py`, and review the outputs that change with them: "
        "a change to those is a user-visible change."
    )


@pytest.mark.parametrize("name", RUN_NAMES)
def test_the_golden_runs_hold_only_their_log(name):
    # No checkpoints/ (the tools under test never read one) and no LOCK left behind by the writer. An
    # empty listing means the logs were never committed: the top .gitignore leaves out every `runs/`,
    # and golden/.gitignore takes this one back in.
    assert files_under(RUNS_DIR / name) == ["events", "events/00000000.log"], (
        f"golden/runs/{name} should hold exactly one log segment"
    )


@pytest.mark.parametrize("name", RUN_NAMES)
def test_verify_finds_nothing_wrong_with_the_log_or_its_fold(name, simulated):
    code, out, err = run_rewind(["verify", name])
    events = simulated[name]
    final = fold(events)
    live = [c.checkpoint for c in final.live_checkpoints]
    num_bytes = (RUNS_DIR / name / "events" / "00000000.log").stat().st_size
    lines = out.splitlines()
    assert lines[:2] == [
        f"log: {len(events)} records in 1 segment(s), {num_bytes:,} bytes",
        f"fold: ok (step {final.step}, finished)",
    ]
    # The goldens carry no checkpoint files, so verify reports every live checkpoint as not found and
    # exits 1; "not found" is the only problem allowed. Not a golden output: those lines name the
    # checkpoints/ directory by its absolute path, which differs between checkouts.
    assert len(lines) == 4 + len(live), lines
    assert lines[2] == f"checkpoints: {len(live)} live, {len(live)} with problems"
    assert lines[-1] == f"verify: {len(live)} problem(s)"
    for checkpoint, line in zip(live, lines[3:-1], strict=True):
        assert line.startswith(f"PROBLEM checkpoint {checkpoint}: checkpoint {checkpoint} not found under /")
        assert line.endswith(f"/{name}/checkpoints")
    assert (code, err) == (1, "")
