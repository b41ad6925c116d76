"""Errors the `rewind` command turns into one clear line and an exit code (never a traceback)."""

from __future__ import annotations


class CommandError(Exception):
    """A problem the user can fix. exit_code 2 = usage or config; 1 = the run/data is not as expected."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class UsageError(CommandError):
    def __init__(self, message: str):
        super().__init__(message, exit_code=2)
