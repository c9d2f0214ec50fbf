"""Opt-in timestamps of a decode step's way across processes (``bench/pipeline_timeline.py``).

With ``MESHD_PIPELINE_TRACE=DIR`` every process appends ``tag ns`` lines to ``DIR/<pid>.trace`` at the
points a step passes (``mark``); timestamps are CLOCK_MONOTONIC, which all processes of a machine share.
Off (the default) a call site costs one global lookup: ``if trace.ON: trace.mark(...)``.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

_DIR = os.environ.get("MESHD_PIPELINE_TRACE", "")
ON = bool(_DIR)
_fd = -1


def mark(tag: str) -> None:
    """Record ``tag`` now (one unbuffered append, ~1 µs)."""
    mark_at(tag, time.monotonic_ns())


def mark_at(tag: str, ns: int) -> None:
    """Record ``tag`` at ``ns`` (a ``time.monotonic_ns()`` taken earlier)."""
    global _fd
    if _fd < 0:
        path = os.path.join(_DIR, f"{os.getpid()}.trace")
        _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(_fd, f"{tag} {ns}\n".encode())


def _instrument() -> None:
    """Also mark where the lane hands bytes to TLS and back (``X.`` tags; the reader of the trace knows
    which process is which): the socket is readable (X.sock), the lane has the decrypted bytes (X.in), a
    message is handed to TLS (X.write) and the write returned (X.wrote); and every garbage collection (X.gcN
    when one of generation N starts, X.gce when it ends)."""
    from asyncio import selector_events

    from transport import lane_conn

    sock_ready = selector_events._SelectorSocketTransport._read_ready
    data_received = lane_conn.LaneConnection.data_received
    send = lane_conn.LaneConnection._send

    def _read_ready(self: Any) -> None:
        mark("X.sock")
        sock_ready(self)

    def _data_received(self: Any, data: bytes) -> None:
        mark("X.in")
        data_received(self, data)

    def _send(self: Any, stream_id: int, parts: Any, end: bool) -> None:
        mark("X.write")
        send(self, stream_id, parts, end)
        mark("X.wrote")

    def _gc(phase: str, info: dict[str, Any]) -> None:  # a garbage collection: X.gc<generation> start, X.gce end
        mark(f"X.gc{info.get('generation', 0)}" if phase == "start" else "X.gce")

    gc.callbacks.append(_gc)
    selector_events._SelectorSocketTransport._read_ready = _read_ready  # type: ignore[method-assign]
    lane_conn.LaneConnection.data_received = _data_received  # type: ignore[method-assign]
    lane_conn.LaneConnection._send = _send  # type: ignore[method-assign]


if ON:
    _instrument()
