"""`rewind log RUN`: the events of a run, readable or as JSON, filtered, optionally following a live run.

The readable view shows a step of a dpo or grpo stage with the setting that ties it to the reference
(`dpo.beta=`, `grpo.kl_beta=`: rewind.tools.kl_terms) where the record's token-level `beta` is the 0 the
rules force there, and leaves out a dpo step's `kl`, always 0 (its loss is its tie to the reference). The
stage's setting is that of the config the record was written under (RunStarted's, or the ConfigChanged of
a fork in place before it). `--json` gives the records as they are.
"""

from __future__ import annotations

import argparse
import bisect
import math
import time
from collections.abc import Iterable

from rewind.states.config import Config
from rewind.states.events import EVENT_TYPES, ConfigChanged, Event, RunStarted, StepCommitted, event_to_dict
from rewind.tools.errors import UsageError
from rewind.tools.jsonout import NON_FINITE_HELP, print_json
from rewind.tools.kl_terms import kl_term

FOLLOW_POLL_S = 0.2  # how often --follow looks for new records once caught up
# How long --follow waits, with no writer holding the log, for a record before it decides the run
# has ended: longer than a writer takes between releasing the lock and a resume taking it again.
FOLLOW_QUIET_S = 2.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("log", help="list a run's events (filter by type and step range; --follow a live run)")
    p.add_argument("run_dir", metavar="RUN")
    p.add_argument(
        "--type", dest="types", action="append", default=[], metavar="T",
        help="only events of type T (any case: stepcommitted is StepCommitted); repeatable, or several at once "
        "separated by commas (--type StepCommitted,RunResumed)",
    )
    p.add_argument("--steps", metavar="A:B", help="only events with A <= step <= B (either side may be empty)")
    p.add_argument("--json", action="store_true", help=f"a JSON list of {{type, seq, step, ...fields}} ({NON_FINITE_HELP})")
    p.add_argument(
        "--follow",
        action="store_true",
        help="keep printing new events as a live run commits them; ends when the run finishes or stops, "
        f"or when no writer holds the log and no event has come for {FOLLOW_QUIET_S:g} s",
    )
    p.add_argument("--effective", action="store_true", help="leave out events superseded by a resume")
    p.set_defaults(run=run)


def parse_steps(text: str | None) -> tuple[int, float]:
    if text is None:
        return 0, math.inf
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return (int(low) if low else 0), (int(high) if high else math.inf)
    except ValueError:
        raise UsageError(f"--steps {text!r}: expected A:B, A: or :B with integer steps") from None


def check_types(types: list[str]) -> set[str]:
    """The event types named, as the log spells them; a name matches in any case (no two types differ
    only in case), and one --type may name several, separated by commas."""
    by_lower = {name.lower(): name for name in EVENT_TYPES}
    for given in types:
        if not all(t.strip() for t in given.split(",")):
            raise UsageError(f"--type {given!r}: an empty event type (name them separated by commas)")
    types = [t.strip() for given in types for t in given.split(",")]
    unknown = [t for t in types if t.lower() not in by_lower]
    if unknown:
        raise UsageError(f"--type {unknown[0]}: unknown event type (known: {', '.join(sorted(EVENT_TYPES))})")
    return {by_lower[t.lower()] for t in types}


def record_dict(seq: int, event: Event) -> dict:
    data = event_to_dict(event)
    return {"type": data.pop("type"), "seq": seq, **data}


class ConfigsInForce:
    """The config each record was written under, from the (seq, config) of RunStarted and each
    ConfigChanged; more are added as a followed log brings them."""

    def __init__(self, changes: Iterable[tuple[int, Config]] = ()):
        self.seqs: list[int] = []
        self.configs: list[Config] = []
        for seq, config in sorted(changes, key=lambda change: change[0]):
            self.add(seq, config)

    def add(self, seq: int, config: Config) -> None:
        if self.seqs and seq <= self.seqs[-1]:
            return  # (a followed log's records come in seq order; one seen already)
        self.seqs.append(seq)
        self.configs.append(config)

    def note(self, seq: int, event: Event) -> None:
        if isinstance(event, RunStarted | ConfigChanged):
            self.add(seq, event.config)

    def at(self, seq: int) -> Config | None:
        index = bisect.bisect_right(self.seqs, seq) - 1
        return self.configs[index] if index >= 0 else None


def describe(seq: int, event: Event, config: Config | None = None) -> str:
    """The record as one line. `config`: the one it was written under, to say a dpo or grpo step's own
    tie to the reference (see the module's docstring); without it, the record's fields as they are."""
    data = event_to_dict(event)
    name = data.pop("type")
    step, tokens = data.pop("step"), data.pop("tokens")
    if name == "RunStarted":
        where = {k: data[k] for k in ("device", "world_size") if data.get(k)}
        data = {"config_hash": data["config_hash"][:12], "name": data["config"]["run"]["name"], "parent": data["parent"], **where}
    if name == "RunResumed":
        # Where and with how many CPU threads it computes, when recorded (a release before schema 6
        # recorded nothing: one CPU process; before schema 7, no thread count: the run's).
        for key in ("device", "world_size", "num_threads"):
            if not data.get(key):
                data.pop(key, None)
    if name == "RunResumed" and data.pop("seed", None) is not None:
        data["seed"] = "(a copy of the state at the restore point)"  # `log --json` shows it in full
    if name == "CheckpointCommitted":
        data.pop("files")
        data["manifest_sha256"] = data["manifest_sha256"][:12]
        if data.get("state_sha256"):  # the digest that vouches for a snapshot (none before this release)
            data["state_sha256"] = data["state_sha256"][:12]
        else:
            data.pop("state_sha256", None)
    if name == "ConfigChanged":
        data.pop("config")
    if name == "StepCommitted" and not data.get("metrics"):
        data.pop("metrics", None)  # a pretraining step has none (a post-training one shows its own)
    if name == "StepCommitted" and config is not None and 0 <= data["stage"] < len(config.stages):
        data = _with_own_kl(data, config.stages[data["stage"]])
    if name == "Evaluated" and not data.get("posttraining"):
        data.pop("posttraining", None)  # only a post-training run measures them
    fields = " ".join(f"{k}={_short(v)}" for k, v in data.items())
    return f"{seq:>7} {step:>8} {tokens:>12,}  {name:<20} {fields}"


def _with_own_kl(data: dict, stage) -> dict:
    """A dpo or grpo step's fields with its stage's own KL setting where the token-level beta stands (0 by
    rule; a beta that is not 0 stays, beside it), and without a dpo step's `kl` (0: none is computed)."""
    term = kl_term(stage)
    if term.setting == "beta":
        return data
    shown = {}
    for key, value in data.items():
        if key == "beta":
            if value != 0:
                shown[key] = value
            shown[term.setting] = term.value
        elif not (key == "kl" and term.is_loss() and value == 0):
            shown[key] = value
    return shown


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_short(v)}" for k, v in value.items()) + "}"
    return str(value)


def _select(records: Iterable, types: set[str], low: int, high: float) -> list:
    return [(s, e) for s, e in records if (not types or type(e).__name__ in types) and low <= e.step <= high]


def run(args: argparse.Namespace) -> int:
    types = check_types(args.types)
    low, high = parse_steps(args.steps)
    if args.follow and args.json:
        raise UsageError("--follow prints one JSON object per line; use it without --json, or --json without it")
    selected, next_seq, configs = _read_selected(
        args.run_dir, types, low, high, effective=args.effective, configs=not args.json
    )
    if args.json:
        print_json([record_dict(s, e) for s, e in selected], default=str)
        return 0
    print(f"{'seq':>7} {'step':>8} {'tokens':>12}  {'type':<20} fields")
    for seq, event in selected:
        print(describe(seq, event, configs.at(seq)))
    if args.follow:
        return _follow(args.run_dir, next_seq, types, low, high, configs)
    return 0


def _read_selected(
    run_dir: str, types: set[str], low: int, high: float, *, effective: bool, configs: bool = False
) -> tuple[list, int, ConfigsInForce]:
    """The selected (seq, event) pairs, the seq after the last record, and (with `configs`, where a step
    is selected) the configs in force. Reads only the segments whose step range meets [low, high],
    besides the first record and the one after each resume before the last selected (where a fork in
    place puts its ConfigChanged): the cost is what is printed, not the size of the log. Errors are
    `open_log`'s (no log: exit 2; empty, damaged, no RunStarted: 1)."""
    from rewind.tools.runlog import open_log

    with open_log(run_dir) as (log, started):
        records = log.records_in_steps(low, high, effective=effective)
        selected = _select(((r.seq, r.event) for r in records), types, low, high)
        found = ConfigsInForce([(0, started.config)])
        steps = [seq for seq, event in selected if isinstance(event, StepCommitted)]
        if configs and steps:
            for mark in (m for summary in log.segment_summaries() for m in summary.resumes):
                if mark.seq + 1 < steps[-1]:
                    after = next(log.records(mark.seq + 1, mark.seq + 2), None)
                    if after is not None:
                        found.note(after.seq, after.event)
        return selected, log.next_seq, found


def _follow(run_dir: str, start_seq: int, types: set[str], low: int, high: float, configs: ConfigsInForce) -> int:
    """Print events as the writer commits them, until the run ends (Ctrl-C ends it too). The run has
    ended when the log's last record is RunFinished or RunStopped, or when no writer holds the log
    (its lock released, or its holder dead) and no record has arrived for FOLLOW_QUIET_S: a writer
    killed mid-run logs neither event, and without a writer nothing more can come (a later resume is
    a new process to follow). The quiet time covers a writer that has just released the lock to be
    followed by the next at once. The last record already printed is read again (not printed), so a
    run that had ended before the command started ends it at once."""
    from rewind.states.events import RunFinished, RunStopped
    from rewind.stores.eventlog import EventLog

    quiet_since = time.monotonic()

    def ended() -> bool:
        return time.monotonic() - quiet_since >= FOLLOW_QUIET_S and not writer_alive(run_dir)

    with EventLog.open(run_dir) as log:
        for record in log.follow(poll_s=FOLLOW_POLL_S, stop=ended, start_seq=max(start_seq - 1, 0)):
            quiet_since = time.monotonic()
            configs.note(record.seq, record.event)
            if record.seq >= start_seq and _select([(record.seq, record.event)], types, low, high):
                print(describe(record.seq, record.event, configs.at(record.seq)), flush=True)
            if isinstance(record.event, RunFinished | RunStopped):
                return 0
    return 0


def writer_alive(run_dir: str) -> bool:
    """Whether the lock file names a holder that may still be writing: a clean release empties the file,
    and a holder on this host whose process is gone (or a zombie) is dead. A holder on another host
    cannot be checked, so it counts as alive."""
    from rewind.stores.fsio import filesystem
    from rewind.stores.lock import is_stale, read_lock

    try:
        holder = read_lock(filesystem(run_dir).join("events", "LOCK"))
    except OSError:  # unreadable (a directory where the lock belongs): nobody can be writing
        return False
    return holder is not None and not is_stale(holder)
