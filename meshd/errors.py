"""Errors that end a command with a one-line message and a SPEC exit code."""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2


class MeshdError(Exception):
    """A failure to report as one readable line (no traceback). ``exit_code`` is the process exit code."""

    exit_code = EXIT_RUNTIME


class UsageError(MeshdError):
    """Bad flags, config, or a request the user can fix: exit 2."""

    exit_code = EXIT_USAGE


class RuntimeFailure(MeshdError):
    """Something went wrong at run time (peer unreachable, bind failed): exit 1."""

    exit_code = EXIT_RUNTIME
