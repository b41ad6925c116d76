"""Checks on a run directory named on the command line, before any command opens it: the mistakes a
new user makes (an empty path, a misspelt or uninstalled fsspec protocol, `memory://`) as one line
and exit 2, instead of a traceback from deep inside fsspec or a run trained where nobody can find it.

Exit 2 for all of them: each is fixed on the command line or by installing an extra, not by repairing
a run. `memory://` is refused for every command: it lives only as long as the process, so a run
trained there is gone when the command ends, and a new process finds nothing there to read.
"""

from __future__ import annotations

import argparse

from rewind.tools.errors import UsageError

# Namespace attributes that hold a run directory, and how a message names them.
RUN_DIR_ARGUMENTS = {"run_dir": "RUN", "new_run": "NEW_RUN", "run_a": "RUN_A", "run_b": "RUN_B"}
# fsspec protocol -> the rewind extra that installs its backend (pyproject.toml).
EXTRAS = {"s3": "s3", "s3a": "s3", "gcs": "gcs", "gs": "gcs"}
TRANSIENT_PROTOCOLS = frozenset({"memory"})


def check_run_dirs(args: argparse.Namespace) -> None:
    """Check every run directory among a command's arguments (see `check_run_dir`)."""
    for attribute, label in RUN_DIR_ARGUMENTS.items():
        value = getattr(args, attribute, None)
        if isinstance(value, str):
            if attribute == "run_dir" and getattr(args, "command", None) == "train":
                label = "--run-dir"
            check_run_dir(value, label)


def check_run_dir(value: str, label: str = "RUN") -> None:
    """UsageError for an empty path, and for a URL whose protocol is unknown, whose backend is not
    installed, or which keeps nothing past this process (`memory://`)."""
    if not value.strip():
        raise UsageError(f"{label} {value!r}: an empty path; name the run directory (. for the current one)")
    if "://" not in value and "::" not in value:
        return
    # Imported here: `rewind schedule` and friends never pay for fsspec.
    import fsspec
    from fsspec.core import split_protocol

    links = value.split("::")  # chained URLs: "simplecache::s3://bucket/run"
    if len(links) > 1:
        # A chain is protocol names, then a URL. fsspec reads any "a::b" as a chain while the engine would
        # take it for a path, so a run there would be split between two directories: refused.
        *outer, last = links
        if "://" not in last or any(not link or "/" in link or ":" in link for link in outer):
            raise UsageError(
                f"{label} {value!r}: '::' chains fsspec URLs (simplecache::s3://bucket/run); a local path "
                "must not contain it"
            )
        protocols = [*outer, split_protocol(last)[0]]
    else:
        protocols = [split_protocol(value)[0]]
    for protocol in protocols:
        if protocol is None:
            continue
        if protocol in TRANSIENT_PROTOCOLS:
            raise UsageError(
                f"{value}: {protocol}:// keeps nothing once this process exits, so a run there is lost "
                "and a new command finds none; use a local directory or a persistent fsspec URL"
            )
        try:
            fsspec.get_filesystem_class(protocol)
        except ImportError as exc:
            extra = EXTRAS.get(protocol)
            hint = f"pip install 'rewind[{extra}]'" if extra else "install the fsspec backend for it"
            raise UsageError(f"{value}: {protocol}:// needs a package that is not installed ({exc}); {hint}") from None
        except ValueError:
            raise UsageError(
                f"{value}: unknown protocol {protocol!r} (a local path, or an fsspec URL such as "
                "s3://bucket/run, gcs://bucket/run or file:///path)"
            ) from None
