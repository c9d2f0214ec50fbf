"""The asyncio QUIC layer (aioquic): authenticated connections, typed streams, RPC, keep-alive.

``MeshTransport`` and ``Peer``, the API. With ``transport.connection`` (one QUIC connection: it feeds the
sans-I/O cores ``framing`` and ``handshake`` and closes on every ``RemoteProtocolError`` with its code, in
``_Connection._fail``), ``transport.stream`` (a typed stream) and ``transport.poll``, the asyncio modules
of ``transport``. See docs/DESIGN.md (API) and docs/transport.md (behaviour, limits).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import structlog
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from transport import ALPN, ALPN_RETIRED, PROTOCOL_VERSION
from transport.admission import hint_key, make_hint
from transport.config import TransportConfig, backoff_delay_s, is_loopback_host
from transport.connection import _Connection
from transport.credentials import MemberCert, MeshCredentials
from transport.errors import (
    HandshakeRefused,
    JoinRefused,
    RemoteError,
    RpcError,
    StreamReset,
    TransportError,
)
from transport.framing import (
    ErrorCode,
    FrameType,
    decode_error,
    encode_error,
)
from transport.handshake import Admission, Mode, PeerAdmitted, mesh_key, tls_binding
from transport.identity import NodeIdentity
from transport.ratelog import RateLimitedLog, route_aioquic_logs
from transport.server import MeshServer
from transport.stream import Stream
from transport.stream_api import PATH_LANE, PATH_QUIC, PATH_RELAY
from transport.streams import (HANDSHAKE_STREAM_TYPES, LANE_ACCEPTED_TYPES, LANE_STREAM_TYPES, StreamType,
                               max_frame_bytes)
from transport.tls import certificate_der, self_signed_certificate

__all__ = [
    "HandshakeRefused",
    "JoinRefused",
    "MeshTransport",
    "Peer",
    "RemoteError",
    "RpcError",
    "Stream",
    "StreamReset",
    "StreamType",
    "TransportConfig",
    "TransportError",
    "backoff_delay_s",
]

log = structlog.get_logger("meshd.transport")

Address = tuple[str, int]
JoinHandler = Callable[[bytes, bytes], Awaitable[bytes]]
StreamHandler = Callable[["Peer", "Stream"], Awaitable[None]]
RpcHandler = Callable[["Peer", bytes], Awaitable[bytes]]
PeerCallback = Callable[["Peer"], Any]


def _maybe_task(result: Any, tasks: set[asyncio.Task[Any]]) -> None:
    if inspect.isawaitable(result):
        task = asyncio.ensure_future(result)
        tasks.add(task)
        task.add_done_callback(_finish_task(tasks))


def _finish_task(tasks: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("transport_callback_failed", error=repr(task.exception()))

    return done


class Peer:
    """An admitted member. Stable per node id; re-attached when it reconnects."""

    def __init__(self, mesh: MeshTransport, node_id: str, public_key: bytes) -> None:
        self._mesh = mesh
        self.node_id = node_id
        self.public_key = public_key
        self.cert: MemberCert | None = None
        self.protocol_version = PROTOCOL_VERSION
        self._conn: _Connection | None = None
        self._lane: Any = None  # a transport.lane.LaneConnection while a data lane to this peer is up
        self._down_timer: asyncio.TimerHandle | None = None  # a down report held back (see _terminated)

    def __repr__(self) -> str:
        return f"Peer({self.node_id}, connected={self.connected})"

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closing

    @property
    def address(self) -> Address | None:
        return self._conn.remote_address if self._conn is not None else None

    @property
    def rtt_ms(self) -> float | None:
        return self._conn.rtt_ms if self._conn is not None else None

    @property
    def path(self) -> str:
        """What carries this peer's lane stream types now: "lane" while a data lane is up, else "quic"."""
        lane = self._lane
        if lane is not None and lane.open and not lane.closed:
            return PATH_LANE
        conn = self._conn
        return conn.path if conn is not None else PATH_QUIC  # "relay" through a member, else "quic"

    def _connection(self) -> _Connection:
        conn = self._conn
        if conn is None or conn.closing:
            raise TransportError(f"peer {self.node_id} is not connected")
        return conn

    async def open_stream(self, stream_type: StreamType, lane: bool | None = None) -> Stream:
        """Open a typed stream (its preamble goes out with the first frame). It goes over the peer's data
        lane while one is up if ``lane`` (default: for ``LANE_STREAM_TYPES``; True is honoured for
        ``LANE_ACCEPTED_TYPES``, False keeps it on QUIC), over QUIC otherwise."""
        if stream_type in HANDSHAKE_STREAM_TYPES:
            raise ValueError("handshake streams are opened by the transport")
        on_lane = stream_type in LANE_STREAM_TYPES if lane is None else lane and stream_type in LANE_ACCEPTED_TYPES
        lane_conn = self._lane
        if on_lane and lane_conn is not None and lane_conn.open and not lane_conn.closed:
            try:
                return lane_conn.open_stream(StreamType(stream_type))  # type: ignore[no-any-return]
            except TransportError:
                pass  # the lane just closed or is full: QUIC carries it
        return self._connection().open_stream(StreamType(stream_type))

    async def request(self, stream_type: StreamType, payload: bytes, timeout_s: float) -> bytes:
        """Send one request frame, await one reply frame. On timeout or cancellation the stream is reset.

        Raises ``TimeoutError``, ``RemoteError`` (the handler answered an error), ``StreamReset``, or
        ``TransportError``.
        """
        stream = await self.open_stream(stream_type)
        try:
            async with asyncio.timeout(timeout_s):
                await stream.send(payload, end=True)
                frame = await stream.recv_frame()
        except (TimeoutError, asyncio.CancelledError):
            stream.reset(ErrorCode.CANCELLED)
            raise
        finally:
            self._mesh._forget_stream(stream)
        if frame is None:
            raise TransportError("stream ended without a reply")
        if frame.type is FrameType.ERROR:
            code, reason = decode_error(frame.payload)
            raise RemoteError(code, reason)
        return frame.payload



def _grow_recv_buffer(transport: asyncio.BaseTransport, size: int) -> None:
    """Ask for a ``size``-byte kernel receive buffer on a UDP socket (never shrinking it); the kernel may
    grant less. See ``limits.UDP_RECV_BUFFER_BYTES`` for why."""
    sock = transport.get_extra_info("socket")
    if sock is None or size <= 0:
        return
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) < size:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)
    except OSError as e:  # a platform refusing the size keeps its default
        log.debug("transport_recv_buffer_refused", size=size, error=repr(e))


class MeshTransport:
    """Authenticated QUIC between members of one mesh. See docs/DESIGN.md for the contract."""

    def __init__(
        self,
        identity: NodeIdentity,
        credentials: MeshCredentials | None,
        config: TransportConfig | None = None,
        *,
        admission: Admission | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.identity = identity
        self.credentials = credentials
        self.config = config or TransportConfig()
        self.admission = admission
        self.on_peer_up: list[PeerCallback] = []
        self.on_peer_down: list[PeerCallback] = []
        self.stats: dict[str, int] = {}
        self._rng = rng or random.Random()
        self._tls_cert = self_signed_certificate(identity)
        self._tls_binding = tls_binding(certificate_der(self._tls_cert))
        self._server: MeshServer | None = None
        self._conns: set[_Connection] = set()
        self._known: dict[str, Peer] = {}
        self._stream_handlers: dict[StreamType, StreamHandler] = {}
        self._rpc_handlers: dict[StreamType, RpcHandler] = {}
        self._join_handler: JoinHandler | None = None
        self._keep: dict[str, asyncio.Task[None]] = {}
        self._up_events: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ratelog = RateLimitedLog(log, self.config.log_interval_s)
        route_aioquic_logs(log, self.config.log_interval_s, time.monotonic)
        self._closing = False
        self.lane: Any = None  # the transport.lane.LaneManager, when this node runs data lanes
        self.relay: Any = None  # the transport.relay.RelayManager, when this node relays / is relayed
        self.on_dial_failed: list[Callable[[str, Address], Any]] = []  # (node_id, addr): a pinned dial failed
        self.on_path_change: list[PeerCallback] = []  # a connected peer's connection moved (relayed -> direct)

    # -- configuration ---------------------------------------------------------------------------

    def on_stream(self, stream_type: StreamType, handler: StreamHandler) -> None:
        """Serve incoming streams of this type: ``async handler(peer, stream)``."""
        self._stream_handlers[StreamType(stream_type)] = handler

    def on_rpc(self, stream_type: StreamType, handler: RpcHandler) -> None:
        """Serve requests of this type: ``async handler(peer, request) -> reply`` (raise RpcError to refuse)."""
        self._rpc_handlers[StreamType(stream_type)] = handler

    def set_credentials(self, creds: MeshCredentials) -> None:
        self.credentials = creds

    def set_join_handler(self, handler: JoinHandler | None) -> None:
        self._join_handler = handler

    # -- lifecycle -------------------------------------------------------------------------------

    def _quic_config(self, is_client: bool, loopback: bool = False, hint: bool = False) -> QuicConfiguration:
        size = self.config.max_datagram_size
        if loopback and self.config.loopback_datagram_size:
            size = self.config.loopback_datagram_size
        cfg = QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[ALPN] if is_client else [ALPN, *ALPN_RETIRED],  # old peers are told, then closed
            idle_timeout=self.config.idle_timeout_s,
            max_datagram_size=size,
            max_data=self.config.quic_max_data,
            max_stream_data=self.config.quic_max_stream_data,
        )
        if is_client:
            cfg.verify_mode = ssl.CERT_NONE  # the meshd handshake authenticates, bound to this cert
            if hint and self.credentials is not None:  # priority at a busy node, blinded (see admission)
                key = hint_key(mesh_key(self.credentials.genesis.encoded))
                cfg.token = make_hint(key, time.time(), os.urandom(8))
        else:
            cfg.certificate = self._tls_cert
            cfg.private_key = self.identity.private_key()
        return cfg

    async def listen(self, host: str, port: int) -> Address:
        """Bind the QUIC server; returns the address actually bound."""
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: MeshServer(
                    mesh=self,
                    configuration=self._quic_config(False),
                    create_protocol=partial(_Connection, mesh=self, is_client=False),
                ),
                local_addr=(host, port),
            )
        except OSError as e:
            raise TransportError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        _grow_recv_buffer(transport, self.config.udp_recv_buffer_bytes)
        self._server = transport.get_protocol()  # type: ignore[assignment]
        sockname = transport.get_extra_info("sockname")
        return (str(sockname[0]), int(sockname[1]))

    async def close(self) -> None:
        """Close every connection with SHUTDOWN and stop listening."""
        self._closing = True
        for task in list(self._keep.values()):
            task.cancel()
        self._keep.clear()
        for conn in list(self._conns):
            conn.close_with(ErrorCode.SHUTDOWN, "node shutting down")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.sleep(0.05)  # let close frames leave
        if self._server is not None:
            self._server.close()
            self._server = None

    # -- connections -----------------------------------------------------------------------------

    def peer(self, node_id: str) -> Peer | None:
        p = self._known.get(node_id)
        return p if p is not None and p.connected else None

    def peers(self) -> list[Peer]:
        return [p for p in self._known.values() if p.connected]

    async def connect(self, addr: Address, expected_node_id: str | None = None, *,
                      replace_relayed: bool = False) -> Peer:
        """Dial and authenticate. Raises HandshakeRefused(reason) or TransportError.

        A connected ``expected_node_id`` is returned as is, unless it is reached through a relay and
        ``replace_relayed``: then a direct connection is dialled, and replaces the relayed one."""
        if expected_node_id is not None and (existing := self.peer(expected_node_id)) is not None:
            if not (replace_relayed and existing.path == PATH_RELAY):
                return existing
        try:
            return await self._connect(addr, expected_node_id)
        except (TransportError, OSError) as e:
            if expected_node_id is not None and not isinstance(e, HandshakeRefused):
                for cb in list(self.on_dial_failed):
                    try:
                        cb(expected_node_id, addr)
                    except Exception as e2:  # noqa: BLE001
                        log.warning("dial_failed_callback_failed", error=repr(e2))
            raise

    async def _connect(self, addr: Address, expected_node_id: str | None) -> Peer:
        if self.credentials is None:
            raise TransportError("this node has no mesh credentials yet")
        if self._closing:
            raise TransportError("the transport is closed")
        conn = await self._dial(addr, Mode.MEMBER, expected_node_id, None)
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                peer: Peer = await conn.result
                return peer
        except HandshakeRefused as e:
            node_id = conn.peer_node_id
            if e.code == ErrorCode.DUPLICATE and node_id is not None:
                return await self._wait_up(node_id)
            raise
        except TimeoutError:
            conn.close_with(ErrorCode.HANDSHAKE_TIMEOUT, "connect timed out")
            raise TransportError(f"connecting to {addr[0]}:{addr[1]} timed out") from None

    async def redeem(self, addr: Address, issuer_node_id: str, request: bytes) -> bytes:
        """Joiner side: prove our key to the pinned issuer, send ``request``, return its reply.

        Raises JoinRefused(reason), HandshakeRefused (wrong issuer key) or TransportError.
        """
        conn = await self._dial(addr, Mode.JOIN, issuer_node_id, request)
        try:
            async with asyncio.timeout(self.config.connect_timeout_s + self.config.join_handler_timeout_s):
                reply: bytes = await conn.result
                return reply
        except TimeoutError:
            conn.close_with(ErrorCode.HANDSHAKE_TIMEOUT, "join timed out")
            raise TransportError("the issuer did not answer the join request in time") from None

    async def disconnect(self, node_id: str, reason: str) -> None:
        peer = self._known.get(node_id)
        if peer is not None and peer._conn is not None:
            peer._conn.close_with(ErrorCode.DISCONNECT, reason)

    def keep_connected(self, node_id: str, addrs: list[Address]) -> None:
        """Keep a connection to ``node_id`` up (pinned), redialling with backoff; replaces earlier addrs."""
        old = self._keep.pop(node_id, None)
        if old is not None:
            old.cancel()
        if not self._closing:
            self._keep[node_id] = asyncio.ensure_future(self._keeper(node_id, list(addrs)))

    def forget(self, node_id: str) -> None:
        """Stop keeping ``node_id`` connected (an existing connection stays until it ends)."""
        task = self._keep.pop(node_id, None)
        if task is not None:
            task.cancel()

    async def _keeper(self, node_id: str, addrs: list[Address]) -> None:
        cfg = self.config
        attempt = 0
        while True:
            peer = self.peer(node_id)
            if peer is None:
                for addr in addrs:
                    try:
                        peer = await self.connect(addr, expected_node_id=node_id)
                        break
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:  # noqa: BLE001 - the keeper must outlive any one failure
                        self._count("reconnect_failures")
                        self._ratelog.debug(time.monotonic(), "reconnect_failed", peer=node_id, error=str(e))
                if peer is None:
                    delay = backoff_delay_s(attempt, cfg.reconnect_min_s, cfg.reconnect_max_s, self._rng.random())
                    attempt += 1
                    await asyncio.sleep(delay)
                    continue
            attempt = 0
            conn = peer._conn
            if conn is not None:
                await conn.finished.wait()
            # a short pause before redialling, so a peer that admits and then drops us is not hammered
            await asyncio.sleep(backoff_delay_s(0, cfg.reconnect_min_s, cfg.reconnect_max_s, self._rng.random()))

    async def _dial(
        self, addr: Address, mode: Mode, expected_node_id: str | None, join_request: bytes | None
    ) -> _Connection:
        if len(self._conns) >= self.config.max_connections:
            raise TransportError("too many connections")
        loop = asyncio.get_running_loop()
        host, port = addr
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        except OSError as e:
            raise TransportError(f"cannot resolve {host}: {e}") from None
        family, _, _, _, sockaddr = infos[0]
        local = ("::", 0) if family == socket.AF_INET6 else ("0.0.0.0", 0)
        quic = QuicConnection(
            configuration=self._quic_config(True, is_loopback_host(str(sockaddr[0])), hint=mode is Mode.MEMBER)
        )
        try:
            udp, protocol = await loop.create_datagram_endpoint(
                lambda: _Connection(
                    quic, mesh=self, is_client=True, mode=mode, expected_node_id=expected_node_id,
                    join_request=join_request,
                ),
                local_addr=local,
                # Not a connected socket: a multi-homed server may answer from another address.
                # So "nothing listens there" shows as "no answer" after handshake_timeout_s.
                family=family,
            )
        except OSError as e:
            raise TransportError(f"cannot reach {host}:{port}: {e.strerror or e}") from None
        _grow_recv_buffer(udp, self.config.udp_recv_buffer_bytes)
        conn: _Connection = protocol  # type: ignore[assignment]
        conn.remote_address = (str(sockaddr[0]), int(sockaddr[1]))
        conn.connect(sockaddr[:2] if family == socket.AF_INET else sockaddr)
        return conn

    async def _wait_up(self, node_id: str) -> Peer:
        event = self._up_events.setdefault(node_id, asyncio.Event())
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                while (peer := self.peer(node_id)) is None:
                    event.clear()
                    await event.wait()
        except TimeoutError:
            raise TransportError(f"peer {node_id} did not come up") from None
        return peer

    # -- called by connections -------------------------------------------------------------------

    def _count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1

    def _unproven(self) -> list[_Connection]:
        """Server-side connections whose peer has not proven membership yet (pending handshakes)."""
        return [c for c in self._conns if not c.is_client and not c.proven and not c.closing]

    def _pending_handshakes(self) -> int:
        return len(self._unproven())

    def _admission_capacity(self) -> tuple[ErrorCode, str] | None:
        if self._closing:
            return (ErrorCode.SHUTDOWN, "node shutting down")
        if len(self._conns) > self.config.max_connections:
            return (ErrorCode.TOO_MANY_CONNECTIONS, "too many connections")
        return None

    def _admitted(self, conn: _Connection, ev: PeerAdmitted) -> None:
        peer = self._known.get(ev.node_id)
        if peer is None:
            peer = self._known[ev.node_id] = Peer(self, ev.node_id, ev.public_key)
        old = peer._conn
        if old is not None and old is not conn and not old.closing:
            if (old.path == PATH_RELAY) != (conn.path == PATH_RELAY):
                keep_new = old.path == PATH_RELAY  # a direct connection beats a relayed one
            elif conn.admitted_at - old.admitted_at < self.config.simultaneous_dial_window_s:
                # Simultaneous dials: both ends keep the connection dialled by the smaller node id.
                def dialer(c: _Connection) -> str:
                    return self.identity.node_id if c.is_client else ev.node_id

                keep_new = dialer(conn) < dialer(old)
            else:
                keep_new = True  # the peer restarted or lost the old one
            if not keep_new:
                conn.peer = peer
                self._count("duplicate_connections")
                conn.close_with(ErrorCode.DUPLICATE, "duplicate connection")
                return
            self._count("duplicate_connections")
            peer._conn = conn
            conn.peer = peer
            old.close_with(ErrorCode.DUPLICATE, "replaced by a newer connection")
            if old.path != conn.path:  # relayed -> direct: the peer stays up, its path changed
                for cb in list(self.on_path_change):
                    try:
                        _maybe_task(cb(peer), self._tasks)
                    except Exception as e:  # noqa: BLE001
                        log.warning("path_change_callback_failed", error=repr(e))
            return
        # still "up" for the rest of meshd if the old connection is closing or was just lost to a
        # duplicate-resolution close: swap silently instead of reporting down and up again
        still_up = (old is not None and old is not conn) or peer._down_timer is not None
        if peer._down_timer is not None:
            peer._down_timer.cancel()
            peer._down_timer = None
        peer.cert = ev.cert
        peer.protocol_version = ev.protocol_version
        peer._conn = conn
        conn.peer = peer
        self._count("peers_admitted")
        log.info("peer_connected", peer=ev.node_id, addr=conn.remote_address, outbound=conn.is_client)
        event = self._up_events.get(ev.node_id)
        if event is not None:
            event.set()
        if still_up:
            return
        for cb in list(self.on_peer_up):
            try:
                _maybe_task(cb(peer), self._tasks)
            except Exception as e:  # noqa: BLE001
                log.warning("peer_up_callback_failed", error=repr(e))

    def _terminated(self, conn: _Connection) -> None:
        self._conns.discard(conn)
        peer = conn.peer
        if peer is None or peer._conn is not conn:
            return
        peer._conn = None
        if conn.close_code == ErrorCode.DUPLICATE and not self._closing:
            # the other connection of a simultaneous dial is probably being admitted: wait for it
            loop = asyncio.get_running_loop()
            peer._down_timer = loop.call_later(self.config.handshake_timeout_s, self._report_down, peer, conn)
            return
        self._report_down(peer, conn)

    def _report_down(self, peer: Peer, conn: _Connection) -> None:
        peer._down_timer = None
        if peer._conn is not None:
            return  # replaced meanwhile
        log.info("peer_disconnected", peer=peer.node_id, code=int(conn.close_code or 0), reason=conn.close_reason)
        for cb in list(self.on_peer_down):
            try:
                _maybe_task(cb(peer), self._tasks)
            except Exception as e:  # noqa: BLE001
                log.warning("peer_down_callback_failed", error=repr(e))

    def dispatch_stream(self, carrier: Any, stream: Stream) -> None:
        """Serve a stream the peer opened on another carrier (a data lane) with this type's handler."""
        self._dispatch(carrier, stream)

    def _dispatch(self, conn: _Connection, stream: Stream) -> None:
        stype = stream.stream_type
        assert stype is not None and conn.peer is not None  # noqa: S101 - admitted, preamble parsed
        if stype in self._rpc_handlers:
            coro: Awaitable[None] = self._serve_rpc(conn.peer, stream, self._rpc_handlers[stype])
        elif stype in self._stream_handlers:
            coro = self._serve_stream(conn.peer, stream, self._stream_handlers[stype])
        else:
            self._count("streams_refused_no_handler")
            conn.reset_stream(stream.stream_id, ErrorCode.NO_HANDLER)
            stream.fail(StreamReset(ErrorCode.NO_HANDLER, "no handler"), done=False)
            return
        task = asyncio.ensure_future(coro)
        stream.handler_task = task
        conn._tasks.add(task)
        task.add_done_callback(conn._tasks.discard)

    async def _serve_rpc(self, peer: Peer, stream: Stream, handler: RpcHandler) -> None:
        try:
            request = await stream.recv()
            if request is None:
                raise RpcError(ErrorCode.PROTOCOL_ERROR, "empty request")
            try:
                reply = await handler(peer, request)
                stype = stream.stream_type
                if stype is not None and len(reply) > max_frame_bytes(stype):
                    raise ValueError(f"reply of {len(reply)} bytes exceeds the {stype.name} frame limit")
            except RpcError as e:
                await stream.send_frame(FrameType.ERROR, encode_error(e.code, e.reason), True)
                return
            except (asyncio.CancelledError, TransportError):
                raise
            except Exception as e:  # noqa: BLE001 - a handler bug must not take the connection down
                self._count("rpc_handler_errors")
                log.warning("rpc_handler_failed", stream_type=str(stream.stream_type), error=repr(e))
                await stream.send_frame(FrameType.ERROR, encode_error(ErrorCode.INTERNAL_ERROR, "handler failed"), True)
                return
            await stream.send(reply, end=True)
        except (asyncio.CancelledError, TransportError):
            pass
        finally:
            self._forget_stream(stream)

    async def _serve_stream(self, peer: Peer, stream: Stream, handler: StreamHandler) -> None:
        try:
            await handler(peer, stream)
            await stream.end()
        except (asyncio.CancelledError, TransportError):
            pass
        except Exception as e:  # noqa: BLE001
            self._count("stream_handler_errors")
            log.warning("stream_handler_failed", stream_type=str(stream.stream_type), error=repr(e))
            stream.reset(ErrorCode.INTERNAL_ERROR)
        finally:
            self._forget_stream(stream)

    def _forget_stream(self, stream: Stream) -> None:
        """The stream's user is done with it: free its slot (late data for it is dropped)."""
        stream.mark_done()
