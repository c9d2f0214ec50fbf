"""Busy-polling an asyncio loop for a short while, for latency (spin, then park).

An idle asyncio loop sleeps in ``epoll_wait``. The packet that ends the wait has to wake it: on a virtual
machine that is an interrupt to a halted vCPU, and the code and data the loop touches next come back cold.
When a reply or the next request is due within a millisecond or two, polling for it instead (the loop
keeps one callback ready, so it calls ``epoll_wait`` with a zero timeout) takes the packet as soon as the
kernel has it. The price is a core kept busy meanwhile, so callers poll only when they expect a message
soon, for a bounded time, and only when a core is free for it (the caller's policy).

A :class:`Poller` is per loop (:func:`poller`) and shared by everything on it: each caller holds it under
its own key until a deadline, or until it releases the key (its message arrived). The loop polls while any
hold is live, and sleeps as before once none is. Loop thread only.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref

_POLLERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Poller] = weakref.WeakKeyDictionary()
_POLLERS_LOCK = threading.Lock()  # poller() may be called from any thread (an executor made off its loop)


class Poller:
    """Keeps one loop polling while any hold is live (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._holds: dict[object, float] = {}  # key -> deadline (time.perf_counter())
        self._ticking = False
        self.ticks = 0  # loop iterations spent polling (tests, telemetry)

    @property
    def polling(self) -> bool:
        return bool(self._holds)

    def hold(self, key: object, seconds: float) -> None:
        """Poll until ``seconds`` from now, or until ``release(key)``; a second hold of a key replaces it."""
        if seconds <= 0:
            return
        self._holds[key] = time.perf_counter() + seconds
        if not self._ticking:
            self._ticking = True
            self._loop.call_soon(self._tick)

    def release(self, key: object) -> None:
        """End ``key``'s hold (no-op without one). The loop sleeps again once no hold is left."""
        self._holds.pop(key, None)

    def _tick(self) -> None:
        holds = self._holds
        if holds:
            now = time.perf_counter()
            if len(holds) == 1:  # the usual case: one caller
                key, deadline = next(iter(holds.items()))
                if now >= deadline:
                    del holds[key]
            else:
                for key in [k for k, d in holds.items() if now >= d]:
                    del holds[key]
        if holds:
            self.ticks += 1
            self._loop.call_soon(self._tick)  # a ready callback: the loop's next select does not block
        else:
            self._ticking = False


def poller(loop: asyncio.AbstractEventLoop | None = None) -> Poller:
    """The loop's poller (the running loop's by default); any thread, but use it on the loop's."""
    loop = loop or asyncio.get_running_loop()
    with _POLLERS_LOCK:
        p = _POLLERS.get(loop)
        if p is None:
            p = _POLLERS[loop] = Poller(loop)
        return p
