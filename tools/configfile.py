"""Reading a config file from disk (states/ is pure, so the I/O lives here)."""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path

from rewind.states.config import Config, ConfigError
from rewind.states.config_reading import loads_config
from rewind.tools.errors import UsageError

# Configs are a few kilobytes; a file far past this is a wrong path (a dataset, a log), and reading
# it whole would only waste memory before the TOML parser refuses it.
MAX_CONFIG_BYTES = 1 << 20


SET_HELP = (
    "change one config field, repeatable (later ones win): PATH is dotted keys with [i] for a list "
    "entry, as the config's error messages print them (training.fade.overlap=0.2, stages[1].tokens=50000, "
    "stages[0].datasets[1].name=sort, stages[2].beta=0.1; a flat list such as training.tokens=[...] rewrites "
    "the stages' budgets); VALUE is parsed as a TOML value "
    "(16, 1e-3, [1, 2], \"text\"; a bare word is taken as a string)"
)


def add_set_option(parser: argparse.ArgumentParser) -> None:
    """The `--set PATH=VALUE` option, with the same help wherever it is accepted."""
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE", help=SET_HELP)


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load and validate a TOML config; raises ConfigError (all problems) or UsageError (no file)."""
    file = Path(path)
    text = read_config_text(file, str(path))
    config = loads_config(text, source=str(path), overrides=overrides)
    return resolve_data_paths(config, file.parent)


def read_config_text(file: Path, shown: str, kind: str = "TOML") -> str:
    """The file's text, refusing anything but a regular file of at most MAX_CONFIG_BYTES. The file is
    opened without blocking and checked through its descriptor, so a FIFO (whose open would wait for a
    writer) or a device such as /dev/zero (which never ends) is refused, never read, and a file
    swapped for one between a check and the read cannot slip through."""
    try:
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise UsageError(f"{shown}: no such config file") from None
    except IsADirectoryError:
        raise UsageError(f"{shown}: is a directory, expected a {kind} config file") from None
    except OSError as exc:
        raise UsageError(f"{shown}: cannot open config ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise UsageError(f"{shown}: is a directory, expected a {kind} config file")
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{shown}: not a regular file ({_kind(info.st_mode)}), expected a {kind} config file")
        if info.st_size > MAX_CONFIG_BYTES:
            raise UsageError(
                f"{shown}: {info.st_size:,} bytes is too large for a config file (at most {MAX_CONFIG_BYTES:,})"
            )
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as handle:
            # One byte past the limit: a file that grew since fstat is caught without reading it all.
            data = handle.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{shown}: cannot read config ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_CONFIG_BYTES:
        raise UsageError(f"{shown}: grew past {MAX_CONFIG_BYTES:,} bytes while it was read, too large for a config file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{shown}: not UTF-8 text (byte {exc.start}), expected a {kind} config file") from None


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a plain file"


def resolve_data_paths(config: Config, base: Path) -> Config:
    """Relative paths to data, a tokenizer or pretrained weights are relative to the config file, not to
    the current directory. URLs, absolute paths and `{stdlib}` paths stay as they are."""
    import msgspec

    from rewind.states.check_data import STDLIB_PLACEHOLDER

    def resolved(path: str) -> str:
        if not path or "://" in path or path.startswith(STDLIB_PLACEHOLDER) or Path(path).expanduser().is_absolute():
            return path
        return str((base / path).resolve())

    data = {
        name: msgspec.structs.replace(src, path=resolved(src.path), validation_path=resolved(src.validation_path))
        for name, src in config.data.items()
    }
    return msgspec.structs.replace(
        config,
        data=data,
        tokenizer=msgspec.structs.replace(config.tokenizer, path=resolved(config.tokenizer.path)),
        pretrained=msgspec.structs.replace(config.pretrained, path=resolved(config.pretrained.path)),
    )


__all__ = ["MAX_CONFIG_BYTES", "SET_HELP", "ConfigError", "add_set_option", "load_config"]
