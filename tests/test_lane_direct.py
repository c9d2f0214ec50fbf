"""Direct channels (transport.lane_direct) on the lane port: real QUIC + TLS over TCP on loopback.

Covers: a direct channel dialled beside a lane carries whole messages both ways (small and 1 MiB) while the
lane keeps working; the proof against a TLS-terminating proxy (refused by the client; refused by the server
when a careless client signs what the proxy showed it); strangers (the magic then silence, a key that is no
member, a service nobody serves) dropped within the auth deadline and forgotten; a member that disconnects
has its channels closed, which wakes a thread blocked reading.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from typing import Any

import numpy as np
import pytest
from test_transport_lane import pair, roundtrip, wait_for

import transport.lane_conn as lane_conn
from transport import lane_direct
from transport.errors import TransportError
from transport.identity import NodeIdentity
from transport.lane_direct import DirectChannel
from transport.quic import StreamType

SERVICE = lane_direct.SERVICE_PIPELINE


def _echo_handler(served: list[str]) -> Any:
    def handler(peer: Any, ch: DirectChannel) -> None:
        served.append(peer.node_id)
        while (msg := ch.recv()) is not None:
            ch.send(msg)

    return handler


def test_direct_channel_carries_messages_beside_the_lane_and_closes_with_the_member() -> None:
    async def main() -> None:
        async with pair() as p:
            await wait_for(lambda: p.peer_of_b.path == "lane")
            served: list[str] = []
            p.lb.direct_handlers[SERVICE] = _echo_handler(served)
            ch = await p.la.dial_direct(p.peer_of_b, SERVICE)
            big = bytes(range(256)) * 4096  # 1 MiB

            def use() -> list[bytes | None]:
                out = []
                for msg in (b"hello", b"", big, b"x" * 5000):
                    ch.send(msg, 5.0)
                    out.append(ch.recv(5.0))
                return out

            assert await asyncio.to_thread(use) == [b"hello", b"", big, b"x" * 5000]

            def use_parts() -> list[Any]:  # parts joined on the way out (one record) or written corked where
                out = []  # they lie (longer); a message read into its own buffer, after ``lead`` zero bytes
                head, rows = b"h" * 36, np.arange(8192, dtype=np.float32).reshape(1, 8192)  # a RESULT's parts
                for parts, lead in (((b"ab", b"", b"c"), 0), ((big[:1000], memoryview(big)[1000:70000]), 0),
                                    ((big,), 0), ((head, rows), 12), ((b"", big[:20000]), 3), ((b"x",), 5)):
                    n = sum(memoryview(x).nbytes for x in parts)
                    ch.send_parts(parts, n, 5.0)
                    out.append(ch.recv_owned(5.0, lead))
                    if hasattr(socket, "TCP_CORK"):  # a corked message is pushed out whole, nothing held back
                        assert ch._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CORK) == 0
                for parts, n in (((b"abc",), 4), ((b"abc", big[:20000]), 20002)):
                    with pytest.raises(ValueError, match="said"):
                        ch.send_parts(parts, n, 5.0)
                return out

            got = await asyncio.to_thread(use_parts)
            assert got == [b"abc", big[:70000], big, bytes(12) + b"h" * 36 + np.arange(8192, dtype=np.float32).tobytes(),
                           bytes(3) + big[:20000], bytes(5) + b"x"]
            assert all(type(m) is bytearray for m in got)  # the caller's own buffers (a long one read into it)
            ch.send(b"abc", 5.0)
            assert type(await asyncio.to_thread(ch.recv, 5.0)) is bytes
            assert served == [p.a.identity.node_id]
            assert p.la.status()["direct_channels"] == 1 and p.lb.status()["direct_channels"] == 1
            s = await p.peer_of_b.open_stream(StreamType.EXPERT)  # the lane is untouched
            assert s.path == "lane" and await roundtrip(s, b"lane") == b"lane"
            # b's side blocks reading; a disconnects from b: b closes its channel and its reader wakes
            blocked = threading.Event()

            def read_until_closed() -> str:
                blocked.set()
                try:
                    ch.recv(10.0)
                except TransportError as e:
                    return str(e)
                return "ended"

            reader = asyncio.ensure_future(asyncio.to_thread(read_until_closed))
            await asyncio.to_thread(blocked.wait, 5)
            t0 = time.monotonic()
            p.lb._peer_down(p.peer_of_a)
            await asyncio.wait_for(reader, 5.0)
            assert time.monotonic() - t0 < 2.0
            await wait_for(lambda: p.lb.status()["direct_channels"] == p.la.status()["direct_channels"] == 0)

    asyncio.run(main())


class _TerminatingProxy:
    """Relays the direct channel's clear magic, then terminates TLS with its own key and opens its own TLS to
    the real lane port, relaying the plaintext both ways (threads, blocking sockets)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.ctx = lane_conn._server_context(NodeIdentity.generate())
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.address = ("127.0.0.1", self.srv.getsockname()[1])
        self.relayed = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        try:
            conn, _ = self.srv.accept()
        except OSError:
            return
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        try:
            magic = conn.recv(8)
            up = socket.create_connection(self.target)
            up.sendall(magic)
            down = self.ctx.wrap_socket(conn, server_side=True)
            upt = ctx.wrap_socket(up)
        except (OSError, ssl.SSLError):
            return

        def pipe(src: ssl.SSLSocket, dst: ssl.SSLSocket) -> None:
            try:
                while data := src.recv(65536):
                    self.relayed += len(data)
                    dst.sendall(data)
            except (OSError, ssl.SSLError):
                pass
            finally:
                for s in (src, dst):
                    try:
                        s.close()
                    except OSError:
                        pass

        threading.Thread(target=pipe, args=(upt, down), daemon=True).start()
        pipe(down, upt)

    def close(self) -> None:
        self.srv.close()


def test_tls_terminating_proxy_is_refused_by_the_client() -> None:
    async def main() -> None:
        async with pair() as p:
            await wait_for(lambda: p.peer_of_b.path == "lane")
            served: list[str] = []
            p.lb.direct_handlers[SERVICE] = _echo_handler(served)
            assert p.lb.address is not None
            proxy = _TerminatingProxy(p.lb.address)
            try:
                with pytest.raises(TransportError, match="not the peer's node key"):
                    await asyncio.to_thread(lane_direct.dial, p.a.identity, p.peer_of_b.public_key,
                                            proxy.address, SERVICE, lane_conn._client_context(), 3.0)
                assert served == []
            finally:
                proxy.close()

    asyncio.run(main())


def test_tls_terminating_proxy_is_refused_by_the_server_even_if_the_client_is_careless(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = lane_direct.lane_wire.verify

    def careless_client(public_key: bytes, signature: bytes, signer_is_client: bool, *rest: Any) -> None:
        if signer_is_client:  # the server checking the client: real
            real(public_key, signature, signer_is_client, *rest)

    async def main() -> None:
        async with pair() as p:
            await wait_for(lambda: p.peer_of_b.path == "lane")
            served: list[str] = []
            p.lb.direct_handlers[SERVICE] = _echo_handler(served)
            assert p.lb.address is not None
            proxy = _TerminatingProxy(p.lb.address)
            monkeypatch.setattr(lane_direct.lane_wire, "verify", careless_client)
            monkeypatch.setattr(lane_conn, "_cert_public_key", lambda der: p.peer_of_b.public_key)
            try:
                with pytest.raises(TransportError):
                    await asyncio.to_thread(lane_direct.dial, p.a.identity, p.peer_of_b.public_key,
                                            proxy.address, SERVICE, lane_conn._client_context(), 3.0)
                await wait_for(lambda: p.lb.stats.get("direct_refused_proof", 0) >= 1)
                assert proxy.relayed > 0  # the careless client's proof went through, and it failed
                assert served == [] and p.lb.status()["direct_channels"] == 0
            finally:
                proxy.close()

    asyncio.run(main())


def _closed_within(sock: socket.socket, timeout_s: float) -> float:
    t0 = time.monotonic()
    sock.settimeout(timeout_s)
    try:
        while sock.recv(65536):
            pass
    except (OSError, ssl.SSLError):
        pass
    return time.monotonic() - t0


def test_strangers_with_the_magic_are_dropped_within_the_deadline_and_forgotten() -> None:
    async def main() -> None:
        async with pair() as p:
            await wait_for(lambda: p.peer_of_b.path == "lane")
            served: list[str] = []
            p.lb.direct_handlers[SERVICE] = _echo_handler(served)
            assert p.lb.address is not None
            addr = p.lb.address

            def strangers() -> tuple[float, float, float, bytes]:
                # 1. the magic, then silence
                s1 = socket.create_connection(addr)
                s1.sendall(lane_direct.magic(SERVICE))
                silent = _closed_within(s1, 3.0)
                s1.close()
                # 2. a service nobody serves here: closed at once
                s2 = socket.create_connection(addr)
                s2.sendall(lane_direct.magic(99))
                unknown = _closed_within(s2, 3.0)
                s2.close()
                # 3. TLS and a hello from a key that is no connected member: refused
                s3 = socket.create_connection(addr)
                s3.sendall(lane_direct.magic(SERVICE))
                t3 = lane_conn._client_context().wrap_socket(s3)
                stranger = NodeIdentity.generate()
                t3.sendall(lane_direct.lane_wire.encode_hello(stranger.public_key, b"\0" * 32))
                t3.settimeout(2.0)
                reply = t3.recv(300)
                refused = _closed_within(t3, 2.0)
                t3.close()
                return silent, unknown, refused, reply

            silent, unknown, refused, reply = await asyncio.to_thread(strangers)
            assert silent < 1.8  # the 1 s auth deadline, headroom for a loaded machine
            assert unknown < 0.5
            assert reply[0] == 1 and b"not a connected member" in reply and refused < 1.0
            await wait_for(lambda: p.lb.status()["pending"] == 0 and p.lb._direct_slots.count == 0, 2.0)
            assert p.lb.stats.get("direct_refused", 0) == 1 and p.lb.stats.get("direct_refused_proof", 0) >= 2
            assert served == [] and p.lb.status()["direct_channels"] == 0
            assert p.lb.lane_count() == 1 and p.peer_of_a.path == "lane"  # the member's lane is untouched

    asyncio.run(main())


def _tls_channel_pair() -> tuple[DirectChannel, DirectChannel]:
    """Two ends of a direct channel over real TLS on loopback, without a lane (the proof is not what is tested)."""
    server_ctx = lane_conn._server_context(NodeIdentity.generate())
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.check_hostname, client_ctx.verify_mode = False, ssl.CERT_NONE
    listener = socket.create_server(("127.0.0.1", 0))
    got: list[DirectChannel] = []

    def accept() -> None:
        s, _ = listener.accept()
        got.append(DirectChannel(server_ctx.wrap_socket(s, server_side=True), "client", SERVICE, False))

    t = threading.Thread(target=accept)
    t.start()
    c = socket.create_connection(listener.getsockname())
    near = DirectChannel(client_ctx.wrap_socket(c), "server", SERVICE, True)
    t.join(5)
    listener.close()
    return near, got[0]


def test_recv_owned_ends_cleanly_between_messages_and_fails_inside_one() -> None:
    """A peer that closes (without a TLS close, as ``close`` does) after a whole message: the message, then None;
    inside a message: ``TransportError``, and the channel is closed."""
    near, far = _tls_channel_pair()
    far.send_parts((b"ab", b"c"), 3, 5.0)
    far.close()
    assert near.recv_owned(5.0, 2) == b"\0\0abc"
    assert near.recv_owned(5.0) is None and near.closed
    near, far = _tls_channel_pair()
    far._write(b"\0\0\0\x64" + b"x" * 10)  # a record header of 100 bytes, then 10 of them
    far.close()
    with pytest.raises(TransportError, match="inside a message"):
        near.recv_owned(5.0)
    assert near.closed
