"""The data lane (transport.lane): real QUIC + TLS-over-TCP on loopback, two transports in one loop.

Covers: lane stream types use the lane and others QUIC; the proof of identity against a TLS-terminating
proxy (refused by the client, and by the server when a careless client signs what the proxy showed it);
strangers on the lane port refused within 1 s and forgotten, per-source caps; a lane that dies fails its
open streams like a reset and new streams go over QUIC until it is back; a node with no lane.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from transport_peer import member_of

import transport.lane_conn as lane_mod
from transport.credentials import create_mesh
from transport.errors import TransportError
from transport.identity import NodeIdentity
from transport.lane import LaneConfig, LaneManager
from transport.quic import MeshTransport, Peer, Stream, StreamType


@dataclass
class Pair:
    a: MeshTransport
    b: MeshTransport
    la: LaneManager
    lb: LaneManager
    peer_of_a: Peer  # b's Peer object for a
    peer_of_b: Peer  # a's Peer object for b


async def _echo(peer: Peer, stream: Stream) -> None:
    while (chunk := await stream.recv()) is not None:
        await stream.send(chunk)


@asynccontextmanager
async def pair(lane_b: bool = True, config: LaneConfig | None = None) -> AsyncIterator[Pair]:
    ia, ib = NodeIdentity.generate(), NodeIdentity.generate()
    if ia.node_id > ib.node_id:
        ia, ib = ib, ia  # a has the smaller id: b's lane is dialled by a
    creds = create_mesh(ia, "lane-test", int(time.time()), 1, 1)
    a, b = MeshTransport(ia, creds), MeshTransport(ib, member_of(creds, ib))
    la, lb = LaneManager(a, config), LaneManager(b, config)
    for t in (a, b):
        t.on_stream(StreamType.EXPERT, _echo)
        t.on_stream(StreamType.HTTP_TUNNEL, _echo)
    addr_a = await a.listen("127.0.0.1", 0)
    addr_b = await b.listen("127.0.0.1", 0)
    try:
        await la.listen("127.0.0.1", addr_a[1])  # TCP on the QUIC port's number, as the daemon does
    except TransportError:
        await la.listen("127.0.0.1", 0)  # taken by someone else on this shared machine
    if lane_b:
        await lb.listen("127.0.0.1", 0)
    peer_of_b = await a.connect(addr_b, ib.node_id)
    peer_of_a = b.peer(ia.node_id)
    assert peer_of_a is not None
    p = Pair(a, b, la, lb, peer_of_a, peer_of_b)
    try:
        yield p
    finally:
        for t in (la, lb):
            await t.close()
        for t in (a, b):
            await t.close()


async def wait_for(cond: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def roundtrip(stream: Stream, payload: bytes) -> bytes | None:
    await stream.send(payload)
    return await stream.recv()


def test_lane_carries_expert_streams_and_quic_the_rest() -> None:
    async def main() -> None:
        async with pair() as p:
            await wait_for(lambda: p.peer_of_b.path == "lane" and p.peer_of_a.path == "lane")
            big = bytes(range(256)) * 8192  # 2 MiB in one frame
            for peer in (p.peer_of_b, p.peer_of_a):  # both directions open streams on the lane
                s = await peer.open_stream(StreamType.EXPERT)
                assert s.path == "lane"
                assert await roundtrip(s, b"hello") == b"hello"
                assert await roundtrip(s, big) == big
                assert s.send_now(b"now")
                assert await s.recv() == b"now"
                await s.end()
                assert await s.recv() is None
                t = await peer.open_stream(StreamType.HTTP_TUNNEL)
                assert t.path == "quic"
                assert await roundtrip(t, b"tunnel") == b"tunnel"
                await t.end()
            assert p.la.lane_count() == 1 and p.lb.lane_count() == 1
            assert p.la.stats["lanes_opened"] == 1

    asyncio.run(main())


class _TerminatingProxy:
    """A TCP proxy that terminates TLS itself with its own key and opens its own TLS to the real lane,
    relaying the plaintext both ways: what a middlebox with a trusted-looking certificate does."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.ident = NodeIdentity.generate()
        self.ctx = lane_mod._server_context(self.ident)
        self.relayed = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> tuple[str, int]:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ctx)
        return ("127.0.0.1", self.server.sockets[0].getsockname()[1])

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        ur, uw = await asyncio.open_connection(*self.target, ssl=ctx)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    self.relayed += len(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(r, uw), pipe(ur, w))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def test_tls_terminating_proxy_is_refused_by_the_client() -> None:
    async def main() -> None:
        async with pair() as p:
            await wait_for(lambda: p.peer_of_b.path == "lane")
            assert p.lb.address is not None
            proxy = _TerminatingProxy(p.lb.address)
            addr = await proxy.start()
            try:
                with pytest.raises(TransportError, match="not the peer's node key"):
                    await p.la._dial(p.peer_of_b, addr)
                assert p.lb.stats["lanes_opened"] == 1  # only the real lane, none through the proxy
            finally:
                proxy.close()

    asyncio.run(main())


def test_tls_terminating_proxy_is_refused_by_the_server_even_if_the_client_is_careless(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that skipped its own checks signs the hash of the proxy's certificate: the server refuses."""
    real = lane_mod.lane_wire.verify

    def careless_client(public_key: bytes, signature: bytes, signer_is_client: bool, *rest: Any) -> None:
        if signer_is_client:  # the server checking the client: real
            real(public_key, signature, signer_is_client, *rest)

    monkeypatch.setattr(lane_mod.lane_wire, "verify", careless_client)
    asyncio.run(_careless(monkeypatch))


async def _careless(monkeypatch: pytest.MonkeyPatch) -> None:
    async with pair() as p:
        await wait_for(lambda: p.peer_of_b.path == "lane")
        assert p.lb.address is not None
        proxy = _TerminatingProxy(p.lb.address)
        addr = await proxy.start()
        monkeypatch.setattr(lane_mod, "_cert_public_key", lambda der: p.peer_of_b.public_key)
        try:
            with pytest.raises(TransportError):
                await p.la._dial(p.peer_of_b, addr)
            await wait_for(lambda: p.lb.stats.get("lane_refused_handshake_failed", 0) >= 1)
            assert proxy.relayed > 0  # the proxy relayed the careless client's proof, and it failed
            assert p.lb.stats["lanes_opened"] == 1
        finally:
            proxy.close()


async def _closed_within(reader: asyncio.StreamReader, timeout_s: float) -> float:
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            while await reader.read(65536):
                pass
    except (ConnectionError, ssl.SSLError):
        pass
    return time.monotonic() - t0


def test_strangers_on_the_lane_port_are_refused_within_a_second_and_forgotten() -> None:
    async def main() -> None:
        async with pair() as p:
            await wait_for(lambda: p.peer_of_b.path == "lane")
            assert p.lb.address is not None
            host, port = p.lb.address
            # 1. TCP, then silence: no TLS
            r, w = await asyncio.open_connection(host, port)
            assert await _closed_within(r, 3.0) < 1.8  # 1 s deadline, headroom for a loaded machine
            w.close()
            # 2. TCP, garbage instead of TLS
            r, w = await asyncio.open_connection(host, port)
            w.write(b"GET / HTTP/1.1\r\n\r\n" * 10)
            assert await _closed_within(r, 3.0) < 1.8
            w.close()
            # 3. TLS, then silence
            ctx = lane_mod._client_context()
            r, w = await asyncio.open_connection(host, port, ssl=ctx)
            assert await _closed_within(r, 3.0) < 1.8
            w.close()
            # 4. TLS and a well-formed hello from a key that is no connected member: refused at once
            stranger = NodeIdentity.generate()
            r, w = await asyncio.open_connection(host, port, ssl=ctx)
            w.write(lane_mod.lane_wire.encode_hello(stranger.public_key, b"\0" * 32))
            reply = await asyncio.wait_for(r.read(300), 1.0)
            assert reply[0] == 1 and b"not a connected member" in reply
            assert await _closed_within(r, 2.0) < 1.0
            w.close()
            await wait_for(lambda: p.lb.status()["pending"] == 0, 1.0)
            assert p.lb.stats.get("lane_refused_handshake_timeout", 0) + p.lb.stats.get("lane_tls_failed", 0) >= 2
            assert p.lb.stats["lanes_refused"] == 1
            assert p.lb.lane_count() == 1  # the member's lane is untouched
            assert p.peer_of_a.path == "lane"

    asyncio.run(main())


def test_connections_still_proving_are_capped_per_source() -> None:
    async def main() -> None:
        cfg = LaneConfig(max_pending_per_source=3, auth_timeout_s=3.0)
        async with pair(config=cfg) as p:
            await wait_for(lambda: p.peer_of_b.path == "lane")
            assert p.lb.address is not None
            host, port = p.lb.address
            idle = [await asyncio.open_connection(host, port) for _ in range(3)]
            await wait_for(lambda: p.lb.status()["pending"] == 3, 1.0)
            r, w = await asyncio.open_connection(host, port)
            assert await _closed_within(r, 1.0) < 0.5  # refused at once, before any TLS work
            assert p.lb.stats["lane_refused_source_cap"] == 1
            for _, iw in idle:
                iw.close()
            w.close()
            await wait_for(lambda: p.lb.status()["pending"] == 0, 5.0)

    asyncio.run(main())


def test_lane_dying_mid_call_fails_that_call_and_quic_carries_the_next_until_it_is_back() -> None:
    async def main() -> None:
        cfg = LaneConfig(retry_min_s=0.3, retry_max_s=0.5)
        async with pair(config=cfg) as p:
            await wait_for(lambda: p.peer_of_b.path == "lane")
            s = await p.peer_of_b.open_stream(StreamType.EXPERT)
            assert await roundtrip(s, b"before") == b"before"
            lane = p.peer_of_b._lane
            lane._transport.abort()  # the TCP connection dies
            t0 = time.monotonic()
            with pytest.raises(TransportError):
                await asyncio.wait_for(roundtrip(s, b"during"), 2.0)
            assert time.monotonic() - t0 < 1.5
            assert p.peer_of_b.path == "quic"
            q = await p.peer_of_b.open_stream(StreamType.EXPERT)
            assert q.path == "quic"
            assert await roundtrip(q, b"after") == b"after"
            await wait_for(lambda: p.peer_of_b.path == "lane", 5.0)  # redialled
            s2 = await p.peer_of_b.open_stream(StreamType.EXPERT)
            assert s2.path == "lane" and await roundtrip(s2, b"back") == b"back"
            assert await roundtrip(q, b"quic still") == b"quic still"  # the QUIC stream lives on

    asyncio.run(main())


def test_a_node_without_a_lane_is_reached_over_quic() -> None:
    async def main() -> None:
        async with pair(lane_b=False) as p:  # b listens nowhere (--lane-listen off) and says so when asked
            await asyncio.sleep(0.5)
            assert p.peer_of_b.path == "quic" and p.peer_of_a.path == "quic"
            assert p.la.lane_count() == 0 and p.lb.lane_count() == 0
            assert p.la.stats.get("lane_dial_failures", 0) == 0  # told "no lane", not failing and retrying
            s = await p.peer_of_b.open_stream(StreamType.EXPERT)
            assert s.path == "quic" and await roundtrip(s, b"x") == b"x"

    asyncio.run(main())


def test_a_reader_that_falls_behind_slows_the_sender_instead_of_being_reset() -> None:
    """No per-stream credit on a lane: the lane stops reading while a stream's unread input is over half the
    limit, so TCP pushes back on the sender (as QUIC's stream credit does) and nothing is reset."""
    async def main() -> None:
        async with pair() as p:
            await wait_for(lambda: p.peer_of_b.path == "lane")
            go = asyncio.Event()
            got: list[int] = []

            async def slow_sink(peer: Peer, stream: Stream) -> None:
                await go.wait()  # reads nothing until told
                total = 0
                while (chunk := await stream.recv()) is not None:
                    total += len(chunk)
                got.append(total)

            p.b.on_stream(StreamType.EXPERT, slow_sink)
            s = await p.peer_of_b.open_stream(StreamType.EXPERT)
            blob = b"x" * (1024 * 1024)
            total = 24 * len(blob)  # 3x the 8 MiB unread limit at which a stream is reset
            sender = asyncio.ensure_future(_send_all(s, blob, total // len(blob)))
            await asyncio.sleep(1.0)
            assert not sender.done()  # held back by TCP, not failed
            go.set()
            await asyncio.wait_for(sender, 20)
            await wait_for(lambda: got == [total], 20)
            assert p.lb.stats.get("lane_read_paused", 0) >= 1
            assert "lane_streams_reset_recv_overflow" not in p.lb.stats

    asyncio.run(main())


async def _send_all(s: Stream, blob: bytes, n: int) -> None:
    for _ in range(n):
        await s.send(blob)
    await s.end()


# -- the sans-I/O lane codec ------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from transport.framing import RemoteProtocolError  # noqa: E402
from transport.lane_wire import MuxDecoder, MuxKind, encode_reset, mux_header  # noqa: E402

_valid = st.lists(st.one_of(
    st.tuples(st.just(MuxKind.DATA), st.integers(0, 2**32 - 1), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just(MuxKind.FIN), st.integers(0, 2**32 - 1), st.just(b"")),
    st.tuples(st.just(MuxKind.RESET), st.integers(0, 2**32 - 1), st.integers(0, 65535)),
    st.tuples(st.sampled_from([MuxKind.PING, MuxKind.PONG]), st.just(0), st.just(b"")),
), max_size=8)


def _encode(recs: list[tuple[MuxKind, int, Any]]) -> bytes:
    out = b""
    for kind, sid, p in recs:
        if kind is MuxKind.RESET:
            out += encode_reset(sid, p)
        else:
            out += mux_header(kind, sid, len(p)) + p
    return out


def _whole(decoder: MuxDecoder, data: bytes, step: int) -> list[tuple[int, int, bytes]] | str:
    """Records with each DATA record's pieces joined (pieces of one record are consecutive)."""
    got: list[tuple[int, int, bytes]] = []
    left = 0
    try:
        for i in range(0, len(data), step):
            for r in decoder.feed(data[i:i + step]):
                if r.kind is MuxKind.DATA and left:
                    kind, sid, p = got[-1]
                    got[-1] = (kind, sid, p + bytes(r.payload))
                else:
                    got.append((int(r.kind), r.stream_id, bytes(r.payload)))
                left = decoder._left if decoder._kind is MuxKind.DATA else 0
    except RemoteProtocolError as e:
        return e.code.name
    return got


@given(_valid)
@settings(max_examples=200, deadline=None)
def test_mux_records_decode_the_same_in_one_chunk_and_byte_by_byte(recs: list[tuple[MuxKind, int, Any]]) -> None:
    data = _encode(recs)
    one = _whole(MuxDecoder(), data, max(1, len(data)))
    assert one == _whole(MuxDecoder(), data, 1)
    expect = [(int(k), sid, (p.to_bytes(2, "big") if k is MuxKind.RESET else p)) for k, sid, p in recs]
    assert one == expect


@given(st.binary(max_size=64))
@settings(max_examples=300, deadline=None)
def test_mux_arbitrary_bytes_give_records_or_a_protocol_error(data: bytes) -> None:
    one = _whole(MuxDecoder(), data, max(1, len(data)))
    assert one == _whole(MuxDecoder(), data, 1)


def test_mux_refuses_oversized_and_malformed_records_from_the_header() -> None:
    from transport.lane_wire import MAX_CHUNK_BYTES

    for bad in (mux_header(MuxKind.DATA, 0, MAX_CHUNK_BYTES + 1), mux_header(MuxKind.DATA, 0, 0),
                mux_header(MuxKind.FIN, 0, 1), mux_header(MuxKind.RESET, 0, 3), b"\x09" + b"\0" * 8):
        with pytest.raises(RemoteProtocolError):
            MuxDecoder().feed(bad)
