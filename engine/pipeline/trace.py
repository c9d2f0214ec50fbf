"""Opt-in timestamps of a decode step's way across processes (``bench/pipeline_timeline.py``).

With ``MESHD_PIPELINE_TRACE=DIR`` every process appends ``tag ns`` lines to ``DIR/<pid>.trace`` at the
points a step passes (``mark``); timestamps are CLOCK_MONOTONIC, which all processes of a machine share.
Off (the default) a call site costs one global lookup: ``if trace.ON: trace.mark(...)``.
"""

from __future__ import annotations

import os
import time

_DIR = os.environ.get("MESHD_PIPELINE_TRACE", "")
ON = bool(_DIR)
_fd = -1


def mark(tag: str) -> None:
    """Record ``tag`` now (one unbuffered append, ~2 µs)."""
    global _fd
    if _fd < 0:
        _fd = os.open(os.path.join(_DIR, f"{os.getpid()}.trace"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(_fd, f"{tag} {time.monotonic_ns()}\n".encode())


def mark_at(tag: str, ns: int) -> None:
    """Record ``tag`` at ``ns`` (a ``time.monotonic_ns()`` taken earlier)."""
    global _fd
    if _fd < 0:
        _fd = os.open(os.path.join(_DIR, f"{os.getpid()}.trace"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(_fd, f"{tag} {ns}\n".encode())
