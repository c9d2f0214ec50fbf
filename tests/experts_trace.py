"""Timestamps where a delegated layer's request and reply pass, for bench/experts_timeline.py.

``install(recorder)`` wraps, in this process: the coordinator's ``RemoteExecutor._fast_dispatch`` and
``_fast_reply``, the loop-driven pass's ``_step_resume`` and ``Model.warm``, the worker's ``compute_request`` and ``WorkerPlan.compute``;
for QUIC aioquic's ``QuicConnection.receive_datagram`` and ``datagrams_to_send``, and asyncio's datagram
transport ``sendto`` (on the call and on its return); for the data lane the message handed to the lane
(``LaneConnection._send``, "out0"), the TLS records' socket write (asyncio's socket transport ``write``:
"out1" and "s0" at the call, "s1" at its return), the ciphertext's arrival (``SSLProtocol.buffer_updated``,
"in0") and the plaintext's (``LaneConnection.data_received``, "in1"). Each wrapper appends ``(time.perf_counter(), tag, bytes)`` to the recorder. ``perf_counter`` is CLOCK_MONOTONIC,
one clock for every process on the machine, so a coordinator's and a worker's timestamps line up.
Diagnostics only: each point costs about a microsecond, and ``uninstall()`` puts the originals back.
"""

from __future__ import annotations

import os
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

    import asyncio.sslproto as sslproto

    import engine.experts.coordinator as coordinator
    import engine.experts.passes as passes
    import engine.experts.rpc as rpc_mod
    import engine.experts.worker as worker
    from engine.model import Model
    from transport.lane_conn import LaneConnection

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

    def sock_write(original: Any) -> Any:
        def write(self: Any, data: Any) -> None:
            n = len(data)
            rec("out1", n)
            rec("s0", n)
            original(self, data)
            rec("s1", n)
        return write

    def lane_send(original: Any) -> Any:
        def _send(self: Any, stream_id: int, parts: Any, end: bool) -> None:
            rec("out0")
            original(self, stream_id, parts, end)
        return _send

    def tls_in(original: Any) -> Any:
        def buffer_updated(self: Any, nbytes: int) -> None:
            rec("in0", nbytes)
            original(self, nbytes)
        return buffer_updated

    def lane_in(original: Any) -> Any:
        def data_received(self: Any, data: bytes) -> None:
            rec("in1", len(data))
            original(self, data)
        return data_received

    def mark_layer(tag: str) -> Callable[[Any], Any]:  # (self, call, ...): recorded with the call's layer
        def make(original: Any) -> Any:
            def marked(self: Any, call: Any, *args: Any) -> Any:
                rec(tag, call.layer)
                return original(self, call, *args)
            return marked
        return make

    def around(tag: str) -> Callable[[Any], Any]:
        def make(original: Any) -> Any:
            def timed(*args: Any, **kwargs: Any) -> Any:
                rec(tag + "0")
                try:
                    return original(*args, **kwargs)
                finally:
                    rec(tag + "1")
            return timed
        return make

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
    _wrap(selector_events._SelectorSocketTransport, "write", sock_write)
    _wrap(LaneConnection, "_send", lane_send)
    _wrap(sslproto.SSLProtocol, "buffer_updated", tls_in)
    _wrap(LaneConnection, "data_received", lane_in)
    _wrap(worker, "compute_request", compute)
    from engine.experts.worker_plan import WorkerPlan

    _wrap(WorkerPlan, "compute", compute)  # a one-token request on prebuilt rows (compute_request otherwise)
    _wrap(Model, "warm", around("warm"))
    _wrap(coordinator.RemoteExecutor, "_step_resume", mark("resume"))
    _wrap(coordinator.RemoteExecutor, "_wait_for_loop", around("wait"))  # the engine thread's hand-off
    _wrap(passes._LoopStep, "finish", mark("finish"))  # the pass ends on the loop
    if os.environ.get("EXPERTS_TRACE_FINE"):  # where our own Python's time goes between the points above
        import selectors

        _wrap(selectors.EpollSelector, "select", around("sel"))
        _wrap(coordinator.RemoteExecutor, "_step_layer", mark("steplayer"))
        _wrap(coordinator.RemoteExecutor, "_assemble", lambda f: staticmethod(around("assemble")(f)))  # static
        from engine.experts.link import WorkerLink
        from engine.experts.worker import _Session
        from transport.stream import Stream

        for owner, name in ((LaneConnection, "_records"), (Stream, "deliver"), (Stream, "_deliver"),
                            (WorkerLink, "_on_data"), (_Session, "_on_data"), (_Session, "_pump"),
                            (_Session, "_request"), (rpc_mod.MessageDecoder, "feed")):
            _wrap(owner, name, mark("f:" + getattr(owner, "__name__", "") + "." + name))
    _wrap(coordinator.RemoteExecutor, "_fast_dispatch", mark_layer("dispatch"))
    _wrap(coordinator.RemoteExecutor, "_fast_reply", mark_layer("reply"))


def uninstall() -> None:
    while _saved:
        owner, name, original = _saved.pop()
        setattr(owner, name, original)
