"""The expert-RPC latency path of the transport: ``Stream.send_now``, receiver callbacks
(``set_receiver`` / ``pause_receiving`` / ``resume_receiving``), pending ACKs carried by data packets
(``MeshQuicConnection.ack_with_data``), and the same surface on the in-process ``SocketChannel``.

Two real ``MeshTransport`` in one loop over loopback QUIC, as in tests/test_transport_quic.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import pytest
from aioquic import tls
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from transport_peer import member_of

from engine.experts.channel import ChannelClosed, SocketChannel, socketpair_channels
from transport import ALPN
from transport.aioquic_ext import MeshQuicConnection
from transport.config import is_loopback_host
from transport.connection import _Connection
from transport.credentials import MeshCredentials, create_mesh
from transport.errors import RemoteError, RpcError, StreamReset, TransportError
from transport.framing import ErrorCode
from transport.identity import NodeIdentity
from transport.quic import MeshTransport, Peer, Stream, StreamType, TransportConfig

T0 = 1_700_000_000
FAST = replace(TransportConfig(), reconnect_min_s=0.1, reconnect_max_s=1.0)
WAIT_S = 5.0  # upper bound for any one awaited event; a healthy run takes milliseconds


@pytest.fixture(scope="module")
def mesh() -> MeshCredentials:
    return create_mesh(NodeIdentity.generate(), "test", T0, 1, 1)


def new_member(mesh: MeshCredentials, config: TransportConfig = FAST) -> MeshTransport:
    ident = NodeIdentity.generate()
    return MeshTransport(ident, member_of(mesh, ident), config)


async def _until(cond: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    """Poll a condition that no event reports (transport internals); fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)


class CountingTransport:
    """Wraps a datagram transport; counts what one connection sends through it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sent = 0

    def sendto(self, data: bytes, addr: Any = None) -> None:
        self.sent += 1
        self.inner.sendto(data, addr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def one_rtt(conn: _Connection) -> Any:
    """The connection's 1-RTT packet number space, where application data's ACKs are pending."""
    return conn._quic._spaces[tls.Epoch.ONE_RTT]


async def settle(*conns: _Connection) -> None:
    """Until no ACK is pending and nothing is in flight on these connections (a clean start to count)."""
    await _until(lambda: all(one_rtt(c).ack_at is None and c._quic._loss.bytes_in_flight == 0 for c in conns))


class Recorder:
    """A receiver that records its callbacks; ``ended`` resolves at the first ``on_end``."""

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.ends: list[Exception | None] = []
        self.ended: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
        self._changed = asyncio.Event()
        self.hook: Callable[[bytes], None] | None = None  # runs inside on_data, after recording

    def on_data(self, payload: bytes) -> None:
        self.data.append(payload)
        self._changed.set()
        if self.hook is not None:
            self.hook(payload)

    def on_end(self, error: Exception | None) -> None:
        self.ends.append(error)
        if not self.ended.done():
            self.ended.set_result(error)

    async def wait_data(self, n: int) -> None:
        """Until ``n`` payloads were delivered."""
        async with asyncio.timeout(WAIT_S):
            while len(self.data) < n:
                self._changed.clear()
                await self._changed.wait()

    async def wait_end(self) -> Exception | None:
        return await asyncio.wait_for(asyncio.shield(self.ended), WAIT_S)

    def joined(self) -> bytes:
        return b"".join(self.data)


@dataclass
class Served:
    """The server's side of one EXPERT stream: the stream and a gate that keeps its handler alive."""

    stream: Stream
    release: asyncio.Event


@dataclass
class Pair:
    server: MeshTransport
    client: MeshTransport
    peer: Peer  # the server, as seen by the client
    incoming: asyncio.Queue[Served]  # EXPERT streams the client opened, as the server sees them

    @property
    def client_conn(self) -> _Connection:
        assert self.peer._conn is not None
        return self.peer._conn

    @property
    def server_conn(self) -> _Connection:
        [conn] = [c for c in self.server._conns if c.admitted]
        return conn

    async def accept(self) -> Served:
        return await asyncio.wait_for(self.incoming.get(), WAIT_S)


@asynccontextmanager
async def pair(
    mesh: MeshCredentials,
    server_config: TransportConfig = FAST,
    client_config: TransportConfig = FAST,
    setup: Callable[[MeshTransport], None] | None = None,
) -> AsyncIterator[Pair]:
    """A server and a connected client. Unless ``setup`` registers its own, the server's EXPERT handler
    hands each stream to ``incoming`` and stays alive until the test sets the stream's ``release`` (a
    finished handler ends its stream and drops late input)."""
    server, client = new_member(mesh, server_config), new_member(mesh, client_config)
    incoming: asyncio.Queue[Served] = asyncio.Queue()
    releases: list[asyncio.Event] = []

    async def hold(peer: Peer, stream: Stream) -> None:
        release = asyncio.Event()
        releases.append(release)
        incoming.put_nowait(Served(stream, release))
        await release.wait()

    server.on_stream(StreamType.EXPERT, hold)
    if setup is not None:
        setup(server)
    addr = await server.listen("127.0.0.1", 0)
    try:
        peer = await client.connect(addr, expected_node_id=server.identity.node_id)
        yield Pair(server, client, peer, incoming)
    finally:
        for release in releases:
            release.set()
        await client.close()
        await server.close()


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 15.0))


def msg(i: int, size: int = 0) -> bytes:
    """A numbered payload, padded to ``size`` bytes (ordering and loss are visible in the content)."""
    head = b"m%06d:" % i
    return head + b"x" * max(0, size - len(head))


# -- send_now ----------------------------------------------------------------------------------------


def test_send_now_echo_round_trips_in_order_between_receivers(mesh: MeshCredentials) -> None:
    """Both ends use only send_now and receivers: 300 numbered messages come back in order, each once."""

    async def scenario() -> None:
        async with pair(mesh) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            assert stream.send_now(msg(0))
            served = await p.accept()
            assert stream.on_loopback and served.stream.on_loopback  # both ends see 127.0.0.1
            echo_failures: list[bytes] = []

            def echo(payload: bytes) -> None:
                if not served.stream.send_now(payload):
                    echo_failures.append(payload)

            echoer = Recorder()
            echoer.hook = echo
            served.stream.set_receiver(echoer.on_data, echoer.on_end)
            client = Recorder()
            stream.set_receiver(client.on_data, client.on_end)
            await client.wait_data(1)
            # a burst without yielding: aioquic's congestion window holds some back; order must survive
            for i in range(1, 300):
                assert stream.send_now(msg(i, 200))
            await client.wait_data(300)
            assert client.data == [msg(0)] + [msg(i, 200) for i in range(1, 300)]
            assert echoer.data == client.data and echo_failures == []
            await stream.end()
            assert await echoer.wait_end() is None
            assert echoer.ends == [None]
            assert client.ends == []  # the echo side has not ended yet
            served.release.set()  # its handler returns and ends the stream
            assert await client.wait_end() is None
            assert client.ends == [None]

    run(scenario)


def test_loopback_addresses_include_ipv4_seen_through_an_ipv6_socket() -> None:
    """What ``Stream.on_loopback`` (and the loopback packet size) go by: a peer's address as the socket
    reports it, so an IPv4 peer of a ``[::]`` listener (::ffff:127.0.0.1) is on loopback too."""
    assert is_loopback_host("127.0.0.1") and is_loopback_host("::1") and is_loopback_host("::ffff:127.0.0.1")
    assert is_loopback_host("fe80::1%lo") is False and is_loopback_host("::ffff:10.0.0.1") is False
    assert not is_loopback_host("10.0.0.1") and not is_loopback_host("0.0.0.0") and not is_loopback_host("node-a")


def test_send_now_refuses_when_the_send_buffer_is_full_and_loses_nothing(mesh: MeshCredentials) -> None:
    """A paused reader stops credit; send_now then answers False without sending, until the buffer drains."""
    limit, window, size = 64 * 1024, 128 * 1024, 16 * 1024

    async def scenario() -> None:
        async with pair(
            mesh,
            server_config=replace(FAST, quic_max_stream_data=window),
            client_config=replace(FAST, stream_send_buffer_bytes=limit),
        ) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            assert stream.send_now(msg(0, size))
            served = await p.accept()
            reader = Recorder()
            reader.hook = lambda _: served.stream.pause_receiving()
            served.stream.set_receiver(reader.on_data, reader.on_end)
            assert reader.data == [msg(0, size)]  # delivered, then the reader paused
            conn, sid = p.client_conn, stream.stream_id
            sent = 1
            while stream.send_now(msg(sent, size)):
                sent += 1
                assert sent < 200, "send_now never refused"
                await asyncio.sleep(0)  # let packets and ACKs flow, as a real caller would
            # refused only over the limit, and the refused message was not buffered
            pending = conn._pending_send_bytes(sid)
            assert pending > limit
            assert not stream.send_now(msg(sent, size))
            assert conn._pending_send_bytes(sid) == pending
            # the sender could not push more than the reader's window plus its own buffer
            assert (sent - 1) * size <= window + limit + size
            assert len(reader.data) == 1  # paused: nothing more delivered
            reader.hook = None
            served.stream.resume_receiving()
            await stream.send(msg(sent, size), end=True)  # the refused one, the slow way
            assert await reader.wait_end() is None
            assert reader.data == [msg(i, size) for i in range(sent + 1)]
            assert reader.ends == [None]

    run(scenario)


def test_send_now_hands_the_packet_to_the_socket_within_the_call(mesh: MeshCredentials) -> None:
    """No deferred transmit: the datagram is written before send_now returns (send() waits a loop turn)."""

    async def scenario() -> None:
        async with pair(mesh) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            await stream.send(b"open")
            served = await p.accept()
            got = Recorder()
            served.stream.set_receiver(got.on_data, got.on_end)
            await got.wait_data(1)
            await settle(p.client_conn, p.server_conn)
            conn = p.client_conn
            counter = CountingTransport(conn._transport)
            conn._transport = counter
            try:
                assert stream.send_now(b"now")
                assert counter.sent == 1
                await stream.send(b"later")
                assert counter.sent == 1  # queued for the end of the loop turn
                await got.wait_data(3)
            finally:
                conn._transport = counter.inner
            assert got.data == [b"open", b"now", b"later"]

    run(scenario)


def test_send_now_raises_once_the_stream_or_connection_is_gone(mesh: MeshCredentials) -> None:
    async def scenario() -> None:
        async with pair(mesh) as p:
            # peer reset
            stream = await p.peer.open_stream(StreamType.EXPERT)
            got = Recorder()
            stream.set_receiver(got.on_data, got.on_end)
            assert stream.send_now(b"hello")
            served = await p.accept()
            served.stream.reset(ErrorCode.CANCELLED)
            err = await got.wait_end()
            assert isinstance(err, StreamReset) and err.code == ErrorCode.CANCELLED
            with pytest.raises(StreamReset):
                stream.send_now(b"after reset")
            # our own end
            ended = await p.peer.open_stream(StreamType.EXPERT)
            await ended.send(b"bye", end=True)
            with pytest.raises(TransportError, match="already ended"):
                ended.send_now(b"after end")
            # connection gone
            live = await p.peer.open_stream(StreamType.EXPERT)
            assert live.send_now(b"x")
            await p.client.disconnect(p.peer.node_id, "test")
            with pytest.raises(TransportError):
                live.send_now(b"after close")

    run(scenario)


# -- set_receiver ------------------------------------------------------------------------------------


def test_frames_queued_before_set_receiver_come_first_and_in_order(mesh: MeshCredentials) -> None:
    async def scenario() -> None:
        async with pair(mesh) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            for i in range(5):
                await stream.send(msg(i))
            served = await p.accept()
            await _until(lambda: len(served.stream._frames) == 5)
            got = Recorder()
            served.stream.set_receiver(got.on_data, got.on_end)
            assert got.data == [msg(i) for i in range(5)]  # delivered within the call
            assert not served.stream._frames
            for i in range(5, 10):
                stream.send_now(msg(i))
            await stream.end()
            assert await got.wait_end() is None
            assert got.data == [msg(i) for i in range(10)]
            assert got.ends == [None]

    run(scenario)


def test_clean_end_calls_on_end_none_exactly_once(mesh: MeshCredentials) -> None:
    """Queued before set_receiver or arriving later, the end is reported once; a later close adds nothing."""

    async def scenario() -> None:
        async with pair(mesh) as p:
            queued = await p.peer.open_stream(StreamType.EXPERT)
            await queued.send(b"only", end=True)
            served = await p.accept()
            await _until(lambda: served.stream._ended)
            early = Recorder()
            served.stream.set_receiver(early.on_data, early.on_end)
            assert early.data == [b"only"] and early.ends == [None]  # both within the call
            live = await p.peer.open_stream(StreamType.EXPERT)
            live.send_now(b"a")
            served2 = await p.accept()
            late = Recorder()
            served2.stream.set_receiver(late.on_data, late.on_end)
            await late.wait_data(1)
            assert late.ends == []
            await live.send(b"b", end=True)
            assert await late.wait_end() is None
            conn = p.client_conn
            await p.client.disconnect(p.peer.node_id, "test")
            await asyncio.wait_for(conn.finished.wait(), WAIT_S)
            await _until(lambda: all(c.closed for c in p.server._conns))
            assert early.ends == [None]
            assert late.data == [b"a", b"b"] and late.ends == [None]

    run(scenario)


def test_peer_reset_calls_on_end_with_stream_reset(mesh: MeshCredentials) -> None:
    async def scenario() -> None:
        async with pair(mesh) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            stream.send_now(b"a")
            served = await p.accept()
            got = Recorder()
            served.stream.set_receiver(got.on_data, got.on_end)
            stream.reset(ErrorCode.CANCELLED)
            err = await got.wait_end()
            assert isinstance(err, StreamReset) and err.code == ErrorCode.CANCELLED
            assert got.data == [b"a"] and got.ends == [err]

    run(scenario)


def test_remote_error_frame_calls_on_end_with_remote_error(mesh: MeshCredentials) -> None:
    """An RPC handler's RpcError arrives as an ERROR frame: on_end(RemoteError(code, reason)), once."""

    def setup(server: MeshTransport) -> None:
        async def refuse(peer: Peer, request: bytes) -> bytes:
            raise RpcError(42, "not today: " + request.decode())

        server.on_rpc(StreamType.RPC, refuse)

    async def scenario() -> None:
        async with pair(mesh, setup=setup) as p:
            stream = await p.peer.open_stream(StreamType.RPC)
            got = Recorder()
            stream.set_receiver(got.on_data, got.on_end)
            assert stream.send_now(b"hello")
            err = await got.wait_end()
            assert isinstance(err, RemoteError) and (err.code, err.reason) == (42, "not today: hello")
            assert got.data == [] and got.ends == [err]

    run(scenario)


def test_connection_loss_calls_on_end_with_transport_error_on_both_sides(mesh: MeshCredentials) -> None:
    async def scenario() -> None:
        async with pair(mesh) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            stream.send_now(b"a")
            served = await p.accept()
            near, far = Recorder(), Recorder()
            stream.set_receiver(near.on_data, near.on_end)
            served.stream.set_receiver(far.on_data, far.on_end)
            await p.client.disconnect(p.peer.node_id, "maintenance")
            for got in (near, far):
                err = await got.wait_end()
                assert type(err) is TransportError and "connection closed" in str(err)
                assert got.ends == [err]

    run(scenario)


def test_raising_on_data_resets_the_stream_and_calls_on_end_once(mesh: MeshCredentials) -> None:
    """The bug stays on its stream: the peer sees INTERNAL_ERROR, the connection keeps working."""

    async def scenario() -> None:
        async with pair(mesh) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            sender = Recorder()
            stream.set_receiver(sender.on_data, sender.on_end)
            stream.send_now(b"fine")
            served = await p.accept()
            got = Recorder()

            def explode(payload: bytes) -> None:
                if payload == b"boom":
                    raise ValueError("receiver bug")

            got.hook = explode
            served.stream.set_receiver(got.on_data, got.on_end)
            stream.send_now(b"boom")
            stream.send_now(b"after")
            err = await got.wait_end()
            assert type(err) is TransportError and "receiver bug" in str(err)
            reset = await sender.wait_end()
            assert isinstance(reset, StreamReset) and reset.code == ErrorCode.INTERNAL_ERROR
            assert got.data == [b"fine", b"boom"] and got.ends == [err]
            assert p.peer.connected
            s2 = await p.peer.open_stream(StreamType.EXPERT)
            s2.send_now(b"still up")
            served2 = await p.accept()
            got2 = Recorder()
            served2.stream.set_receiver(got2.on_data, got2.on_end)
            await got2.wait_data(1)
            assert got2.data == [b"still up"] and got.ends == [err]

    run(scenario)


def test_raising_on_end_is_not_called_again(mesh: MeshCredentials) -> None:
    """on_end runs once even when it raises (the failure is logged, not reported back to it)."""

    async def scenario() -> None:
        async with pair(mesh) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            await stream.send(b"x", end=True)
            served = await p.accept()
            ends: list[Exception | None] = []

            def on_end(error: Exception | None) -> None:
                ends.append(error)
                raise ValueError("on_end bug")

            served.stream.set_receiver(lambda _: None, on_end)
            assert ends == [None]  # within the call, and only once

    run(scenario)


def test_local_reset_inside_on_data_ends_delivery_with_one_on_end(mesh: MeshCredentials) -> None:
    """A receiver that resets its stream (as WorkerLink.close does on a protocol error) gets no more data
    and exactly one on_end(StreamReset), even with frames still queued behind the one being delivered."""

    async def scenario() -> None:
        async with pair(mesh) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            for i in range(5):
                await stream.send(msg(i))
            served = await p.accept()
            await _until(lambda: len(served.stream._frames) == 5)
            got = Recorder()
            got.hook = lambda payload: served.stream.reset(ErrorCode.CANCELLED) if payload == msg(1) else None
            served.stream.set_receiver(got.on_data, got.on_end)
            assert got.data == [msg(0), msg(1)]
            assert len(got.ends) == 1 and isinstance(got.ends[0], StreamReset)
            assert got.ends[0].code == ErrorCode.CANCELLED

    run(scenario)


# -- pause / resume ------------------------------------------------------------------------------------


def test_pause_queues_input_stops_credit_and_resume_delivers_in_order(mesh: MeshCredentials) -> None:
    """While paused: nothing is delivered, the reader holds at most one window, no credit is granted and
    the sender's send() blocks with its buffer over the limit. resume delivers everything in order."""
    limit, window, size, count = 64 * 1024, 256 * 1024, 32 * 1024, 48  # 1.5 MiB > window + buffer

    async def scenario() -> None:
        async with pair(
            mesh,
            server_config=replace(FAST, quic_max_stream_data=window),
            client_config=replace(FAST, stream_send_buffer_bytes=limit),
        ) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            await stream.send(msg(0, size))
            served = await p.accept()
            got = Recorder()
            served.stream.pause_receiving()
            served.stream.set_receiver(got.on_data, got.on_end)
            assert got.data == []  # paused before: queued frames stay queued

            async def send_all() -> None:
                for i in range(1, count):
                    await stream.send(msg(i, size))
                await stream.end()

            sender = asyncio.ensure_future(send_all())
            conn, sid = p.client_conn, stream.stream_id
            remote = served.stream
            qstream = p.server_conn._quic._streams[remote.stream_id]
            # the sender stalls: the reader's window is full and its own buffer is over the limit
            await _until(
                lambda: remote._raw_received >= window - 64 and conn._pending_send_bytes(sid) > limit
            )
            assert not sender.done()
            assert got.data == [] and got.ends == []
            assert remote._queued_bytes <= window
            assert qstream.max_stream_data_local == window  # no credit beyond the first window
            served.stream.resume_receiving()
            await asyncio.wait_for(sender, WAIT_S)
            assert await got.wait_end() is None
            assert got.data == [msg(i, size) for i in range(count)]
            assert got.ends == [None]

    run(scenario)


def test_pause_inside_on_data_holds_the_rest_of_a_batch(mesh: MeshCredentials) -> None:
    """Pausing in on_data stops delivery after that frame, even when more frames came in the same packet;
    frames queue until resume, which delivers them and the end in order, within the call."""

    async def scenario() -> None:
        async with pair(mesh) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            stream.send_now(msg(0))
            served = await p.accept()
            got = Recorder()
            got.hook = lambda payload: served.stream.pause_receiving() if payload == msg(2) else None
            served.stream.set_receiver(got.on_data, got.on_end)
            for i in range(1, 8):
                await stream.send(msg(i))  # coalesced: several frames per packet
            await stream.end()
            await _until(lambda: served.stream._ended)
            assert got.data == [msg(0), msg(1), msg(2)] and got.ends == []
            assert len(served.stream._frames) == 5
            got.hook = None
            served.stream.resume_receiving()
            assert got.data == [msg(i) for i in range(8)] and got.ends == [None]

    run(scenario)


def test_a_paused_receiver_hears_of_the_end_only_on_resume(mesh: MeshCredentials) -> None:
    """on_end is input too: a clean end or a peer reset that arrives while paused is reported at resume."""

    async def scenario() -> None:
        async with pair(mesh) as p:
            results: list[Exception | None] = []
            for finish in ("end", "reset"):
                stream = await p.peer.open_stream(StreamType.EXPERT)
                stream.send_now(b"a")
                served = await p.accept()
                got = Recorder()
                served.stream.set_receiver(got.on_data, got.on_end)
                await got.wait_data(1)
                served.stream.pause_receiving()
                if finish == "end":
                    await stream.end()
                    await _until(lambda: served.stream._ended)
                else:
                    stream.reset(ErrorCode.CANCELLED)
                    await _until(lambda: served.stream._error is not None)
                assert got.ends == []
                served.stream.resume_receiving()
                assert len(got.ends) == 1 and got.data == [b"a"]
                results.append(got.ends[0])
            assert results[0] is None
            assert isinstance(results[1], StreamReset) and results[1].code == ErrorCode.CANCELLED

    run(scenario)


def test_pause_and_resume_inside_on_data_deliver_each_frame_once(mesh: MeshCredentials) -> None:
    """A receiver that pauses and resumes within one on_data (a compute that finished at once) still gets
    every frame once, in order, and a single on_end."""

    async def scenario() -> None:
        async with pair(mesh) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            for i in range(6):
                await stream.send(msg(i))
            await stream.end()
            served = await p.accept()
            await _until(lambda: served.stream._ended)
            got = Recorder()

            def blip(payload: bytes) -> None:
                if payload == msg(2):
                    served.stream.pause_receiving()
                    served.stream.resume_receiving()

            got.hook = blip
            served.stream.set_receiver(got.on_data, got.on_end)
            assert got.data == [msg(i) for i in range(6)]
            assert got.ends == [None]

    run(scenario)


def test_paused_reader_that_never_resumes_is_reset_by_the_queue_limit(mesh: MeshCredentials) -> None:
    """The receive-queue limit still applies to a paused receiver when it is below the stream window
    (with the defaults, 8 MiB queue vs 1 MiB window, flow control alone bounds the queue): the sender sees
    RECV_OVERFLOW; a later resume delivers what was queued and then on_end(StreamReset), once."""
    queue_limit, size = 256 * 1024, 64 * 1024

    async def scenario() -> None:
        async with pair(mesh, server_config=replace(FAST, stream_recv_queue_bytes=queue_limit)) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            stream.send_now(msg(0, size))
            served = await p.accept()
            got = Recorder()
            served.stream.pause_receiving()
            served.stream.set_receiver(got.on_data, got.on_end)
            with pytest.raises(StreamReset) as err:
                for i in range(1, 64):
                    await stream.send(msg(i, size))
            assert err.value.code == ErrorCode.RECV_OVERFLOW
            assert p.server.stats["streams_reset_recv_overflow"] == 1
            assert got.data == [] and got.ends == []  # never resumed: nothing delivered, no callback
            served.stream.resume_receiving()
            end = await got.wait_end()
            assert isinstance(end, StreamReset) and end.code == ErrorCode.RECV_OVERFLOW
            assert got.ends == [end]
            assert got.data == [msg(i, size) for i in range(len(got.data))]
            assert len(got.data) * size > queue_limit

    run(scenario)


# -- pending ACKs ride on data -------------------------------------------------------------------------


ROUNDS = 40
ACK_DELAY_S = 0.025  # the replier's ACK delay, as large as the max_ack_delay aioquic advertises


async def ping_pong(p: Pair, stream: Stream, replier: _Connection) -> CountingTransport:
    """``ROUNDS`` request/reply exchanges, each request sent from the previous reply's callback; returns the
    replier's datagram count, read once it has no ACK pending any more."""
    got = Recorder()
    done = asyncio.get_running_loop().create_future()
    replies: list[bytes] = []

    def next_request(payload: bytes) -> None:
        if not payload.startswith(b"m"):
            return  # a warm-up reply
        replies.append(payload)
        if len(replies) < ROUNDS:
            assert stream.send_now(msg(len(replies), 100))
        else:
            done.set_result(None)

    got.hook = next_request
    stream.set_receiver(got.on_data, got.on_end)
    # warm-up round trips (stream opening, first credit), then a quiet connection
    for i in range(3):
        await stream.send(b"warm%d" % i)
        await got.wait_data(i + 1)
    await settle(replier, p.client_conn)
    counter = CountingTransport(replier._transport)
    replier._transport = counter
    replier._quic._ack_delay = ACK_DELAY_S  # every reply below goes out well within the ACK delay
    try:
        assert stream.send_now(msg(0, 100))
        await asyncio.wait_for(done, WAIT_S)
        await _until(lambda: one_rtt(replier).ack_at is None)  # a held-back ACK would go out by now
    finally:
        replier._transport = counter.inner
    assert replies == [msg(i, 100) for i in range(ROUNDS)]
    return counter


def test_replies_sent_with_send_now_carry_the_pending_ack(mesh: MeshCredentials) -> None:
    """One datagram per reply: the ACK of the request rides on it, no ACK-only packet follows."""

    async def scenario() -> None:
        async with pair(mesh) as p:
            stream = await p.peer.open_stream(StreamType.EXPERT)
            stream.send_now(b"open")
            served = await p.accept()
            echo = Recorder()
            echo.hook = lambda payload: None if payload == b"open" else served.stream.send_now(payload)
            served.stream.set_receiver(echo.on_data, echo.on_end)
            counter = await ping_pong(p, stream, p.server_conn)
            assert counter.sent == ROUNDS

    run(scenario)


def test_replies_sent_with_send_carry_the_pending_ack(mesh: MeshCredentials) -> None:
    """The same through the task path (recv, then send from the handler): ``write`` carries the ACK too."""

    def setup(server: MeshTransport) -> None:
        async def echo(peer: Peer, stream: Stream) -> None:
            while (payload := await stream.recv()) is not None:
                await stream.send(payload)

        server.on_stream(StreamType.HTTP_TUNNEL, echo)

    async def scenario() -> None:
        async with pair(mesh, setup=setup) as p:
            stream = await p.peer.open_stream(StreamType.HTTP_TUNNEL)
            counter = await ping_pong(p, stream, p.server_conn)
            assert counter.sent == ROUNDS

    run(scenario)


def _mesh_quic() -> MeshQuicConnection:
    quic = QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=[ALPN]))
    quic.__class__ = MeshQuicConnection
    assert isinstance(quic, MeshQuicConnection)
    return quic


def test_ack_with_data_only_moves_a_pending_ack_earlier() -> None:
    quic = _mesh_quic()
    quic.ack_with_data(1.0)  # no packet spaces yet: nothing to do, no error
    quic.connect(("127.0.0.1", 9), now=0.0)
    spaces = quic._spaces
    space = spaces[tls.Epoch.ONE_RTT]
    # nothing pending: nothing set
    assert space.ack_at is None
    quic.ack_with_data(5.0)
    assert space.ack_at is None
    # pending later than now: due now
    space.ack_at = 5.001
    quic.ack_with_data(5.0)
    assert space.ack_at == 5.0
    # already due (or overdue): never moved later
    space.ack_at = 4.0
    quic.ack_with_data(5.0)
    assert space.ack_at == 4.0
    # other packet number spaces are left alone
    spaces[tls.Epoch.INITIAL].ack_at = 9.0
    spaces[tls.Epoch.HANDSHAKE].ack_at = 9.0
    quic.ack_with_data(5.0)
    assert (spaces[tls.Epoch.INITIAL].ack_at, spaces[tls.Epoch.HANDSHAKE].ack_at) == (9.0, 9.0)


def test_ack_with_data_leaves_a_discarded_space_alone() -> None:
    """Before the handshake the ONE_RTT space may be missing; the call must not create or touch one."""
    quic = _mesh_quic()
    quic._spaces = {}
    quic.ack_with_data(1.0)
    assert quic._spaces == {}


# -- SocketChannel (in-process expert tests) -----------------------------------------------------------


async def settle_reader(ch: SocketChannel) -> None:
    """Until the channel's reader has seen the end of input, then a few loop turns for its receiver task
    to act on what it read (a paused receiver must not)."""
    await _until(lambda: ch._reader._eof)
    for _ in range(5):
        await asyncio.sleep(0)


def test_socket_channel_send_now_and_receiver_round_trip() -> None:
    async def scenario() -> None:
        a, b = await socketpair_channels()
        await a.send(b"before-receiver:")  # queued before set_receiver: comes first
        got = Recorder()
        b.set_receiver(got.on_data, got.on_end)
        payload = b"".join(msg(i, 100) for i in range(200))
        for i in range(200):
            assert a.send_now(msg(i, 100))
        await a.send(b"", end=True)
        assert await got.wait_end() is None
        assert got.joined() == b"before-receiver:" + payload
        assert got.ends == [None]
        b.reset(0)
        assert got.ends == [None]  # a reset after the end does not call on_end again

    run(scenario)


def test_socket_channel_send_now_refuses_over_its_buffer_and_loses_nothing() -> None:
    async def scenario() -> None:
        a, b = await socketpair_channels()
        chunk = 256 * 1024
        sent: list[bytes] = []
        while a.send_now(bytes([len(sent) % 251]) * chunk):  # nobody reads b yet
            sent.append(bytes([len(sent) % 251]) * chunk)
            assert len(sent) < 64, "send_now never refused"
        assert len(sent) * chunk > SocketChannel.SEND_BUFFER_BYTES
        got = Recorder()
        b.set_receiver(got.on_data, got.on_end)
        await a.send(b"tail", end=True)
        assert await got.wait_end() is None
        assert got.joined() == b"".join(sent) + b"tail"

    run(scenario)


def test_socket_channel_pause_holds_input_until_resume() -> None:
    """Paused at any moment (also while the receiver waits for input), nothing is delivered until resume."""

    async def scenario() -> None:
        a, b = await socketpair_channels()
        got = Recorder()
        b.set_receiver(got.on_data, got.on_end)
        a.send_now(b"one")
        await got.wait_data(1)
        b.pause_receiving()  # from outside a callback, while the receiver waits for input
        a.send_now(b"two")
        await a.send(b"three", end=True)
        await settle_reader(b)
        assert got.joined() == b"one" and got.ends == []
        b.resume_receiving()
        assert await got.wait_end() is None
        assert got.joined() == b"onetwothree" and got.ends == [None]

    run(scenario)


def test_socket_channel_pause_inside_on_data() -> None:
    async def scenario() -> None:
        a, b = await socketpair_channels()
        got = Recorder()
        got.hook = lambda _: b.pause_receiving()
        b.set_receiver(got.on_data, got.on_end)
        a.send_now(b"first")
        await got.wait_data(1)
        await a.send(b"second", end=True)
        await settle_reader(b)
        assert got.data == [b"first"] and got.ends == []
        got.hook = None
        b.resume_receiving()
        assert await got.wait_end() is None
        assert got.joined() == b"firstsecond"

    run(scenario)


def test_socket_channel_reset_ends_the_receiver_once() -> None:
    async def scenario() -> None:
        # local reset while waiting for input
        a, b = await socketpair_channels()
        got = Recorder()
        b.set_receiver(got.on_data, got.on_end)
        b.reset(0)
        err = await got.wait_end()
        assert isinstance(err, ChannelClosed) and got.ends == [err]
        with pytest.raises(ChannelClosed):
            b.send_now(b"after reset")
        # the far side learns that its input ended (a socket pair cannot tell a reset from an end)
        far = Recorder()
        a.set_receiver(far.on_data, far.on_end)
        await far.wait_end()
        assert len(far.ends) == 1

    run(scenario)


def test_socket_channel_reset_inside_on_data_stops_delivery() -> None:
    """A receiver that resets its channel from on_data (WorkerLink.close) gets no more data and one on_end
    with ChannelClosed, not a clean end."""

    async def scenario() -> None:
        a, b = await socketpair_channels()
        got = Recorder()
        got.hook = lambda payload: b.reset(0) if payload.startswith(b"first") else None
        a.send_now(b"first")
        b.set_receiver(got.on_data, got.on_end)
        await got.wait_data(1)
        a.send_now(b"second")
        err = await got.wait_end()
        assert isinstance(err, ChannelClosed), err
        assert got.joined() == b"first" and got.ends == [err]

    run(scenario)


def test_socket_channel_raising_on_data_resets_and_ends_once() -> None:
    async def scenario() -> None:
        a, b = await socketpair_channels()
        got = Recorder()

        def explode(payload: bytes) -> None:
            raise ValueError("receiver bug")

        got.hook = explode
        b.set_receiver(got.on_data, got.on_end)
        far = Recorder()
        a.set_receiver(far.on_data, far.on_end)
        a.send_now(b"boom")
        err = await got.wait_end()
        assert isinstance(err, ChannelClosed) and "receiver bug" in str(err)
        assert got.ends == [err]
        await far.wait_end()  # the channel was reset: the far side's input ends too
        assert len(far.ends) == 1
        with pytest.raises(ChannelClosed):
            b.send_now(b"after")

    run(scenario)
