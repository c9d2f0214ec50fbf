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


def test_a_hold_polls_until_its_deadline_then_the_loop_sleeps(loop: asyncio.AbstractEventLoop) -> None:
    timeouts = _record_selects(loop)
    p = poll.poller(loop)

    async def go() -> tuple[bool, bool]:
        p.hold("a", 0.03)
        await asyncio.sleep(0.01)
        during = p.polling
        await asyncio.sleep(0.05)  # past the deadline
        return during, p.polling

    during, after = loop.run_until_complete(go())
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
    p = poll.poller(loop)

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
    p = poll.poller(loop)

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
    p = poll.poller(loop)
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
