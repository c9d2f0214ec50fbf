"""transport.poll: a hold keeps a real asyncio loop polling (zero-timeout selects) until its deadline or its
release, and the loop sleeps again after."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from transport import poll


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def _record_selects(loop: asyncio.AbstractEventLoop) -> list[float | None]:
    """The timeouts the loop passes to its selector from now on."""
    timeouts: list[float | None] = []
    selector: Any = loop._selector  # type: ignore[attr-defined]
    real = selector.select

    def select(timeout: float | None = None) -> Any:
        timeouts.append(timeout)
        return real(timeout)

    selector.select = select
    return timeouts


def _unyielding(loop: asyncio.AbstractEventLoop) -> poll.Poller:
    """A poller that never sees itself descheduled (CPU time counted as wall time). On a loaded machine a real
    poll is preempted within milliseconds and rightly yields (holds dropped, new ones refused for 50 ms),
    which is the yield tests' subject: the tests of holds and releases use this one."""
    return poll.Poller(loop, cpu_clock=time.perf_counter)


def test_a_hold_polls_until_its_deadline_then_the_loop_sleeps(loop: asyncio.AbstractEventLoop) -> None:
    timeouts = _record_selects(loop)
    p = _unyielding(loop)

    async def go() -> tuple[bool, bool, float]:
        t0 = time.perf_counter()
        p.hold("a", 0.2)  # a margin for the 10 ms sleep on a loaded machine (a 30 ms hold failed there)
        await asyncio.sleep(0.01)
        during, looked = p.polling, time.perf_counter() - t0
        await asyncio.sleep(0.25)  # past the deadline
        return during, p.polling, looked

    during, after, looked = loop.run_until_complete(go())
    assert looked < 0.2, looked  # else the check below would be moot

    assert during and not after
    # polled: many iterations with a zero timeout while asyncio.sleep waited, then slept until its timer
    slept = [i for i, t in enumerate(timeouts) if t is not None and t > 0.005]
    assert slept and sum(1 for t in timeouts[:slept[0]] if t == 0) >= 20
    assert p.ticks >= 20 and not p._ticking


def test_without_a_hold_the_loop_does_not_poll(loop: asyncio.AbstractEventLoop) -> None:
    timeouts = _record_selects(loop)
    p = poll.poller(loop)
    p.hold("zero", 0)  # a zero-length hold is no hold
    loop.run_until_complete(asyncio.sleep(0.03))
    assert sum(1 for t in timeouts if t == 0) <= 3 and p.ticks == 0


def test_release_ends_a_hold_and_the_loop_polls_while_any_hold_is_live(loop: asyncio.AbstractEventLoop) -> None:
    p = _unyielding(loop)

    async def go() -> list[bool]:
        seen = []
        p.hold("a", 5.0)
        p.hold("b", 5.0)
        await asyncio.sleep(0.005)
        p.release("a")
        await asyncio.sleep(0.005)
        seen.append(p.polling)  # b still holds
        p.release("b")
        p.release("never held")
        await asyncio.sleep(0.005)
        seen.append(p.polling)
        ticks = p.ticks
        await asyncio.sleep(0.02)
        seen.append(p.ticks == ticks)  # no tick after the last release
        return seen

    t0 = time.perf_counter()
    assert loop.run_until_complete(go()) == [True, False, True]
    assert time.perf_counter() - t0 < 1.0  # released long before the 5 s deadlines


def test_a_second_hold_of_a_key_replaces_its_deadline(loop: asyncio.AbstractEventLoop) -> None:
    p = _unyielding(loop)

    async def go() -> tuple[bool, bool]:
        p.hold("k", 5.0)
        p.hold("k", 0.01)
        await asyncio.sleep(0.03)
        short = p.polling
        p.hold("k", 0.01)
        p.hold("k", 5.0)
        await asyncio.sleep(0.03)
        long = p.polling
        p.release("k")
        return short, long

    assert loop.run_until_complete(go()) == (False, True)


def test_a_packet_is_taken_while_polling(loop: asyncio.AbstractEventLoop) -> None:
    """Polling changes when the loop looks, not what it sees: a datagram sent during a hold is read."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.setblocking(False)
    b.setblocking(False)
    got: list[bytes] = []
    p = _unyielding(loop)
    try:
        loop.add_reader(b.fileno(), lambda: got.append(b.recv(64)))

        async def go() -> None:
            p.hold("reply", 1.0)
            loop.call_later(0.01, a.send, b"reply")
            while not got:
                await asyncio.sleep(0)
            p.release("reply")

        loop.run_until_complete(asyncio.wait_for(go(), 5))
        assert got == [b"reply"] and p.ticks > 0
    finally:
        loop.remove_reader(b.fileno())
        a.close()
        b.close()


def test_one_poller_per_loop(loop: asyncio.AbstractEventLoop) -> None:
    other = asyncio.new_event_loop()
    try:
        assert poll.poller(loop) is poll.poller(loop)
        assert poll.poller(loop) is not poll.poller(other)

        async def running() -> poll.Poller:
            return poll.poller()

        assert loop.run_until_complete(running()) is poll.poller(loop)
    finally:
        other.close()


def test_one_poller_per_loop_when_threads_ask_at_once(loop: asyncio.AbstractEventLoop,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    init = poll.Poller.__init__

    def slow_init(self: poll.Poller, lp: asyncio.AbstractEventLoop) -> None:
        time.sleep(0.02)  # widens the window in which another thread could make a second one
        init(self, lp)

    monkeypatch.setattr(poll.Poller, "__init__", slow_init)
    got: list[poll.Poller] = []
    start = threading.Barrier(8)

    def ask() -> None:
        start.wait()
        got.append(poll.poller(loop))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(p is got[0] for p in got)


class _Clocks:
    """Wall and thread-CPU clocks a test moves by hand."""

    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 5.0

    def run(self, seconds: float, on_cpu: bool = True) -> None:
        self.wall += seconds
        if on_cpu:
            self.cpu += seconds


def test_a_poll_descheduled_by_the_kernel_yields_the_core_and_backs_off(loop: asyncio.AbstractEventLoop) -> None:
    c = _Clocks()
    p = poll.Poller(loop, clock=lambda: c.wall, cpu_clock=lambda: c.cpu)
    p.hold("a", 0.5)
    p.hold("b", 0.5)
    c.run(0.0001)
    p._tick()
    assert p.polling and p.yielded == 0  # on the CPU the whole time: polls on
    c.run(0.0003, on_cpu=False)  # a blip (a page fault, the host): under PREEMPTED_S
    p._tick()
    assert p.polling and p.yielded == 0
    c.run(0.001, on_cpu=False)  # a time slice given to another thread: could be a kernel thread passing by
    p._tick()
    assert p.polling and p.preempted == 1
    c.run(poll.STRIKE_WINDOW_S + 0.001)  # long enough ago not to count with the next ones
    p._tick()
    for i in range(poll.STRIKES):  # busy enough to preempt every time slice
        assert p.polling and p.yielded == 0, i
        c.run(0.001, on_cpu=False)
        p._tick()
    assert not p.polling and p.yielded == 1 and not p._ticking and p.preempted == 1 + poll.STRIKES
    assert p.hold("c", 0.01) is False and not p.polling  # backing off: the core was wanted
    c.run(poll.BACKOFF_MIN_S)
    assert p.hold("c", 0.01) is True and p.polling  # and it polls again afterwards
    loop.run_until_complete(asyncio.sleep(0))  # the tick that hold scheduled (the wall clock stands still)
    assert p.polling and p.yielded == 1


def _pause_after_yield(p: poll.Poller, c: _Clocks, after: float) -> float:
    """Resume ``after`` seconds past the last pause, get preempted at once: how long polling now pauses."""
    c.run(after)
    p.hold("k", 0.01)
    for _ in range(poll.STRIKES):
        assert p.polling
        c.run(0.002, on_cpu=False)
        p._tick()
    assert not p.polling
    paused = 0.0
    while True:
        p.hold("k", 0.01)
        if p.polling:
            p.release("k")
            return round(paused, 3)
        c.run(0.01)
        paused += 0.01


def test_the_pause_doubles_while_the_core_stays_busy_and_resets_once_it_is_free(
        loop: asyncio.AbstractEventLoop) -> None:
    c = _Clocks()
    p = poll.Poller(loop, clock=lambda: c.wall, cpu_clock=lambda: c.cpu)
    pauses = [_pause_after_yield(p, c, 0.0) for _ in range(8)]  # preempted each time it resumes
    assert pauses == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert _pause_after_yield(p, c, 10.0) == poll.BACKOFF_MIN_S  # a free core for a while: short again
    assert p.yielded == 9


def test_long_and_nan_holds_are_bounded(loop: asyncio.AbstractEventLoop) -> None:
    c = _Clocks()
    p = poll.Poller(loop, clock=lambda: c.wall, cpu_clock=lambda: c.cpu)
    p.hold("nan", float("nan"))
    p.hold("neg", -1.0)
    assert not p.polling
    p.hold("inf", float("inf"))
    c.run(poll.MAX_HOLD_S - 0.01)
    p._tick()
    assert p.polling
    c.run(0.02)
    p._tick()
    assert not p.polling


def test_a_real_competing_thread_on_the_same_core_makes_the_poll_yield(loop: asyncio.AbstractEventLoop) -> None:
    """A busy process pinned to this thread's CPU: the scheduler shares the core, and the poll gives it up
    within a few time slices instead of polling out its whole hold."""
    import os
    import subprocess
    import sys

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs sched_setaffinity")
    mine = os.sched_getaffinity(0)
    cpu = min(mine)
    busy = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
    try:
        time.sleep(0.2)  # it is spinning on that CPU
        os.sched_setaffinity(0, {cpu})
        p = poll.poller(loop)

        async def go() -> float:
            t0 = time.perf_counter()
            p.hold("reply", 0.9)
            while p.polling and time.perf_counter() - t0 < 5:
                await asyncio.sleep(0.001)
            return time.perf_counter() - t0

        took = loop.run_until_complete(go())
        assert p.yielded >= 1 and took < 0.5, (p.yielded, took)
    finally:
        os.sched_setaffinity(0, mine)
        busy.kill()
        busy.wait()


def test_a_poller_does_not_keep_its_loop_alive() -> None:
    import gc
    import weakref

    lp = asyncio.new_event_loop()
    p = poll.poller(lp)
    p.hold("k", 0.5)  # even with a hold left over
    ref = weakref.ref(lp)
    lp.close()
    del lp
    gc.collect()
    assert ref() is None
    p.hold("k2", 0.5)  # the loop is gone: nothing to poll, and no error
    assert not p._ticking
