"""The `rewind` command. Each subcommand lives in its own module, which imports what it needs (torch,
the stores) only when it runs, so `rewind schedule` never pays for (or needs) torch.

Every error a user can cause ends as one line on stderr and a non-zero exit: 2 for usage and config
problems, 1 for a run or data that is not as expected (damage, or the filesystem refusing: a full
disk, a read-only mount, no permission, a file where a directory belongs), 130 for Ctrl-C. Never a
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

# subcommand module -> its `add_parser`; the order is the order of `rewind --help`.
COMMAND_MODULES = [
    "rewind.tools.train_cmd",
    "rewind.tools.data_cmd",
    "rewind.tools.schedule_cmd",
    "rewind.tools.import_cmd",
    "rewind.tools.log_cmd",
    "rewind.tools.state_cmd",
    "rewind.tools.timeline_cmd",
    "rewind.tools.diff_cmd",
    "rewind.tools.replay_cmd",
    "rewind.tools.fork_cmd",
    "rewind.tools.verify_cmd",
    "rewind.tools.export_cmd",
    "rewind.tools.sample_cmd",
    "rewind.tools.rollouts_cmd",
    "rewind.tools.eval_cmd",
    "rewind.tools.bench.command",
]


DESCRIPTION = (
    "rewind trains language models as an explicit state machine: every transition is an event in an "
    "append-only, checksummed log. Kill a run anywhere and resume it bit for bit; inspect, diff and "
    "replay runs from their logs."
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + exits 2; we keep it to one line
        self.exit(2, f"{self.prog}: {message}\n")


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("rewind")
    except metadata.PackageNotFoundError:  # a checkout that was never installed
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rewind", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"rewind {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if problem := undecodable_argument(sys.argv[1:] if argv is None else argv):
        _say(f"rewind: {problem}")
        return 2
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        # rewind's warnings (a torn tail cut off, a stale lock broken) are news for the user: one line
        # each, not Python's file:line report with a source excerpt.
        warnings.showwarning = _show_warning
        return _run(args)


def undecodable_argument(argv: list[str]) -> str:
    """The line refusing the first argument that is not UTF-8 ("" when all are). Python hands over the
    bytes of such an argument as lone surrogates (surrogateescape), which nothing downstream can encode:
    a log record, a JSON line, a printed name, a path made from it. Refused here, once, before anything
    runs, so no command records a RunStarted it then cannot go on from."""
    for i, arg in enumerate(argv):
        if not _surrogates(arg):
            continue
        shown = _shown(arg)
        option, eq, _ = arg.partition("=")
        if arg.startswith("--") and eq and not _surrogates(option):
            where = f"{option} {shown[len(option) + 1 :]}"
        elif i > 0 and argv[i - 1].startswith("-") and "=" not in argv[i - 1]:
            where = f"{argv[i - 1]} {shown}"
        else:
            where = shown
        return f"{where}: not UTF-8 text; rewind takes its arguments, paths included, as UTF-8"
    return ""


def _surrogates(text: str) -> bool:
    return any("\ud800" <= char <= "\udfff" for char in text)


def _shown(arg: str) -> str:
    """`arg` printable: its bytes as \\xNN where surrogateescape made them, any other surrogate as \\uNNNN."""
    if all(not "\ud800" <= char <= "\udfff" or "\udc80" <= char <= "\udcff" for char in arg):
        return arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return arg.encode("utf-8", "backslashreplace").decode("utf-8")


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    _say(f"rewind: warning: {message}")


def _say(line: str) -> None:
    """One line for the user on stderr; under torchrun from rank 0 alone (every rank of a sharded run
    stops with the same message: rewind.engine.run.session.together)."""
    if os.environ.get("RANK", "0") in ("", "0"):
        print(line, file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    from rewind.states.config import ConfigError
    from rewind.tools.errors import CommandError
    from rewind.tools.rundir import check_run_dirs

    try:
        check_run_dirs(args)
        return int(args.run(args) or 0)
    except ConfigError as exc:
        for line in exc.lines():
            _say(f"rewind: {line}")
        return 2
    except CommandError as exc:
        _say(f"rewind: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        _say("rewind: interrupted")
        return 130
    except BrokenPipeError:
        return 0
    except OSError as exc:  # the filesystem said no: ENOSPC, EROFS, EACCES, ENOTDIR, EISDIR, ...
        _say(f"rewind: {describe_os_error(exc, args)}")
        return 1
    except Exception as exc:
        if lost := _lost_peer(exc):
            print(f"rewind: {lost}", file=sys.stderr)  # from whichever rank survived, rank 0 or not
            return 1
        if not _is_damage(exc):
            raise
        _say(f"rewind: {exc}")
        return 1


def _lost_peer(exc: Exception) -> str:
    """Under torchrun, the line for a collective that failed because another rank is gone ("" otherwise)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return ""
    from rewind.engine.model.ranks import lost_peer

    return lost_peer(exc)


# Damaged or unreadable run data (a CRC mismatch mid-log, a newer schema, a checkpoint whose hash does
# not match): one line naming the place, exit 1, from any command. Matched by name so that `rewind
# schedule` never imports the stores (and torch) just to be able to catch their errors.
_DAMAGE = {
    ("rewind.stores.codec", "LogError"),
    ("rewind.stores.manifest", "CheckpointError"),
    ("rewind.states.transition", "IllegalTransition"),  # a log that does not fold (tampered, or a buggy writer)
    ("rewind.states.history", "HistoryError"),
    ("rewind.stores.metrics", "MetricsError"),  # the metrics projection cannot be written or read
    ("rewind.stores.datamanifest", "ManifestError"),  # a prepared data directory that does not read
    ("rewind.stores.confine", "NotConfined"),  # a name in the run that leads out of it
    ("rewind.engine.data.rundata", "DataChanged"),  # a data file changed under a training run
    ("rewind.engine.data.tokens", "TokenFileError"),  # a token file cut short while it was read
    ("rewind.stores.rollouts", "RolloutError"),  # a grpo run's rollout file missing or damaged
    ("rewind.engine.posttrain.rewards", "RewardError"),  # a grpo stage's reward function cannot score
    ("rewind.engine.step.kinds", "KindError"),  # a stage kind's input gone mid-run (a distill stage's teacher file)
}


def describe_os_error(exc: OSError, args: argparse.Namespace) -> str:
    """One line naming the path the system call was about (or else the run), and why it failed."""
    why = exc.strerror or str(exc) or type(exc).__name__
    if exc.filename is not None:
        where = str(exc.filename)
        if exc.filename2 is not None:
            where += f" -> {exc.filename2}"
        return f"{where}: {why}"
    run_dir = getattr(args, "run_dir", None)
    return f"{run_dir}: {why}" if run_dir else why


def _is_damage(exc: Exception) -> bool:
    return any((cls.__module__, cls.__name__) in _DAMAGE for cls in type(exc).__mro__)


def entry() -> None:
    from rewind.tools.cpu_threads import prepare_threads

    prepare_threads()  # before anything imports torch: its OpenMP runtime reads the settings once
    code = main()
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A rank under torchrun: its process group is already torn down (engine.placement), and what is
        # left of gloo's threads can abort the interpreter's own shutdown ("terminate called without an
        # active exception", ~1 exit in 10 with torch 2.13 on the CPU), which torchrun reports as a
        # failed run. Everything is written and flushed; leave without that shutdown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
