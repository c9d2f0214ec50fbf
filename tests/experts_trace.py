"""Timestamps where a delegated layer's request and reply pass, for bench/experts_timeline.py.

``install(recorder)`` wraps, in this process: the coordinator's ``RemoteExecutor._fast_dispatch`` and
``_fast_reply``, the worker's ``compute_request``, aioquic's ``QuicConnection.receive_datagram`` and
``datagrams_to_send``, and asyncio's datagram transport ``sendto`` (on the call and on its return). Each
wrapper appends ``(time.perf_counter(), tag, bytes)`` to the recorder. ``perf_counter`` is CLOCK_MONOTONIC,
one clock for every process on the machine, so a coordinator's and a worker's timestamps line up.
Diagnostics only: each point costs about a microsecond, and ``uninstall()`` puts the originals back.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

Event = tuple[float, str, int]

_saved: list[tuple[Any, str, Any]] = []


class Recorder:
    """The events of one process, newest ``limit`` kept; ``on`` switches recording."""

    def __init__(self, limit: int = 1_000_000) -> None:
        self.events: deque[Event] = deque(maxlen=limit)
        self.on = True

    def __call__(self, tag: str, size: int = 0) -> None:
        if self.on:
            self.events.append((time.perf_counter(), tag, size))


def _wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    original = getattr(owner, name)
    _saved.append((owner, name, original))
    setattr(owner, name, make(original))


def install(rec: Recorder) -> None:
    """Wrap the trace points (once per process)."""
    import asyncio.selector_events as selector_events

    from aioquic.quic.connection import QuicConnection

    import engine.experts.coordinator as coordinator
    import engine.experts.worker as worker

    if _saved:
        raise RuntimeError("trace points already installed")

    def receive(original: Any) -> Any:
        def receive_datagram(self: Any, data: bytes, addr: Any, now: float) -> None:
            rec("in0", len(data))
            try:
                original(self, data, addr, now)
            finally:
                rec("in1", len(data))
        return receive_datagram

    def pack(original: Any) -> Any:
        def datagrams_to_send(self: Any, now: float) -> Any:
            rec("out0")
            out = original(self, now)
            rec("out1", sum(len(d) for d, _ in out))
            return out
        return datagrams_to_send

    def send(original: Any) -> Any:
        def sendto(self: Any, data: Any, addr: Any = None) -> None:
            # both ends: the receiver can have the datagram before sendto returns (the sender is often
            # preempted by the receiver it woke), so a packet's hop is timed from the call, "s0"
            rec("s0", len(data))
            original(self, data, addr)
            rec("s1", len(data))
        return sendto

    def compute(original: Any) -> Any:
        def compute_request(*args: Any, **kwargs: Any) -> Any:
            rec("c0")
            try:
                return original(*args, **kwargs)
            finally:
                rec("c1")
        return compute_request

    def mark(tag: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def marked(*args: Any, **kwargs: Any) -> Any:
                rec(tag)
                return original(*args, **kwargs)
            return marked
        return make

    _wrap(QuicConnection, "receive_datagram", receive)
    _wrap(QuicConnection, "datagrams_to_send", pack)
    _wrap(selector_events._SelectorDatagramTransport, "sendto", send)
    _wrap(worker, "compute_request", compute)
    _wrap(coordinator.RemoteExecutor, "_fast_dispatch", mark("dispatch"))
    _wrap(coordinator.RemoteExecutor, "_fast_reply", mark("reply"))


def uninstall() -> None:
    while _saved:
        owner, name, original = _saved.pop()
        setattr(owner, name, original)
