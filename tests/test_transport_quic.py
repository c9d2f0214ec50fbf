"""Real QUIC on loopback between real processes (tests/transport_peer.py) and in-process transports."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import struct
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from aioquic.asyncio.client import connect as quic_connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from transport_peer import PeerProcess, member_of, peer_config

from transport import ALPN
from transport.credentials import Genesis, MemberCert, MeshCredentials, b64e, create_mesh, sign_document
from transport.errors import HandshakeRefused, JoinRefused, RemoteError, StreamReset, TransportError
from transport.framing import ErrorCode, FrameType, encode_frame, encode_preamble
from transport.identity import NodeIdentity
from transport.quic import MeshTransport, Peer, Stream, StreamType, TransportConfig

T0 = 1_700_000_000
FAST = replace(TransportConfig(), reconnect_min_s=0.1, reconnect_max_s=1.0)


@pytest.fixture(scope="module")
def mesh() -> MeshCredentials:
    return create_mesh(NodeIdentity.generate(), "test", T0, 1, 1)


@pytest.fixture(scope="module")
def node_a(mesh: MeshCredentials, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerProcess]:
    ident = NodeIdentity.generate()
    proc = PeerProcess(peer_config(ident, member_of(mesh, ident), join=True), tmp_path_factory.mktemp("a"))
    yield proc
    assert proc.stop() == 0


def new_member(mesh: MeshCredentials, config: TransportConfig = FAST) -> MeshTransport:
    ident = NodeIdentity.generate()
    return MeshTransport(ident, member_of(mesh, ident), config)


async def stats_of(peer: Peer) -> dict[str, Any]:
    return json.loads(await peer.request(StreamType.RPC, b"stats", 5.0))


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- members ---------------------------------------------------------------------------------------


def test_two_members_exchange_rpcs(mesh: MeshCredentials, node_a: PeerProcess) -> None:
    async def scenario() -> None:
        b = new_member(mesh)
        ups: list[str] = []
        b.on_peer_up.append(lambda p: ups.append(p.node_id))

        async def echo(peer: Peer, request: bytes) -> bytes:
            return b"b-says:" + request

        b.on_rpc(StreamType.RPC, echo)
        try:
            peer = await b.connect(node_a.addr, expected_node_id=node_a.node_id)
            assert peer.node_id == node_a.node_id and ups == [node_a.node_id]
            assert peer.cert is not None and peer.cert.mesh_id == mesh.mesh_id
            assert await peer.request(StreamType.RPC, b"echo:hello", 5.0) == b"echo:hello"
            # the other direction: A's handler asks us over the same connection
            assert await peer.request(StreamType.RPC, b"call", 5.0) == b"b-says:echo:back"
            with pytest.raises(RemoteError) as err:
                await peer.request(StreamType.RPC, b"fail", 5.0)
            assert (err.value.code, err.value.reason) == (7, "nope")
            with pytest.raises(RemoteError) as err:
                await peer.request(StreamType.RPC, b"crash", 5.0)
            assert err.value.code == ErrorCode.INTERNAL_ERROR
            with pytest.raises(RemoteError) as err:  # a reply over the frame limit is the handler's bug
                await peer.request(StreamType.RPC, b"big", 5.0)
            assert err.value.code == ErrorCode.INTERNAL_ERROR
            with pytest.raises(StreamReset) as reset:  # nobody serves EXPERT on A
                await peer.request(StreamType.EXPERT, b"x", 5.0)
            assert reset.value.code == ErrorCode.NO_HANDLER
            # a typed stream with several frames each way
            stream = await peer.open_stream(StreamType.HTTP_TUNNEL)
            for i in range(5):
                await stream.send(b"chunk%d" % i)
            await stream.end()
            got = []
            while (chunk := await stream.recv()) is not None:
                got.append(chunk)
            assert got == [b"chunk%d" % i for i in range(5)]
            assert peer.rtt_ms is not None and 0 < peer.rtt_ms < 1000
            stats = await stats_of(peer)
            assert b.identity.node_id in stats["peers"]
            # connecting again to a connected pinned peer reuses the connection
            assert await b.connect(node_a.addr, expected_node_id=node_a.node_id) is peer
        finally:
            await b.close()

    asyncio.run(scenario())


def test_200_concurrent_streams_and_bulk(mesh: MeshCredentials, node_a: PeerProcess) -> None:
    async def scenario() -> None:
        b = new_member(mesh)
        try:
            peer = await b.connect(node_a.addr, expected_node_id=node_a.node_id)
            payloads = [b"echo:%d:" % i + os.urandom(8192) for i in range(200)]
            replies = await asyncio.gather(*(peer.request(StreamType.RPC, p, 30.0) for p in payloads))
            assert replies == payloads
            # bulk: 8 MiB through one echo stream, sender and reader concurrently
            stream = await peer.open_stream(StreamType.HTTP_TUNNEL)
            blob = os.urandom(64 * 1024)

            async def send() -> None:
                for _ in range(128):
                    await stream.send(blob)
                await stream.end()

            sender = asyncio.ensure_future(send())
            received = 0
            while (chunk := await stream.recv()) is not None:
                assert chunk == blob
                received += len(chunk)
            await sender
            assert received == 128 * len(blob)
        finally:
            await b.close()

    asyncio.run(scenario())


def test_200_concurrent_streams_with_internet_sized_packets(mesh: MeshCredentials, tmp_path: Path) -> None:
    """The 1350-byte path that non-loopback peers use (loopback peers default to 16 KiB packets)."""
    ident = NodeIdentity.generate()
    proc = PeerProcess(peer_config(ident, member_of(mesh, ident), transport={"loopback_datagram_size": 0}), tmp_path)

    async def scenario() -> None:
        b = new_member(mesh, replace(FAST, loopback_datagram_size=0))
        try:
            peer = await b.connect(proc.addr, expected_node_id=proc.node_id)
            assert peer._conn is not None and peer._conn._quic._max_datagram_size == 1350
            payloads = [b"echo:%d:" % i + os.urandom(4096) for i in range(200)]
            replies = await asyncio.gather(*(peer.request(StreamType.RPC, p, 30.0) for p in payloads))
            assert replies == payloads
        finally:
            await b.close()

    try:
        asyncio.run(scenario())
    finally:
        assert proc.stop() == 0


def test_request_timeout_resets_the_stream_and_cancels_the_handler(
    mesh: MeshCredentials, node_a: PeerProcess
) -> None:
    async def scenario() -> None:
        b = new_member(mesh)
        try:
            peer = await b.connect(node_a.addr, expected_node_id=node_a.node_id)
            before = (await stats_of(peer))["stats"].get("hang_cancelled", 0)
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                await peer.request(StreamType.RPC, b"hang", 0.3)
            assert time.monotonic() - t0 < 1.0
            for _ in range(50):
                if (await stats_of(peer))["stats"].get("hang_cancelled", 0) == before + 1:
                    break
                await asyncio.sleep(0.05)
            assert (await stats_of(peer))["stats"].get("hang_cancelled", 0) == before + 1
            # cancellation by the caller resets too
            task = asyncio.ensure_future(peer.request(StreamType.RPC, b"hang", 30.0))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.3)
            assert (await stats_of(peer))["stats"].get("hang_cancelled", 0) == before + 2
        finally:
            await b.close()

    asyncio.run(scenario())


# -- refusals --------------------------------------------------------------------------------------


def test_strangers_and_wrong_keys_are_refused(mesh: MeshCredentials, node_a: PeerProcess) -> None:
    async def scenario() -> None:
        other = create_mesh(NodeIdentity.generate(), "other", T0, 1, 1)
        # 1. a member of another mesh who knows our (public) genesis and so passes its own check of A
        s1 = NodeIdentity.generate()
        rogue1 = MeshCredentials(mesh.genesis, member_of(other, s1).cert)
        # 2. a stranger with its own certificate for our mesh id, signed by itself
        s2 = NodeIdentity.generate()
        body = {"v": 1, "mesh_id": mesh.mesh_id, "node_pub": b64e(s2.public_key), "node_id": s2.node_id,
                "issued_at": T0}
        forged = MemberCert.__new__(MemberCert)
        object.__setattr__(forged, "encoded", sign_document(s2, b"member-cert", body))
        rogue2 = MeshCredentials(mesh.genesis, forged)
        cases = [
            (MeshTransport(s1, rogue1, FAST), node_a.node_id, ErrorCode.REFUSED, "another mesh"),
            (MeshTransport(s2, rogue2, FAST), node_a.node_id, ErrorCode.REFUSED, "bad signature"),
            # 3. an honest member of another mesh: its blinded proof fails at A, which shows it nothing
            (new_member(other), None, ErrorCode.REFUSED, "not a member of this mesh"),
            # 4. a member of our mesh dialling A's address pinned to another node id
            (new_member(mesh), NodeIdentity.generate().node_id, ErrorCode.HANDSHAKE_FAILED, "pinned"),
        ]
        for transport, pinned, code, fragment in cases:
            t0 = time.monotonic()
            with pytest.raises(HandshakeRefused) as err:
                await transport.connect(node_a.addr, expected_node_id=pinned)
            assert err.value.code == code and fragment in err.value.reason, err.value
            assert time.monotonic() - t0 < 1.0
            assert transport.peers() == []
            await transport.close()
        b = new_member(mesh)
        try:
            peer = await b.connect(node_a.addr, expected_node_id=node_a.node_id)
            stats = await stats_of(peer)
            assert stats["stats"].get("refused_refused", 0) >= 3  # A refused cases 1, 2 and 3 itself
            assert s1.node_id not in stats["peers"] and s2.node_id not in stats["peers"]
        finally:
            await b.close()

    asyncio.run(scenario())


def test_join_via_redeem(mesh: MeshCredentials, node_a: PeerProcess) -> None:
    async def scenario() -> None:
        joiner = MeshTransport(NodeIdentity.generate(), None, FAST)
        try:
            assert await joiner.redeem(node_a.addr, node_a.node_id, b"token") == b"joined:token"
            with pytest.raises(JoinRefused) as err:
                await joiner.redeem(node_a.addr, node_a.node_id, b"bad")
            assert err.value.reason == "invite expired"
            with pytest.raises(HandshakeRefused):  # the issuer's key is pinned
                await joiner.redeem(node_a.addr, NodeIdentity.generate().node_id, b"token")
            with pytest.raises(TransportError):  # a node without credentials cannot connect as a member
                await joiner.connect(node_a.addr)
            assert joiner.peers() == []
        finally:
            await joiner.close()

    asyncio.run(scenario())


class _Recorder(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.terminated: qe.ConnectionTerminated | None = None
        self.terminated_at = 0.0

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        super().datagram_received(data, addr)
        close = self._quic._close_event  # the server's CONNECTION_CLOSE arrived (draining starts)
        if close is not None and self.terminated is None:
            self.terminated = close
            self.terminated_at = time.monotonic()


async def _raw_session(addr: tuple[str, int], send: list[tuple[int, bytes]], alpn: str = ALPN) -> tuple[Any, float]:
    """Connect with plain aioquic, send raw stream data, return (ConnectionTerminated, seconds to it)."""
    config = QuicConfiguration(is_client=True, alpn_protocols=[alpn], verify_mode=ssl.CERT_NONE)
    async with quic_connect(addr[0], addr[1], configuration=config, create_protocol=_Recorder) as proto:
        rec: _Recorder = proto  # type: ignore[assignment]
        t0 = time.monotonic()
        for stream_id, data in send:
            rec._quic.send_stream_data(stream_id, data)
        rec.transmit()
        await asyncio.wait_for(rec.wait_closed(), 5.0)
        return rec.terminated, rec.terminated_at - t0


def test_silent_stranger_garbage_and_early_streams_are_closed(
    mesh: MeshCredentials, node_a: PeerProcess
) -> None:
    async def scenario() -> None:
        # garbage on the first stream: closed within one round trip
        ev, dt = await _raw_session(node_a.addr, [(0, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")])
        assert ev.error_code == ErrorCode.PROTOCOL_ERROR and dt < 0.5
        # a valid preamble then an oversize frame header
        big = encode_preamble(StreamType.HANDSHAKE, 1) + encode_frame(FrameType.HELLO, b"")[:5] + b"\xff" * 4
        ev, dt = await _raw_session(node_a.addr, [(0, big)])
        assert ev.error_code == ErrorCode.FRAME_TOO_LARGE and dt < 0.5
        # another stream before the handshake
        ev, dt = await _raw_session(node_a.addr, [(4, encode_preamble(StreamType.RPC, 1))])
        assert ev.error_code == ErrorCode.NOT_ADMITTED and dt < 0.5
        # an unknown stream type as the first stream
        ev, dt = await _raw_session(node_a.addr, [(0, b"ms\x09\x01")])
        assert ev.error_code == ErrorCode.UNKNOWN_STREAM_TYPE
        # a stranger who says nothing: closed by the 1 s first-frame deadline
        ev, dt = await _raw_session(node_a.addr, [])
        assert ev.error_code == ErrorCode.HANDSHAKE_TIMEOUT and 0.8 < dt < 1.6
        assert ev.reason_phrase == "no handshake frame in time"
        # wrong ALPN: the TLS handshake fails
        with pytest.raises(ConnectionError):
            await _raw_session(node_a.addr, [], alpn="h3")
        # the retired handshake generation: told so after TLS
        ev, dt = await _raw_session(node_a.addr, [], alpn="meshd/1")
        assert ev.error_code == ErrorCode.UNSUPPORTED_VERSION and "upgrade meshd" in ev.reason_phrase
        # raw garbage datagrams
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            for i in range(300):
                junk = os.urandom(i * 5 % 1500 + 1)
                if i % 3 == 0:  # a QUIC v1 Initial header (it cannot decrypt), padded to 1200+ bytes
                    body = os.urandom(max(len(junk), 1200))
                    junk = b"\xc0\x00\x00\x00\x01\x08" + os.urandom(8) + b"\x00\x00"
                    junk += struct.pack(">H", 0x4000 | len(body)) + body
                await loop.sock_sendto(sock, junk, node_a.addr)
                if i % 10 == 9:
                    await asyncio.sleep(0.005)  # stay under the socket buffer: count, not loss
        finally:
            sock.close()
        # A is still up and serving members, and counted what it refused
        b = new_member(mesh)
        try:
            peer = await b.connect(node_a.addr, expected_node_id=node_a.node_id)
            assert await peer.request(StreamType.RPC, b"echo:alive", 5.0) == b"echo:alive"
            stats = (await stats_of(peer))["stats"]
            assert stats.get("refused_protocol_error", 0) >= 1
            assert stats.get("refused_not_admitted", 0) >= 1
            assert stats.get("refused_handshake_timeout", 0) >= 1
            junk = ("datagrams_garbage", "datagrams_dropped", "datagrams_garbage_initial")
            assert sum(stats.get(k, 0) for k in junk) >= 200, stats  # of 300 (UDP may drop some)
            assert stats.get("datagrams_garbage_initial", 0) >= 1, stats
            assert stats.get("handshakes_tls_failed", 0) >= 1  # the wrong ALPN
        finally:
            await b.close()

    asyncio.run(scenario())


# -- keep-alive, restarts ---------------------------------------------------------------------------


def test_keepalive_holds_a_silent_request_and_its_absence_drops_it(
    mesh: MeshCredentials, tmp_path: Path
) -> None:
    def start(keepalive_s: float) -> PeerProcess:
        ident = NodeIdentity.generate()
        tc = {"idle_timeout_s": 2.0, "keepalive_interval_s": keepalive_s, "dead_peer_timeout_s": 4.0}
        return PeerProcess(peer_config(ident, member_of(mesh, ident), transport=tc), tmp_path)

    async def silent_request(proc: PeerProcess, keepalive_s: float) -> bytes | Exception:
        config = replace(FAST, idle_timeout_s=2.0, keepalive_interval_s=keepalive_s, dead_peer_timeout_s=4.0)
        b = new_member(mesh, config)
        try:
            peer = await b.connect(proc.addr, expected_node_id=proc.node_id)
            return await peer.request(StreamType.RPC, b"sleep:5", 10.0)
        except TransportError as e:
            return e
        finally:
            await b.close()

    with_ka, without_ka = start(0.5), start(0.0)
    try:

        async def both() -> list[bytes | Exception]:
            return list(await asyncio.gather(silent_request(with_ka, 0.5), silent_request(without_ka, 0.0)))

        t0 = time.monotonic()
        held, dropped = asyncio.run(both())
        assert held == b"slept"
        assert isinstance(dropped, TransportError) and "closed" in str(dropped)
        assert time.monotonic() - t0 < 9.0
    finally:
        assert with_ka.stop() == 0 and without_ka.stop() == 0


def test_restarted_peer_is_reconnected(mesh: MeshCredentials, tmp_path: Path) -> None:
    ident = NodeIdentity.generate()
    config = peer_config(ident, member_of(mesh, ident), listen=f"127.0.0.1:{free_udp_port()}")

    async def scenario() -> None:
        proc = await asyncio.to_thread(PeerProcess, config, tmp_path)
        tc = replace(FAST, keepalive_interval_s=0.3, dead_peer_timeout_s=1.5)
        b = new_member(mesh, tc)
        ups: list[float] = []
        downs: list[float] = []
        b.on_peer_up.append(lambda p: ups.append(time.monotonic()))
        b.on_peer_down.append(lambda p: downs.append(time.monotonic()))
        try:
            b.keep_connected(ident.node_id, [proc.addr])
            await _until(lambda: len(ups) == 1, 5.0)
            await asyncio.to_thread(proc.stop, True)  # kill -9: no close frame reaches us
            killed = time.monotonic()
            await _until(lambda: len(downs) == 1, 5.0)
            assert downs[0] - killed < 3.0
            proc = await asyncio.to_thread(PeerProcess, config, tmp_path)
            restarted = time.monotonic()
            await _until(lambda: len(ups) == 2, 8.0)
            assert ups[1] - restarted < 5.0
            peer = b.peer(ident.node_id)
            assert peer is not None
            assert await peer.request(StreamType.RPC, b"echo:again", 5.0) == b"echo:again"
            b.forget(ident.node_id)
        finally:
            await b.close()
            await asyncio.to_thread(proc.stop)

    asyncio.run(scenario())


async def _until(cond: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


# -- in-process: dial races, caps, backpressure -----------------------------------------------------


def test_simultaneous_dials_keep_one_connection(mesh: MeshCredentials) -> None:
    async def scenario() -> None:
        a, b = new_member(mesh), new_member(mesh)
        ups_a: list[str] = []
        a.on_peer_up.append(lambda p: ups_a.append(p.node_id))
        addr_a, addr_b = await a.listen("127.0.0.1", 0), await b.listen("127.0.0.1", 0)
        try:
            pa, pb = await asyncio.gather(
                b.connect(addr_a, expected_node_id=a.identity.node_id),
                a.connect(addr_b, expected_node_id=b.identity.node_id),
            )
            await asyncio.sleep(0.3)
            assert len(a._conns) == 1 and len(b._conns) == 1
            conn_a, conn_b = a._conns.copy().pop(), b._conns.copy().pop()
            assert conn_a.is_client != conn_b.is_client  # the same connection seen from both ends
            lower = min(a.identity.node_id, b.identity.node_id)
            assert (conn_a.is_client and lower == a.identity.node_id) or (
                conn_b.is_client and lower == b.identity.node_id
            )
            assert ups_a == [b.identity.node_id]
            assert pa.connected and pb.connected
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_stream_and_connection_caps(mesh: MeshCredentials) -> None:
    async def scenario() -> None:
        server = new_member(mesh, replace(FAST, max_streams_per_peer=4, max_connections=2))
        release = asyncio.Event()

        async def hold(peer: Peer, request: bytes) -> bytes:
            await release.wait()
            return request

        server.on_rpc(StreamType.RPC, hold)
        addr = await server.listen("127.0.0.1", 0)
        clients = [new_member(mesh) for _ in range(3)]
        try:
            peer = await clients[0].connect(addr)
            tasks = [asyncio.ensure_future(peer.request(StreamType.RPC, b"%d" % i, 5.0)) for i in range(6)]
            await asyncio.sleep(0.3)
            release.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            refused = [r for r in results if isinstance(r, StreamReset)]
            assert len(refused) == 2 and all(r.code == ErrorCode.TOO_MANY_STREAMS for r in refused)
            assert server.stats["streams_refused_cap"] == 2
            await clients[1].connect(addr)
            with pytest.raises(HandshakeRefused) as err:
                await clients[2].connect(addr)
            assert err.value.code == ErrorCode.TOO_MANY_CONNECTIONS
        finally:
            for c in clients:
                await c.close()
            await server.close()

    asyncio.run(scenario())


def test_slow_reader_blocks_the_sender_with_bounded_buffers(mesh: MeshCredentials) -> None:
    async def scenario() -> None:
        send_limit, window = 256 * 1024, 1024 * 1024
        server = new_member(mesh, replace(FAST, quic_max_stream_data=window))
        gate = asyncio.Event()
        streams: list[Stream] = []
        got: list[int] = []

        async def slow_reader(peer: Peer, stream: Stream) -> None:
            streams.append(stream)
            await gate.wait()
            total = 0
            while (chunk := await stream.recv()) is not None:
                total += len(chunk)
            got.append(total)

        server.on_stream(StreamType.EXPERT, slow_reader)
        addr = await server.listen("127.0.0.1", 0)
        client = new_member(mesh, replace(FAST, stream_send_buffer_bytes=send_limit))
        try:
            peer = await client.connect(addr)
            stream = await peer.open_stream(StreamType.EXPERT)
            conn = peer._conn
            assert conn is not None
            blob = b"x" * 65536
            worst = [0]

            async def send_all() -> None:
                for _ in range(256):  # 16 MiB
                    await stream.send(blob)
                    worst[0] = max(worst[0], conn._pending_send_bytes(stream.stream_id))
                await stream.end()

            sender = asyncio.ensure_future(send_all())
            await asyncio.sleep(1.0)
            assert not sender.done()  # blocked: the reader has read nothing
            [remote] = streams
            assert remote._queued_bytes <= window + len(blob)  # receiver holds at most one window
            assert worst[0] <= send_limit + len(blob) + 64  # sender holds at most its buffer
            gate.set()
            await asyncio.wait_for(sender, 20.0)
            await _until(lambda: got == [256 * len(blob)], 10.0)
        finally:
            gate.set()
            await client.close()
            await server.close()

    asyncio.run(scenario())


def test_reader_queue_overflow_resets_the_stream(mesh: MeshCredentials) -> None:
    """Safety net behind flow control: a queue limit below the window resets the stream."""

    async def scenario() -> None:
        server = new_member(mesh, replace(FAST, stream_recv_queue_bytes=256 * 1024))
        stalled = asyncio.Event()

        async def never_read(peer: Peer, stream: Stream) -> None:
            await stalled.wait()

        server.on_stream(StreamType.EXPERT, never_read)
        addr = await server.listen("127.0.0.1", 0)
        client = new_member(mesh)
        try:
            peer = await client.connect(addr)
            stream = await peer.open_stream(StreamType.EXPERT)
            with pytest.raises(StreamReset) as err:
                for _ in range(1000):
                    await stream.send(b"x" * 65536)
            assert err.value.code == ErrorCode.RECV_OVERFLOW
            assert server.stats["streams_reset_recv_overflow"] == 1
        finally:
            stalled.set()
            await client.close()
            await server.close()

    asyncio.run(scenario())


def test_disconnect_fires_peer_down_on_both_sides(mesh: MeshCredentials) -> None:
    async def scenario() -> None:
        a, b = new_member(mesh), new_member(mesh)
        downs: list[str] = []

        async def on_down(p: Peer) -> None:  # async callbacks are supported too
            downs.append(p.node_id)

        a.on_peer_down.append(on_down)
        b.on_peer_down.append(on_down)
        addr = await a.listen("127.0.0.1", 0)
        try:
            peer = await b.connect(addr)
            await b.disconnect(peer.node_id, "maintenance")
            await _until(lambda: len(downs) == 2, 3.0)
            assert a.peers() == [] and b.peers() == []
            with pytest.raises(TransportError):
                await peer.request(StreamType.RPC, b"x", 1.0)
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_nobody_answering_is_a_transport_error_and_ipv6_works(mesh: MeshCredentials) -> None:
    async def scenario() -> None:
        a, b = new_member(mesh), new_member(mesh)
        silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # bound, reads nothing, says nothing
        silent.bind(("127.0.0.1", 0))
        try:
            t0 = time.monotonic()
            with pytest.raises(TransportError) as err:
                await b.connect(silent.getsockname())
            assert not isinstance(err.value, HandshakeRefused) and "no answer" in str(err.value)
            assert time.monotonic() - t0 < 4.0
            addr = await a.listen("::1", 0)
            peer = await b.connect(addr, expected_node_id=a.identity.node_id)
            assert peer.address is not None and peer.address[0] == "::1"
        finally:
            silent.close()
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_server_stream_that_beats_the_accept_is_held_not_refused(
    mesh: MeshCredentials, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reordering: the server may use the connection as soon as it admitted us, before our ACCEPT lands."""
    from transport import quic as quic_mod

    original = quic_mod._Connection._on_stream_data

    def delay_accept(self: Any, stream_id: int, data: bytes, end: bool) -> None:
        hs = self.handshake
        if self.is_client and stream_id == 0 and hs is not None and hs.awaiting_accept and data:
            self._loop.call_later(0.2, self._guarded, original, self, stream_id, data, end)
            return
        original(self, stream_id, data, end)

    monkeypatch.setattr(quic_mod._Connection, "_on_stream_data", delay_accept)

    async def scenario() -> None:
        a, b = new_member(mesh), new_member(mesh)
        got: list[bytes] = []

        async def greet(peer: Peer) -> None:
            stream = await peer.open_stream(StreamType.GOSSIP)
            await stream.send(b"hello early", end=True)

        async def gossip(peer: Peer, stream: Stream) -> None:
            while (chunk := await stream.recv()) is not None:
                got.append(chunk)

        a.on_peer_up.append(greet)
        b.on_stream(StreamType.GOSSIP, gossip)
        addr = await a.listen("127.0.0.1", 0)
        try:
            peer = await b.connect(addr)
            await _until(lambda: got == [b"hello early"], 3.0)
            assert peer.connected and b.stats.get("refused_not_admitted", 0) == 0
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_udp_sockets_ask_for_a_larger_receive_buffer(mesh: MeshCredentials) -> None:
    """The listening and the dialling socket get SO_RCVBUF raised (within the kernel's cap); 0 keeps the
    OS default."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        default = s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        if s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) <= default:
            pytest.skip("the kernel caps UDP receive buffers at their default")

    def rcvbuf(transport: Any) -> int:
        return int(transport.get_extra_info("socket").getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))

    async def scenario() -> None:
        server, client, plain = new_member(mesh), new_member(mesh), new_member(
            mesh, replace(FAST, udp_recv_buffer_bytes=0))
        addr = await server.listen("127.0.0.1", 0)
        try:
            await client.connect(addr)
            await plain.connect(addr)
            assert rcvbuf(server._server._transport) > default  # type: ignore[union-attr]
            assert rcvbuf(next(iter(client._conns))._transport) > default
            assert rcvbuf(next(iter(plain._conns))._transport) == default
        finally:
            for t in (server, client, plain):
                await t.close()

    asyncio.run(scenario())


def test_one_way_streams_free_their_slot_once_the_peer_ends_its_side(mesh: MeshCredentials) -> None:
    """A sender that only sends (``send(data, end=True)``, never ``recv``, as gossip does) gets its stream
    slot back once the peer's handler returns and ends its side: the per-peer cap counts open streams, not
    streams ever opened. (It leaked: every mesh's gossip hit the 256 cap ~36 s after connecting, and peers
    were declared dead and reconnected.)"""

    async def scenario() -> None:
        cap = 8
        server = new_member(mesh)
        got: list[bytes] = []

        async def take(peer: Peer, stream: Any) -> None:
            while (data := await stream.recv()) is not None:
                got.append(data)

        server.on_stream(StreamType.GOSSIP, take)
        addr = await server.listen("127.0.0.1", 0)
        client = new_member(mesh, replace(FAST, max_streams_per_peer=cap))
        try:
            peer = await client.connect(addr)
            conn = peer._conn
            for i in range(cap * 4):
                stream = await peer.open_stream(StreamType.GOSSIP)
                await stream.send(b"%d" % i, end=True)
                await _until(lambda: conn._open_streams(local=True) < cap, 5.0)
            await _until(lambda: conn._open_streams(local=True) == 0 and len(got) == cap * 4, 5.0)
        finally:
            await client.close()
            await server.close()

    asyncio.run(scenario())


def test_dialling_a_node_of_the_old_generation_says_so(mesh: MeshCredentials) -> None:
    async def scenario() -> None:
        old = new_member(mesh)
        real = old._quic_config

        def old_alpn(is_client: bool, loopback: bool = False) -> Any:
            cfg = real(is_client, loopback)
            cfg.alpn_protocols = ["meshd/1"]
            return cfg

        old._quic_config = old_alpn  # type: ignore[method-assign]
        addr = await old.listen("127.0.0.1", 0)
        b = new_member(mesh)
        try:
            with pytest.raises(TransportError, match="does not speak meshd/2"):
                await b.connect(addr)
        finally:
            await b.close()
            await old.close()

    asyncio.run(scenario())
