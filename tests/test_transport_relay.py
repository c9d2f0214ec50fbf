"""Relay through a member (transport.relay), three real transports on loopback in one loop.

A and C have no working direct path at first (A's packets to C go through a UDP gate the test keeps
shut); both reach B. A learns its direct dial failed, connects through B, and talks to C over the relayed
QUIC connection (RPC, expert streams); B forwards only ciphertext; a relay that refuses is counted; once the
gate opens, A's direct retry finds the path and the peer moves to it without going down.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

from transport_peer import member_of

from transport.config import TransportConfig
from transport.credentials import create_mesh
from transport.errors import TransportError
from transport.identity import NodeIdentity
from transport.lane import LaneManager
from transport.quic import MeshTransport, Peer, Stream, StreamType
from transport.relay import RelayConfig, RelayManager


class UdpGate(asyncio.DatagramProtocol):
    """A UDP forwarder to ``target`` that drops everything while shut (a blocked path)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.open = False
        self.transport: asyncio.DatagramTransport | None = None
        self.clients: dict[tuple[str, int], asyncio.DatagramTransport] = {}

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        if not self.open:
            return
        up = self.clients.get(addr)
        if up is None:
            asyncio.ensure_future(self._new(addr, data))
        else:
            up.sendto(data)

    async def _new(self, addr: tuple[str, int], first: bytes) -> None:
        gate = self

        class Back(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, _: Any) -> None:
                if gate.open and gate.transport is not None:
                    gate.transport.sendto(data, addr)

        up, _ = await asyncio.get_running_loop().create_datagram_endpoint(Back, remote_addr=self.target)
        self.clients[addr] = up  # type: ignore[assignment]
        up.sendto(first)  # type: ignore[attr-defined]


@dataclass
class Trio:
    a: MeshTransport
    b: MeshTransport
    c: MeshTransport
    ra: RelayManager
    rb: RelayManager
    rc: RelayManager
    gate: UdpGate
    gate_addr: tuple[str, int]
    ids: dict[str, str]


async def _echo_rpc(peer: Peer, request: bytes) -> bytes:
    return b"c-says:" + request


async def _echo_stream(peer: Peer, stream: Stream) -> None:
    while (chunk := await stream.recv()) is not None:
        await stream.send(chunk)


@asynccontextmanager
async def trio(allow_relay: bool = True, lanes: bool = False) -> AsyncIterator[Trio]:
    """A, B, C; A and C connected to B. ``lanes``: every node runs a data lane, and A-B and C-B have theirs
    up before the test starts."""
    ia, ib, ic = (NodeIdentity.generate() for _ in range(3))
    creds = create_mesh(ia, "relay-test", int(time.time()), 1, 1)
    cfg = replace(TransportConfig(), handshake_timeout_s=1.0, connect_timeout_s=1.5)
    a = MeshTransport(ia, creds, cfg)
    b = MeshTransport(ib, member_of(creds, ib), cfg)
    c = MeshTransport(ic, member_of(creds, ic), cfg)
    managers = []
    relays = []
    for t in (a, b, c):
        managers.append(LaneManager(t))
        relays.append(RelayManager(t, RelayConfig(allow_relay=allow_relay or t is not b, direct_retry_s=0.5)))
        await t.listen("127.0.0.1", 0)
        if lanes:
            await managers[-1].listen("127.0.0.1", 0)
    c.on_rpc(StreamType.RPC, _echo_rpc)
    c.on_stream(StreamType.EXPERT, _echo_stream)
    addr_b = b._server._transport.get_extra_info("sockname")[:2]  # type: ignore[union-attr]
    addr_c = c._server._transport.get_extra_info("sockname")[:2]  # type: ignore[union-attr]
    gate = UdpGate(addr_c)
    loop = asyncio.get_running_loop()
    gt, _ = await loop.create_datagram_endpoint(lambda: gate, local_addr=("127.0.0.1", 0))
    gate_addr = gt.get_extra_info("sockname")[:2]
    await a.connect(addr_b, ib.node_id)
    await c.connect(addr_b, ib.node_id)
    if lanes:
        await wait_for(lambda: all((p := x.peer(ib.node_id)) is not None and p.path == "lane" for x in (a, c)))
    t = Trio(a, b, c, *relays, gate, gate_addr, {"a": ia.node_id, "b": ib.node_id, "c": ic.node_id})
    try:
        yield t
    finally:
        for m in relays + managers:
            await m.close()
        for x in (a, b, c):
            await x.close()
        gt.close()


async def wait_for(cond: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def test_members_without_a_direct_path_talk_through_a_relay_that_reads_nothing() -> None:
    async def main() -> None:
        async with trio() as t:
            seen: list[bytes] = []
            t.rb.tap = seen.append
            c_id = t.ids["c"]
            try:
                await t.a.connect(t.gate_addr, c_id)  # the gate is shut: no direct path
                raise AssertionError("the direct dial should fail")
            except TransportError:
                pass
            await wait_for(lambda: t.a.peer(c_id) is not None)
            peer = t.a.peer(c_id)
            assert peer is not None and peer.path == "relay"
            assert t.c.peer(t.ids["a"]) is not None and t.c.peer(t.ids["a"]).path == "relay"  # type: ignore[union-attr]
            secret = b"the-secret-prompt:" + bytes(range(256)) * 16
            assert await peer.request(StreamType.RPC, secret, 5.0) == b"c-says:" + secret
            s = await peer.open_stream(StreamType.EXPERT)  # expert streams over the relayed connection
            assert s.path == "relay"
            await s.send(secret)
            assert await s.recv() == secret
            await s.end()
            relayed = b"".join(seen)
            assert len(relayed) > 2 * len(secret)  # B forwarded everything...
            assert b"the-secret-prompt" not in relayed and bytes(range(64)) not in relayed  # ...unreadable
            assert t.rb.stats["relays_opened"] >= 1 and t.rb.stats["relay_bytes"] == len(relayed)
            assert t.ra.status()["relayed_peers"] == [c_id]

            # the direct path appears: A's periodic direct retry finds it and the peer moves over, still up
            downs: list[str] = []
            t.a.on_peer_down.append(lambda p: downs.append(p.node_id))
            t.gate.open = True
            await wait_for(lambda: (p := t.a.peer(c_id)) is not None and p.path == "quic", 10.0)
            await asyncio.sleep(0.5)  # the replaced relayed connection's close may still pass B
            before = t.rb.stats["relay_frames"]
            assert await t.a.peer(c_id).request(StreamType.RPC, b"direct", 5.0) == b"c-says:direct"  # type: ignore[union-attr]
            assert t.rb.stats["relay_frames"] == before  # nothing goes through B any more
            assert downs == [] and t.ra.stats["direct_recovered"] >= 1

    asyncio.run(main())


def test_relay_legs_ride_the_data_lanes_and_survive_a_lane_dying() -> None:
    """With lanes up A-B and C-B, the relay's two legs are lane streams (B still forwards only ciphertext);
    when A's lane to B dies, the relayed connection over it is lost and A relays again (QUIC leg or the
    redialled lane), and requests to C work again."""

    async def main() -> None:
        async with trio(lanes=True) as t:
            seen: list[bytes] = []
            t.rb.tap = seen.append
            c_id, b_id = t.ids["c"], t.ids["b"]
            with contextlib.suppress(TransportError):
                await t.a.connect(t.gate_addr, c_id)  # the gate is shut: no direct path
            await wait_for(lambda: t.a.peer(c_id) is not None)
            peer = t.a.peer(c_id)
            assert peer is not None and peer.path == "relay"
            secret = b"lane-leg-secret:" + bytes(range(256)) * 8
            assert await peer.request(StreamType.RPC, secret, 5.0) == b"c-says:" + secret
            assert t.ra.stats.get("relayed_connections_on_lane") == 1
            assert t.rb.stats.get("relays_opened_on_lanes") == 1
            relayed = b"".join(seen)
            assert len(relayed) > 2 * len(secret) and b"lane-leg-secret" not in relayed

            lane = t.a.peer(b_id)._lane  # type: ignore[union-attr]
            assert lane is not None
            downs: list[str] = []
            t.a.on_peer_down.append(lambda p: downs.append(p.node_id))
            lane.close("test: lane cut")
            await wait_for(lambda: t.ra.stats["relayed_connections"] == 2 and t.a.peer(c_id) is not None, 10.0)
            again = t.a.peer(c_id)
            assert again is not None and again.path == "relay"
            assert await again.request(StreamType.RPC, b"after", 5.0) == b"c-says:after"
            assert downs == [c_id]  # the relayed connection on the cut lane went down once, then came back

    asyncio.run(main())


def test_a_relay_can_refuse_and_counts_it() -> None:
    async def main() -> None:
        async with trio(allow_relay=False) as t:
            c_id = t.ids["c"]
            b_peer = t.a.peer(t.ids["b"])
            assert b_peer is not None
            try:
                await t.ra.connect_via(b_peer, c_id)
                raise AssertionError("the relay should refuse")
            except TransportError as e:
                assert "does not relay" in str(e)
            assert t.rb.stats["relay_refused"] == 1 and t.a.peer(c_id) is None

    asyncio.run(main())
