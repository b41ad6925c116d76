"""`rewind train CONFIG --run-dir DIR` (start or resume) and `rewind resume DIR` (resume as logged)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rewind.tools.configfile import add_set_option, load_config
from rewind.tools.errors import CommandError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="start a run, or resume it if the run directory holds a log")
    p.add_argument("config", help="TOML config file")
    p.add_argument("--run-dir", required=True, help="run directory (local path or fsspec URL)")
    add_set_option(p)
    p.add_argument("--fork", action="store_true", help="resume under a config that differs from the run's")
    _common(p)
    p.set_defaults(run=run_train)

    r = sub.add_parser("resume", help="resume a run under the config it logged")
    r.add_argument("run_dir", metavar="RUN")
    _common(r)
    r.set_defaults(run=run_resume)


def _steps(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


MAX_STEPS_HELP = (
    "stop cleanly after this many steps of this process, counted from where it starts or resumes (not the run's "
    "step number: --max-steps 10 on a run resumed at step 40 stops after step 50); resumable"
)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-steps", type=_steps, default=None, help=MAX_STEPS_HELP)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_threads_option(p)


def add_threads_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=_thread_count,
        default=0,
        metavar="N",
        help="compute with N CPU threads, recorded (default: a new run, the cores this process may use; a resume "
        "or fork, the count on record; with another count its bits may differ from a run that never stopped)",
    )


def _thread_count(text: str) -> int:
    from rewind.states.admission import MAX_THREADS

    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= MAX_THREADS:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a whole number in 1..{MAX_THREADS}")
    return value


def run_train(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    return _train(
        config, args.run_dir, fork=args.fork, max_steps=args.max_steps, progress=not args.no_progress, threads=args.threads,
        base_dir=str(Path(args.config).resolve().parent),  # reward modules are looked for beside the config first
    )  # fmt: skip


def run_resume(args: argparse.Namespace) -> int:
    # No config: the one the run logged, as the resume's own fold finds it (its one read of the log).
    return _train(
        None, args.run_dir, fork=False, max_steps=args.max_steps, progress=not args.no_progress, threads=args.threads
    )


class ProgressBar:
    """step / stage / loss / tokens per second, on stderr; between steps, what the run is doing when it
    may take a while (a checkpoint, an evaluation, a growth), so the bar is never frozen without a word.

    A dataset read to its end is said, with or without the bar: the first time in a stage at once, and the
    epochs it begins after that in the same stage once, when the stage ends (or this process stops), so a
    small dataset read over and over says so twice a stage, not once an epoch."""

    def __init__(
        self, total: int, initial: int, enabled: bool, epochs: dict[str, int] | None = None, rows=None
    ):
        self.bar = None
        self.started = time.perf_counter()
        self.initial = initial
        self.epochs = dict(epochs or {})  # the epoch each dataset is in, to say when one begins
        self.rows = rows or (lambda name: None)  # a dataset's train rows (None: not known), for the words
        self.stage: int | None = None
        self.said: set[str] = set()  # datasets whose end was said in this stage
        self.later: dict[str, tuple[int, int, int]] = {}  # dataset: (first, last) epoch begun since, last's step
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stderr)

    def __call__(self, state) -> None:
        if state.stage != self.stage:
            self._say_later()
            self.stage = state.stage
        for name, epoch in sorted(state.epochs.items()):
            before = self.epochs.get(name, 0)
            if before != epoch:  # (a fork onto a larger file counts its epochs afresh: down to 1)
                self._began(name, before + 1 if epoch > before else epoch, epoch, state.step)
        self.epochs = dict(state.epochs)
        if self.bar is None:
            return
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        rate = (state.step - self.initial) * state.tokens_per_step / elapsed
        self.bar.set_postfix_str(f"stage {state.stage} loss {state.last_loss:.3f} {rate:,.0f} tok/s", refresh=False)
        self.bar.set_description_str("", refresh=False)
        self.bar.update(1)

    def _began(self, name: str, first: int, last: int, step: int) -> None:
        """Epochs first..last of dataset `name` begin with step `step`: said now if they are its first in
        the stage, else counted for the stage's end."""
        if name in self.said:
            earlier = self.later.get(name)
            self.later[name] = (earlier[0] if earlier else first, last, step)
            return
        self.said.add(name)
        rows = self.rows(name)
        read = f"all its {rows:,} train rows" if rows else "all its train rows"
        begins = f"epoch {last} begins" if first == last else f"epochs {first}-{last} begin"
        self._say(
            f"dataset {name!r}: {read} read; {begins} at step {step} (any more in stage {self.stage} are "
            "said once, at its end)"
        )

    def _say_later(self) -> None:
        """The epochs begun in the stage after the first said, one line a dataset."""
        for name, (first, last, step) in sorted(self.later.items()):
            began = f"epoch {last} began" if first == last else f"epochs {first}-{last} began"
            at = "at step" if first == last else "the last at step"
            self._say(f"dataset {name!r}: {began} too in stage {self.stage}, {at} {step}")
        self.said.clear()
        self.later.clear()

    def pause(self, what: str) -> None:
        """Say what the run does before the next step (the bar keeps the words until that step)."""
        if self.bar is not None:
            self.bar.set_description_str(what, refresh=True)

    def _say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(f"rewind: {line}", file=sys.stderr)
        else:
            print(f"rewind: {line}", file=sys.stderr)

    def close(self) -> None:
        self._say_later()  # the stage this process ends in
        if self.bar is not None:
            self.bar.close()


def _train(
    config, run_dir: str, *, fork: bool, max_steps: int | None, progress: bool, threads: int, base_dir: str | None = None
) -> int:
    """One process's part of training: the whole of it, or under torchrun one rank's (rank 0 alone writes
    the run and speaks; see rewind.engine.model.placement). `config` None: the run's own (`rewind resume`).
    The process group is joined as the run is entered (rewind.engine.run.entry), and left here."""
    from rewind.engine.model.placement import leave_process_group

    try:
        return _train_here(
            config, run_dir, fork=fork, max_steps=max_steps, progress=progress, threads=threads, base_dir=base_dir
        )
    finally:
        leave_process_group()


def _train_here(
    config, run_dir: str, *, fork: bool, max_steps: int | None, progress: bool, threads: int, base_dir: str | None
) -> int:
    from rewind.engine.model.ranks import is_writer
    from rewind.engine.run.session import RunError, open_run
    from rewind.stores.eventlog import LogLockedError

    notes: list[str] = []  # said after the line that says where the run resumes
    try:
        run, state, how = open_run(config, run_dir, fork=fork, threads=threads, note=notes.append, base_dir=base_dir)
    except RunError as exc:
        raise CommandError(str(exc), exc.exit_code) from None
    except LogLockedError as exc:
        raise CommandError(str(exc), 1) from None
    speaks = is_writer()  # (asked once the run is entered: a sharded one's process group is joined then)
    if how == "finished":  # (under another config: refused as it was entered)
        run.journal.close()
        if speaks:
            print(f"{run_dir}: the run is already finished (step {state.step}); nothing to do")
        return 0
    if how == "resumed" and speaks:
        ref = state.last_checkpoint
        origin = f"checkpoint {ref.checkpoint}" if ref else "the start (no checkpoint yet)"
        print(f"resuming {run_dir} at step {state.step} from {origin}", file=sys.stderr)
        for note in notes:
            print(f"  {note}", file=sys.stderr)
    return drive_and_report(run, state, run_dir, max_steps=max_steps, progress=progress and speaks, speaks=speaks)


def drive_and_report(run, state, run_dir: str, *, max_steps: int | None, progress: bool, speaks: bool = True) -> int:
    """Train an opened run to its end (or a stop), close it, and report (unless another process of a
    sharded run reports: `speaks`); returns the exit code."""
    from rewind.engine.run.loop import drive

    try:
        if speaks:
            _write_schedule_plot(run.parts, run_dir)
        bar = ProgressBar(
            run.parts.schedule.num_steps, state.step, progress, state.epochs, rows=lambda name: _train_rows(run, name)
        )
        try:
            outcome = drive(run, state, max_steps=max_steps, progress=bar, pausing=bar.pause)
        finally:
            bar.close()
    finally:
        run.journal.close()
    if outcome.status == "nonfinite":
        raise CommandError(outcome.message, 1)
    if outcome.status in ("stopped", "interrupted"):
        if speaks:
            print(f"rewind: {outcome.message}", file=sys.stderr)
        return 130 if outcome.status == "interrupted" else 0
    if not speaks:
        return 0
    if outcome.message:  # finished, with something to say (updates skipped for non-finite losses)
        print(f"rewind: warning: {outcome.message}", file=sys.stderr)
    print(summary(run_dir))
    return 0


def _train_rows(run, name: str) -> int | None:
    """How many train rows dataset `name` of the run has (None if it cannot say: the words go without)."""
    try:
        return run.parts.datasets[name].num_samples("train")
    except Exception:  # a count for a message: never a reason to stop a run
        return None


def local_directory(run_dir: str) -> str | None:
    """The run directory as a local path (a plain path or a file:// URL); None on any other filesystem."""
    if "://" not in run_dir:
        return run_dir
    from rewind.stores.fsio import filesystem

    location = filesystem(run_dir)
    return location.path if location.is_local else None


def _write_schedule_plot(parts, run_dir: str) -> None:
    local = local_directory(run_dir)
    if local is None:
        return  # the summary says it was not written
    from rewind.states.plan import plan
    from rewind.tools.plots import plot_schedule

    out = Path(local) / "plots" / "schedule.png"
    if out.exists():
        return
    try:
        plot_schedule(parts.schedule, list(plan(parts.schedule)), out, title=parts.config.run.name)
    except Exception as exc:  # a picture of the schedule: the run is on record and must go on without it
        print(f"rewind: warning: {out} not written ({type(exc).__name__}: {exc}); the run goes on", file=sys.stderr)


def projection_lines(run_dir: str) -> list[str]:
    """The summary's lines for the files projected from the log, each either where it is or, plainly,
    that it was not written and why: the engine projects metrics only into a plain local path, and
    plots only into a local directory, so a URL run directory may have neither."""
    local = local_directory(run_dir)
    if local is None:
        why = "not written: metrics, TensorBoard files and plots go only to a local run directory"
        return [f"  tensorboard  {why}", f"  metrics      {why}", f"  plots        {why}"]
    because = " (the run directory was given as a URL)" if "://" in run_dir else ""
    from rewind.tools.invocation import invocation

    rebuild = f"not written{because}; `{invocation('rewind')} export tensorboard {local}` writes it from the log"
    tb, jsonl, plots = Path(local) / "tb", Path(local) / "metrics.jsonl", Path(local) / "plots"
    return [
        f"  tensorboard  {run_dir}/tb/  ({invocation('tensorboard')} --logdir {local}/tb)" if tb.is_dir()
        else f"  tensorboard  {rebuild}",
        f"  metrics      {run_dir}/metrics.jsonl" if jsonl.is_file() else f"  metrics      {rebuild}",
        f"  plots        {run_dir}/plots/" if plots.is_dir() else "  plots        not written",
    ]


def summary(run_dir: str) -> str:
    """Where everything is, and every task's score at each boundary (so forgetting is visible)."""
    from rewind.states.events import Evaluated
    from rewind.states.fold import fold
    from rewind.states.history import effective
    from rewind.stores.runs import read_records
    from rewind.tools.invocation import invocation

    records = effective([(r.seq, r.event) for r in read_records(run_dir)])
    state = fold(e for _, e in records)
    evaluations = [e for _, e in records if isinstance(e, Evaluated)]
    last = state.last_checkpoint.checkpoint if state.last_checkpoint else "-"
    lines = [
        f"run finished: {state.step:,} steps, {state.tokens:,} tokens, final loss {state.last_loss:.4f}",
        f"  event log    {run_dir}/events/  ({invocation('rewind')} log {run_dir})",
        f"  checkpoints  {run_dir}/checkpoints/  (last: {last})",
        *projection_lines(run_dir),
    ]
    tasks = list(evaluations[0].scores) if evaluations else []
    # A run evaluates before training (the "(start)" row) only when training.evaluations is set.
    when = "at each stage boundary"
    if any(e.boundary < 0 for e in evaluations):
        when = "before training and at each stage boundary"
    if tasks:
        lines += ["", f"answer-token accuracy {when} (rows: after stage; columns: task)"]
        lines += _boundary_table(evaluations, tasks, lambda e, t: e.scores.get(t, float("nan")))
    texts = list(evaluations[0].bits_per_byte) if evaluations else []
    if texts:
        lines += ["", f"held-out text: bits per byte {when} (columns: dataset)"]
        lines += _boundary_table(evaluations, texts, lambda e, t: e.bits_per_byte.get(t, float("nan")))
    from rewind.states.history import config_in_force
    from rewind.tools.growth_report import growth_table
    from rewind.tools.posttrain_report import end_losses, posttrain_tables

    events = [e for _, e in records]
    posttraining = posttrain_tables(evaluations, config_in_force(records), end_losses(events))
    for table in (growth_table(events), posttraining):
        if table:
            lines += ["", *table]
    return "\n".join(lines)


def _boundary_table(evaluations: list, columns: list[str], value) -> list[str]:
    lines = [f"{'after stage':>12} " + " ".join(f"{c:>9}" for c in columns)]
    for e in evaluations:
        row = "(start)" if e.boundary < 0 else str(e.boundary)  # -1: the baseline before the first step
        lines.append(f"{row:>12} " + " ".join(f"{value(e, c):>9.3f}" for c in columns))
    return lines
