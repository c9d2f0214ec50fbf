"""Busy-polling an asyncio loop for a short while, for latency (spin, then park).

An idle asyncio loop sleeps in ``epoll_wait``. The packet that ends the wait has to wake it: on a virtual
machine that is an interrupt to a halted vCPU, and the code and data the loop touches next come back cold.
When a reply or the next request is due within a millisecond or two, polling for it instead (the loop
keeps one callback ready, so it calls ``epoll_wait`` with a zero timeout) takes the packet as soon as the
kernel has it. The price is a core kept busy meanwhile, so callers poll only when they expect a message
soon, for a bounded time, and only when a core is free for it (the caller's policy).

The poller is also polite on its own: while it polls the loop thread never blocks, so wall time between
two polls that this thread did not spend on a CPU means the scheduler gave its core to another thread
(another process of this machine, a worker, a guest on the same host). One such gap can be a kernel thread
passing by; ``STRIKES`` of them within ``STRIKE_WINDOW_S`` mean the core is wanted. Then it stops polling
at once and refuses holds for a while: a core that someone else needs is not free, whatever the policy
said. The pause starts at ``BACKOFF_MIN_S`` and doubles up to ``BACKOFF_MAX_S`` while polling keeps being
preempted as soon as it resumes (a core that is never free, e.g. more busy processes than cores, costs a
few preempted polls every two seconds, not every few ms).

A :class:`Poller` is per loop (:func:`poller`) and shared by everything on it: each caller holds it under
its own key until a deadline, or until it releases the key (its message arrived). The loop polls while any
hold is live, and sleeps as before once none is. Loop thread only.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable

MAX_HOLD_S = 1.0  # the longest hold (longer ones are cut to it): polling is for waits of a few ms
PREEMPTED_S = 0.0005  # off-CPU time between two polls that means the core was wanted: a scheduler time
#   slice given to another thread is ~1 ms or more; a page fault or a host blip is well under this
STRIKES = 3  # preempted polls within STRIKE_WINDOW_S that make it yield...
STRIKE_WINDOW_S = 0.1  # ...(a competing busy thread preempts every time slice, a few ms apart)
BACKOFF_MIN_S = 0.05  # after yielding the core, no polling for this long at first...
BACKOFF_MAX_S = 2.0  # ...doubling up to this while yields keep coming right after each pause

_POLLERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Poller] = weakref.WeakKeyDictionary()
_POLLERS_LOCK = threading.Lock()  # poller() may be called from any thread (an executor made off its loop)


class Poller:
    """Keeps one loop polling while any hold is live (see the module docstring).

    ``clock`` / ``cpu_clock`` (wall time, and the loop thread's CPU time) are for tests."""

    def __init__(self, loop: asyncio.AbstractEventLoop, clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        self._loop = weakref.ref(loop)  # the poller must not keep a closed loop alive (_POLLERS is weak)
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._holds: dict[object, float] = {}  # key -> deadline (clock())
        self._ticking = False
        self._last = (0.0, 0.0)  # (clock, cpu_clock) at the last poll
        self._backoff_until = 0.0
        self._backoff = BACKOFF_MIN_S  # the current pause after a yield
        self._last_yield = float("-inf")
        self._strikes = 0  # preempted polls since _strikes_since
        self._strikes_since = float("-inf")
        self.preempted = 0  # polls that found they had been descheduled (tests, telemetry)
        self.ticks = 0  # loop iterations spent polling (tests, telemetry)
        self.yielded = 0  # times polling stopped because another thread needed the core

    @property
    def polling(self) -> bool:
        return bool(self._holds)

    def hold(self, key: object, seconds: float) -> bool:
        """Poll until ``seconds`` from now (at most ``MAX_HOLD_S``), or until ``release(key)``; a second
        hold of a key replaces it. Whether it holds: not for ``seconds`` <= 0 (or NaN), nor while backing
        off after a yield."""
        if not seconds > 0:
            return False
        now = self._clock()
        if now < self._backoff_until:
            return False
        loop = self._loop()
        if loop is None or loop.is_closed():  # nothing left to poll (a tick it scheduled will never run)
            self._holds.clear()
            self._ticking = False
            return False
        self._holds[key] = now + min(seconds, MAX_HOLD_S)
        if not self._ticking:
            self._ticking = True
            self._last = (now, self._cpu_clock())
            loop.call_soon(self._tick)
        return True

    def _strike(self, now: float) -> bool:
        """A poll that had been descheduled: whether it is the ``STRIKES``-th within the window."""
        self.preempted += 1
        if now - self._strikes_since > STRIKE_WINDOW_S:
            self._strikes, self._strikes_since = 0, now
        self._strikes += 1
        if self._strikes < STRIKES:
            return False
        self._strikes, self._strikes_since = 0, float("-inf")
        return True

    def _yield(self, now: float) -> None:
        """Pause polling: twice as long as last time if that pause ended only just before this yield."""
        soon = now - self._last_yield < 2 * self._backoff + BACKOFF_MIN_S
        self._backoff = min(self._backoff * 2, BACKOFF_MAX_S) if soon else BACKOFF_MIN_S
        self._last_yield = now
        self._backoff_until = now + self._backoff
        self.yielded += 1

    def release(self, key: object) -> None:
        """End ``key``'s hold (no-op without one). The loop sleeps again once no hold is left."""
        self._holds.pop(key, None)

    def _tick(self) -> None:
        holds = self._holds
        if holds:
            now, cpu = self._clock(), self._cpu_clock()
            (last, last_cpu), self._last = self._last, (now, cpu)
            if (now - last) - (cpu - last_cpu) > PREEMPTED_S and self._strike(now):  # the core is wanted
                holds.clear()
                self._yield(now)
            elif len(holds) == 1:  # the usual case: one caller
                key, deadline = next(iter(holds.items()))
                if now >= deadline:
                    del holds[key]
            else:
                for key in [k for k, d in holds.items() if now >= d]:
                    del holds[key]
        loop = self._loop()
        if holds and loop is not None:
            self.ticks += 1
            loop.call_soon(self._tick)  # a ready callback: the loop's next select does not block
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
