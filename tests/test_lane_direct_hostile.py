"""Direct channels on the lane port under attack: real QUIC + TLS over TCP on loopback.

- a stranger (another loopback source address, 127.0.0.2) that keeps every slot it can get with the
  magic and then silence, slow bytes, or a half magic, does not keep a member from opening a direct
  channel meanwhile (before: four such connections held all of ``LANE_DIRECT_MAX_PENDING`` and the
  member's dial was refused);
- a member cannot take every direct channel a node serves (``LANE_DIRECT_MAX_CHANNELS_PER_PEER``);
- a member's message with a length prefix over the limit closes only its channel, and the node keeps
  serving (a new channel works).
"""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from typing import Any

import pytest
from test_lane_direct import _echo_handler
from test_transport_lane import pair, wait_for

from transport import lane_direct, limits
from transport.errors import TransportError
from transport.lane_conn import LaneConfig

SERVICE = lane_direct.SERVICE_PIPELINE


def _stranger_source_available() -> bool:
    try:
        s = socket.socket()
        s.bind(("127.0.0.2", 0))
        s.close()
        return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _stranger_source_available(), reason="127.0.0.2 is not on loopback here")


class _Holder:
    """A stranger from 127.0.0.2 keeping ``n`` connections open on the lane port: each sends ``opening``
    (then trickles ``trickle`` one byte at a time, if given) and is replaced as soon as the node drops it."""

    def __init__(self, addr: tuple[str, int], n: int, opening: bytes, trickle: bytes = b"") -> None:
        self.addr, self.n, self.opening, self.trickle = addr, n, opening, trickle
        self.stop = threading.Event()
        self.opened = 0
        self.threads = [threading.Thread(target=self._hold, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _hold(self) -> None:
        while not self.stop.is_set():
            s = socket.socket()
            try:
                s.bind(("127.0.0.2", 0))
                s.connect(self.addr)
                self.opened += 1
                s.sendall(self.opening)
                s.settimeout(0.05)
                sent = 0
                while not self.stop.is_set():
                    if sent < len(self.trickle):
                        s.sendall(self.trickle[sent : sent + 1])
                        sent += 1
                    try:
                        if s.recv(4096) == b"":
                            break  # dropped by the node: take another slot
                    except TimeoutError:
                        continue
            except OSError:
                time.sleep(0.01)
            finally:
                s.close()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)


@pytest.mark.parametrize(
    ("opening", "trickle"),
    [
        (lane_direct.magic(SERVICE), b""),  # the magic, then silence
        (lane_direct.magic(SERVICE), b"\x16\x03\x01\x02\x00" + b"\x01" * 400),  # a TLS hello, byte by byte
        (lane_direct.DIRECT_MAGIC[:5], b""),  # half a magic, then silence
    ],
    ids=["silent", "slow-bytes", "half-magic"],
)
def test_a_stranger_holding_slots_does_not_keep_a_member_out(opening: bytes, trickle: bytes) -> None:
    async def main() -> None:
        # a long auth deadline makes the stranger's hold last the whole test (the caps, not the deadline,
        # must keep the member's way open)
        async with pair(config=LaneConfig(auth_timeout_s=5.0)) as p:
            await wait_for(lambda: p.peer_of_b.path == "lane")
            served: list[str] = []
            p.lb.direct_handlers[SERVICE] = _echo_handler(served)
            assert p.lb.address is not None
            holder = _Holder(p.lb.address, 2 * limits.LANE_DIRECT_MAX_PENDING, opening, trickle)
            try:
                await wait_for(lambda: holder.opened >= 2 * limits.LANE_DIRECT_MAX_PENDING, 5.0)
                await asyncio.sleep(0.3)  # the node has sniffed (and capped) them
                ch = await p.la.dial_direct(p.peer_of_b, SERVICE)

                def use() -> bytes | None:
                    ch.send(b"member", 5.0)
                    return ch.recv(5.0)

                assert await asyncio.to_thread(use) == b"member"
                assert served == [p.a.identity.node_id]
                ch.close()
            finally:
                await asyncio.to_thread(holder.close)
            stats = p.lb.stats
            if opening == lane_direct.magic(SERVICE):
                assert stats.get("direct_refused_source_cap", 0) >= 1, stats
            assert p.lb.lane_count() == 1

    asyncio.run(main())


def test_one_member_cannot_take_every_direct_channel() -> None:
    async def main() -> None:
        async with pair() as p:
            await wait_for(lambda: p.peer_of_b.path == "lane")
            p.lb.direct_handlers[SERVICE] = _echo_handler([])
            cap = limits.LANE_DIRECT_MAX_CHANNELS_PER_PEER
            assert cap < limits.LANE_DIRECT_MAX_CHANNELS
            channels = [await p.la.dial_direct(p.peer_of_b, SERVICE) for _ in range(cap)]
            with pytest.raises(TransportError, match="too many direct channels from this member"):
                await p.la.dial_direct(p.peer_of_b, SERVICE)
            channels.pop().close()
            await wait_for(lambda: p.lb.status()["direct_channels"] == cap - 1, 5.0)
            channels.append(await p.la.dial_direct(p.peer_of_b, SERVICE))  # a slot freed is a slot again
            for ch in channels:
                ch.close()

    asyncio.run(main())


def test_a_members_oversized_length_prefix_closes_only_its_channel() -> None:
    async def main() -> None:
        async with pair() as p:
            await wait_for(lambda: p.peer_of_b.path == "lane")
            ended: list[str] = []

            def handler(peer: Any, ch: lane_direct.DirectChannel) -> None:
                try:
                    while (msg := ch.recv(5.0)) is not None:
                        ch.send(msg)
                except TransportError as e:
                    ended.append(str(e))

            p.lb.direct_handlers[SERVICE] = handler
            ch = await p.la.dial_direct(p.peer_of_b, SERVICE)

            def hostile() -> bytes:
                ch._sock.sendall(struct.pack(">I", 0xFFFFFFF0))  # 4 GiB announced: nothing is buffered
                ch._sock.settimeout(5.0)
                return ch._sock.recv(10)

            assert await asyncio.to_thread(hostile) == b""  # the node closed it
            await wait_for(lambda: bool(ended), 5.0)
            assert "direct message of 4294967280 bytes" in ended[0]
            ch2 = await p.la.dial_direct(p.peer_of_b, SERVICE)

            def use() -> bytes | None:
                ch2.send(b"again", 5.0)
                return ch2.recv(5.0)

            assert await asyncio.to_thread(use) == b"again"
            ch2.close()

    asyncio.run(main())
