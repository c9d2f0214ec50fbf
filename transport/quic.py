"""The asyncio QUIC layer (aioquic): authenticated connections, typed streams, RPC, keep-alive.

The only asyncio module of ``transport``. It feeds the sans-I/O cores (``framing``, ``handshake``) and
turns every ``RemoteProtocolError`` into a connection close with its code in one place
(``_Connection._fail``). See docs/DESIGN.md (API) and docs/transport.md (behaviour, limits).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import socket
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import structlog
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer, serve
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection

from transport import ALPN, PROTOCOL_MAX, PROTOCOL_MIN, PROTOCOL_VERSION, limits
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
    Frame,
    FrameDecoder,
    FrameType,
    RemoteProtocolError,
    decode_error,
    encode_error,
    encode_frame,
    encode_preamble,
)
from transport.handshake import Admission, Handshake, JoinReplied, JoinRequested, Mode, PeerAdmitted, tls_binding
from transport.identity import NodeIdentity
from transport.ratelog import RateLimitedLog
from transport.streams import HANDSHAKE_STREAM_TYPES, StreamType, max_frame_bytes
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
]

log = structlog.get_logger("meshd.transport")

Address = tuple[str, int]
JoinHandler = Callable[[bytes, bytes], Awaitable[bytes]]
StreamHandler = Callable[["Peer", "Stream"], Awaitable[None]]
RpcHandler = Callable[["Peer", bytes], Awaitable[bytes]]
PeerCallback = Callable[["Peer"], Any]

_HANDSHAKE_STREAM_ID = 0  # the first client-initiated bidirectional stream


@dataclass(frozen=True, slots=True)
class TransportConfig:
    """Transport tuning. Times in seconds, sizes in bytes. Presets are written as deltas."""

    keepalive_interval_s: float = 10.0  # PING after this much silence; 0 disables keep-alive
    idle_timeout_s: float = 300.0  # QUIC idle timeout (min of both sides' values applies)
    dead_peer_timeout_s: float = 30.0  # with keep-alive on: nothing heard for this long -> close
    handshake_timeout_s: float = 3.0  # a connection not admitted by then is closed
    connect_timeout_s: float = 5.0  # connect()/redeem() give up after this
    join_handler_timeout_s: float = 10.0  # the issuer's join handler must answer within this
    reconnect_min_s: float = 0.5  # keep_connected backoff: first delay ...
    reconnect_max_s: float = 30.0  # ... doubling up to this, times a jitter in [0.5, 1.0)
    simultaneous_dial_window_s: float = 5.0  # two connections admitted this close are a simultaneous dial
    max_connections: int = limits.MAX_CONNECTIONS
    max_pending_handshakes: int = limits.MAX_PENDING_HANDSHAKES
    max_streams_per_peer: int = limits.MAX_STREAMS_PER_PEER
    stream_send_buffer_bytes: int = limits.STREAM_SEND_BUFFER_BYTES
    stream_recv_queue_bytes: int = limits.STREAM_RECV_QUEUE_BYTES
    max_datagram_size: int = 1350  # QUIC packet payload; 1350 fits common internet paths
    quic_max_data: int = 4 * 1024 * 1024  # initial connection flow-control window
    quic_max_stream_data: int = 1024 * 1024  # initial per-stream flow-control window
    log_interval_s: float = 10.0  # rate limit of debug logs about refused input

    @classmethod
    def lan(cls) -> TransportConfig:
        return cls()

    @classmethod
    def loopback(cls) -> TransportConfig:
        """Larger packets: the loopback MTU is 64 KiB, so fewer packets and less crypto per byte."""
        return replace(cls(), max_datagram_size=16384)


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


class Stream:
    """One typed stream. ``send``/``recv`` frames; ``reset`` cancels both directions."""

    def __init__(self, conn: _Connection, stream_id: int, stream_type: StreamType | None, decoder: FrameDecoder):
        self._conn = conn
        self.stream_id = stream_id
        self.stream_type = stream_type
        self._decoder = decoder
        self._frames: deque[Frame] = deque()
        self._queued_bytes = 0
        self._ended = False  # peer finished sending
        self._error: TransportError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sent_end = False
        self._handler_task: asyncio.Task[Any] | None = None

    @property
    def peer(self) -> Peer | None:
        return self._conn.peer

    async def send(self, payload: bytes, end: bool = False) -> None:
        """Send one DATA frame; waits while this stream's send buffer is full."""
        await self._send_frame(FrameType.DATA, payload, end)

    async def _send_frame(self, frame_type: FrameType, payload: bytes, end: bool) -> None:
        if self._sent_end:
            raise TransportError("stream already ended")
        if self._error is not None:
            raise self._error
        assert self.stream_type is not None  # noqa: S101 - set for local streams and after preamble
        data = encode_frame(frame_type, payload, max_frame_bytes(self.stream_type))
        self._sent_end = end
        await self._conn.write(self.stream_id, data, end)
        self._check_done()

    async def end(self) -> None:
        """Finish the sending side without a frame (no-op if already ended)."""
        if not self._sent_end:
            self._sent_end = True
            await self._conn.write(self.stream_id, b"", True)
            self._check_done()

    def _check_done(self) -> None:
        """Drop the connection's bookkeeping once both directions ended (frees a stream slot)."""
        if self._sent_end and self._ended and not self._frames:
            self._conn.streams.pop(self.stream_id, None)

    async def recv(self) -> bytes | None:
        """Next DATA payload; None at a clean end. Raises StreamReset, RemoteError or TransportError."""
        frame = await self._recv_frame()
        if frame is None:
            return None
        if frame.type is FrameType.ERROR:
            code, reason = decode_error(frame.payload)
            raise RemoteError(code, reason)
        return frame.payload

    async def _recv_frame(self) -> Frame | None:
        while not self._frames:
            if self._error is not None:
                raise self._error
            if self._ended:
                self._check_done()
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        frame = self._frames.popleft()
        self._queued_bytes -= len(frame.payload)
        return frame

    def reset(self, code: int = ErrorCode.CANCELLED) -> None:
        """Abort both directions; the peer's ``recv`` raises ``StreamReset(code)``."""
        self._conn.reset_stream(self.stream_id, code)
        self._set_error(StreamReset(code, "stream reset locally"))

    # -- called by the connection ----------------------------------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _on_frames(self, frames: list[Frame], end: bool, recv_limit: int) -> bool:
        """Queue frames; False if the reader fell too far behind (the caller resets the stream)."""
        for frame in frames:
            self._frames.append(frame)
            self._queued_bytes += len(frame.payload)
        if end:
            self._ended = True
        self._wake()
        return self._queued_bytes <= recv_limit

    def _set_error(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
        self._wake()


class Peer:
    """An admitted member. Stable per node id; re-attached when it reconnects."""

    def __init__(self, mesh: MeshTransport, node_id: str, public_key: bytes) -> None:
        self._mesh = mesh
        self.node_id = node_id
        self.public_key = public_key
        self.cert: MemberCert | None = None
        self.protocol_version = PROTOCOL_VERSION
        self._conn: _Connection | None = None

    def __repr__(self) -> str:
        return f"Peer({self.node_id}, connected={self.connected})"

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    @property
    def address(self) -> Address | None:
        return self._conn.remote_address if self._conn is not None else None

    @property
    def rtt_ms(self) -> float | None:
        return self._conn.rtt_ms if self._conn is not None else None

    def _connection(self) -> _Connection:
        conn = self._conn
        if conn is None or conn.closed:
            raise TransportError(f"peer {self.node_id} is not connected")
        return conn

    async def open_stream(self, stream_type: StreamType) -> Stream:
        """Open a typed stream (its preamble goes out with the first frame)."""
        if stream_type in HANDSHAKE_STREAM_TYPES:
            raise ValueError("handshake streams are opened by the transport")
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
                frame = await stream._recv_frame()
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


class _Connection(QuicConnectionProtocol):
    """One QUIC connection: drives aioquic, the handshake, and the streams."""

    def __init__(
        self,
        quic: QuicConnection,
        stream_handler: Any = None,
        *,
        mesh: MeshTransport,
        is_client: bool,
        mode: Mode = Mode.MEMBER,
        expected_node_id: str | None = None,
        join_request: bytes | None = None,
    ) -> None:
        super().__init__(quic)
        self.mesh = mesh
        self.is_client = is_client
        self.mode = mode
        self.expected_node_id = expected_node_id
        self.join_request = join_request
        self.peer: Peer | None = None
        self.handshake: Handshake | None = None
        self.admitted = False
        self.admitted_at = 0.0
        self.closed = False
        self.close_code: int | None = None
        self.close_reason = ""
        self.remote_address: Address | None = None
        self.result: asyncio.Future[Any] = self._loop.create_future()  # client: admitted / join reply
        self.streams: dict[int, Stream] = {}
        self.last_rx = self._loop.time()
        self._progress: asyncio.Future[None] | None = None
        self._timers: list[asyncio.TimerHandle] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._refuse_at_start: tuple[ErrorCode, str] | None = None
        self._keepalive_uid = 0
        self._remote_stream_max = -1  # highest peer-initiated stream id seen (ids only grow)
        mesh._conns.add(self)
        if not is_client:
            self._refuse_at_start = mesh._admission_capacity()
        self._timers.append(self._loop.call_later(mesh.config.handshake_timeout_s, self._guarded, self._deadline))
        if mesh.config.keepalive_interval_s > 0:
            self._timers.append(self._loop.call_later(mesh.config.keepalive_interval_s, self._guarded, self._tick))

    # -- public to the transport -----------------------------------------------------------------

    @property
    def rtt_ms(self) -> float | None:
        loss = getattr(self._quic, "_loss", None)
        rtt = getattr(loss, "_rtt_smoothed", 0.0) if loss is not None else 0.0
        return round(rtt * 1000.0, 3) if rtt else None

    @property
    def peer_node_id(self) -> str | None:
        if self.peer is not None:
            return self.peer.node_id
        hs = self.handshake
        return getattr(hs, "_peer_id", None) if hs is not None else None

    def open_stream(self, stream_type: StreamType) -> Stream:
        if not self.admitted:
            raise TransportError("connection not admitted")
        mine = sum(1 for s in self.streams.values() if self._is_local(s.stream_id))
        if mine >= self.mesh.config.max_streams_per_peer:
            self.mesh._count("streams_refused_local_cap")
            raise TransportError("too many open streams to this peer")
        sid = self._quic.get_next_available_stream_id()
        stream = Stream(self, sid, stream_type, FrameDecoder(stream_type))
        self.streams[sid] = stream
        self._quic.send_stream_data(sid, encode_preamble(stream_type, PROTOCOL_VERSION))
        return stream

    async def write(self, stream_id: int, data: bytes, end: bool) -> None:
        limit = self.mesh.config.stream_send_buffer_bytes
        while True:
            if self.closed:
                raise TransportError(f"connection closed: {self.close_reason or 'closed'}")
            stream = self.streams.get(stream_id)
            if stream is not None and stream._error is not None:
                raise stream._error
            if self._pending_send_bytes(stream_id) <= limit:
                break
            await self._wait_progress()
        self._quic.send_stream_data(stream_id, data, end_stream=end)
        self._transmit_soon()

    def reset_stream(self, stream_id: int, code: int) -> None:
        try:
            self._quic.reset_stream(stream_id, code)
            if stream_id in self._quic._streams:
                self._quic.stop_stream(stream_id, code)
        except ValueError:
            pass  # already finished on our side
        self.streams.pop(stream_id, None)
        self._transmit_soon()

    def close_with(self, code: ErrorCode, reason: str) -> None:
        if not self.closed:
            self.close_code = code
            self.close_reason = reason
            self.close(error_code=int(code), reason_phrase=reason[: limits.MAX_REFUSAL_REASON_BYTES])

    # -- aioquic hooks (network callbacks: nothing may escape) -----------------------------------

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        try:
            self.last_rx = self._loop.time()
            if self.remote_address is None:
                self.remote_address = (str(addr[0]), int(addr[1]))
            if self._refuse_at_start is not None:
                code, reason = self._refuse_at_start
                self._refuse_at_start = None
                self._quic.receive_datagram(bytes(data), addr, now=self._loop.time())
                self.mesh._count(f"refused_{code.name.lower()}")
                self.close_with(code, reason)
                return
            super().datagram_received(data, addr)
        except Exception as e:  # noqa: BLE001 - a network callback never raises
            self.mesh._count("internal_errors")
            log.warning("transport_datagram_failed", error=repr(e))
        finally:
            self._signal_progress()

    def _handle_timer(self) -> None:
        try:
            super()._handle_timer()
        except Exception as e:  # noqa: BLE001
            log.warning("transport_timer_failed", error=repr(e))
        finally:
            self._signal_progress()

    def quic_event_received(self, event: qe.QuicEvent) -> None:
        self._guarded(self._on_event, event)

    # -- the one place where protocol errors become closes ---------------------------------------

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except RemoteProtocolError as e:
            self._fail(e)
        except Exception as e:  # noqa: BLE001 - a network callback never raises
            self.mesh._count("internal_errors")
            log.warning("transport_internal_error", error=repr(e))
            self._fail(RemoteProtocolError(ErrorCode.INTERNAL_ERROR, "internal error"))

    def _fail(self, e: RemoteProtocolError) -> None:
        self.mesh._count(f"refused_{e.code.name.lower()}")
        self.mesh._ratelog.debug(
            self._loop.time(),
            "connection_refused",
            code=e.code.name,
            reason=e.reason,
            peer=self.peer_node_id,
            addr=self.remote_address,
        )
        if self.is_client and not self.result.done():
            self.result.set_exception(HandshakeRefused(e.reason, int(e.code)))
        self.close_with(e.code, e.reason)

    # -- events ----------------------------------------------------------------------------------

    def _on_event(self, event: qe.QuicEvent) -> None:
        if isinstance(event, qe.StreamDataReceived):
            self._on_stream_data(event.stream_id, event.data, event.end_stream)
        elif isinstance(event, qe.HandshakeCompleted):
            if self.is_client:
                self._start_client_handshake()
        elif isinstance(event, qe.StreamReset):
            stream = self.streams.pop(event.stream_id, None)
            if stream is not None:
                stream._set_error(StreamReset(event.error_code))
                if stream._handler_task is not None:
                    stream._handler_task.cancel()
            elif not self.admitted and event.stream_id == _HANDSHAKE_STREAM_ID:
                raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "handshake stream reset")
        elif isinstance(event, qe.StopSendingReceived):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream._set_error(StreamReset(event.error_code, "peer stopped reading"))
                if stream._handler_task is not None:
                    stream._handler_task.cancel()
        elif isinstance(event, qe.ConnectionTerminated):
            self._on_terminated(event)

    def _start_client_handshake(self) -> None:
        cert = getattr(self._quic.tls, "_peer_certificate", None)
        if cert is None:
            raise RemoteProtocolError(ErrorCode.HANDSHAKE_FAILED, "server sent no TLS certificate")
        mesh = self.mesh
        self.handshake = Handshake(
            is_client=True,
            mode=self.mode,
            identity=mesh.identity,
            credentials=mesh.credentials if self.mode is Mode.MEMBER else None,
            binding=tls_binding(certificate_der(cert)),
            challenge=os.urandom(32),
            now=self._loop.time(),
            timeout_s=mesh.config.handshake_timeout_s,
            protocol_version=PROTOCOL_VERSION,
            accepted_versions=(PROTOCOL_MIN, PROTOCOL_MAX),
            expected_node_id=self.expected_node_id,
            admission=mesh.admission,
            join_request=self.join_request,
        )
        self.handshake.initiate()
        self._flush_handshake()

    def _server_handshake(self) -> Handshake:
        mesh = self.mesh
        if mesh.credentials is None and mesh._join_handler is None:
            raise RemoteProtocolError(ErrorCode.REFUSED, "this node is not a member of a mesh yet")
        return Handshake(
            is_client=False,
            mode=Mode.MEMBER,
            identity=mesh.identity,
            credentials=mesh.credentials,
            binding=mesh._tls_binding,
            challenge=os.urandom(32),
            now=self._loop.time(),
            timeout_s=mesh.config.handshake_timeout_s,
            protocol_version=PROTOCOL_VERSION,
            accepted_versions=(PROTOCOL_MIN, PROTOCOL_MAX),
            admission=mesh.admission,
            join_allowed=mesh._join_handler is not None,
        )

    def _flush_handshake(self) -> None:
        hs = self.handshake
        assert hs is not None  # noqa: S101 - called after creation
        data = hs.data_to_send()
        if data:
            self._quic.send_stream_data(_HANDSHAKE_STREAM_ID, data)
            self._transmit_soon()
        while (ev := hs.next_event()) is not None:
            if isinstance(ev, PeerAdmitted):
                self._on_admitted(ev)
            elif isinstance(ev, JoinRequested):
                task = asyncio.ensure_future(self._answer_join(ev))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            elif isinstance(ev, JoinReplied):
                if not self.result.done():
                    self.result.set_result(ev.reply)
                self.close_with(ErrorCode.JOIN_DONE, "join complete")

    def _on_stream_data(self, stream_id: int, data: bytes, end: bool) -> None:
        if stream_id == _HANDSHAKE_STREAM_ID:
            if self.handshake is None:
                if self.is_client:
                    raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "data before the handshake")
                self.handshake = self._server_handshake()
            if self.handshake.done:
                if data:
                    raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "data after the handshake")
                return
            self.handshake.receive_data(data, end)
            self._flush_handshake()
            return
        if not self.admitted:
            raise RemoteProtocolError(ErrorCode.NOT_ADMITTED, "stream opened before the handshake")
        stream = self.streams.get(stream_id)
        if stream is None:
            if self._is_local(stream_id) or stream_id <= self._remote_stream_max:
                return  # late data for a stream we are done with or reset
            if stream_id % 4 >= 2:
                raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "unidirectional streams are not used")
            self._remote_stream_max = stream_id
            theirs = sum(1 for s in self.streams.values() if not self._is_local(s.stream_id))
            if theirs >= self.mesh.config.max_streams_per_peer:
                self.mesh._count("streams_refused_cap")
                self.reset_stream(stream_id, ErrorCode.TOO_MANY_STREAMS)
                return
            stream = Stream(self, stream_id, None, FrameDecoder(None, (PROTOCOL_MIN, PROTOCOL_MAX)))
            self.streams[stream_id] = stream
        frames = stream._decoder.feed(data)
        if end:
            stream._decoder.feed_eof()
        if stream.stream_type is None and stream._decoder.stream_type is not None:
            stream.stream_type = stream._decoder.stream_type
            if stream.stream_type in HANDSHAKE_STREAM_TYPES:
                raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "second handshake stream")
            self.mesh._dispatch(self, stream)
        if not stream._on_frames(frames, end, self.mesh.config.stream_recv_queue_bytes):
            self.mesh._count("streams_reset_recv_overflow")
            stream._set_error(StreamReset(ErrorCode.RECV_OVERFLOW, "receive queue overflow"))
            self.reset_stream(stream_id, ErrorCode.RECV_OVERFLOW)

    def _on_admitted(self, ev: PeerAdmitted) -> None:
        self.admitted = True
        self.admitted_at = self._loop.time()
        self.mesh._admitted(self, ev)
        if self.is_client and not self.result.done():
            self.result.set_result(self.peer)

    async def _answer_join(self, ev: JoinRequested) -> None:
        handler = self.mesh._join_handler
        try:
            if handler is None:
                raise JoinRefused("this node does not accept joins")
            async with asyncio.timeout(self.mesh.config.join_handler_timeout_s):
                reply = await handler(ev.public_key, ev.request)
        except JoinRefused as e:
            self.mesh._count("joins_refused")
            self.close_with(ErrorCode.JOIN_REFUSED, e.reason)
            return
        except Exception as e:  # noqa: BLE001 - never let a handler failure escape
            self.mesh._count("joins_failed")
            log.warning("join_handler_failed", error=repr(e))
            self.close_with(ErrorCode.JOIN_REFUSED, "the issuer could not process the request")
            return
        if self.closed or self.handshake is None:
            return
        self.mesh._count("joins_answered")
        self.handshake.reply_join(reply)
        self._flush_handshake()
        # The joiner closes once it has the reply; close ourselves if it does not.
        self._timers.append(
            self._loop.call_later(
                self.mesh.config.handshake_timeout_s, self.close_with, ErrorCode.JOIN_DONE, "join complete"
            )
        )

    def _on_terminated(self, event: qe.ConnectionTerminated) -> None:
        self.closed = True
        if self.close_code is None:
            self.close_code = event.error_code
            self.close_reason = event.reason_phrase
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        reason = event.reason_phrase or "connection closed"
        err = TransportError(f"connection closed: {reason}")
        for stream in self.streams.values():
            stream._set_error(err)
            if stream._handler_task is not None:
                stream._handler_task.cancel()
        for task in self._tasks:
            task.cancel()
        if not self.result.done():
            app_close = event.frame_type is None
            if app_close and event.error_code == ErrorCode.JOIN_REFUSED and self.mode is Mode.JOIN:
                self.result.set_exception(JoinRefused(reason))
            elif app_close and event.error_code != ErrorCode.NO_ERROR:
                self.result.set_exception(HandshakeRefused(reason, event.error_code))
            else:
                self.result.set_exception(TransportError(f"connection failed: {reason}"))
            self.result.exception()  # mark retrieved: nobody may be waiting any more
        self._signal_progress()
        self.mesh._terminated(self)
        if self.is_client and self._transport is not None:
            self._loop.call_later(0.05, self._transport.close)

    # -- timers ----------------------------------------------------------------------------------

    def _deadline(self) -> None:
        if self.closed or self.admitted:
            return
        hs = self.handshake
        if hs is not None and (hs.done or hs.awaiting_join_reply):
            return  # the join handler has its own timeout
        raise RemoteProtocolError(ErrorCode.HANDSHAKE_TIMEOUT, "handshake timed out")

    def _tick(self) -> None:
        if self.closed:
            return
        cfg = self.mesh.config
        now = self._loop.time()
        silent = now - self.last_rx
        if self.admitted and silent >= cfg.dead_peer_timeout_s:
            self.mesh._count("peers_unresponsive")
            self.close_with(ErrorCode.PEER_UNRESPONSIVE, "peer stopped answering keep-alive pings")
            return
        if silent >= cfg.keepalive_interval_s:
            self._keepalive_uid += 1
            self._quic.send_ping(self._keepalive_uid)
            self.transmit()
            next_in = cfg.keepalive_interval_s
        else:
            next_in = cfg.keepalive_interval_s - silent
        self._timers = [t for t in self._timers if not t.cancelled()]
        self._timers.append(self._loop.call_later(max(next_in, 0.01), self._guarded, self._tick))

    # -- helpers ---------------------------------------------------------------------------------

    def _is_local(self, stream_id: int) -> bool:
        return (stream_id & 1) == (0 if self.is_client else 1)

    def _pending_send_bytes(self, stream_id: int) -> int:
        qstream = self._quic._streams.get(stream_id)
        if qstream is None:
            return 0
        return len(qstream.sender._buffer)

    async def _wait_progress(self) -> None:
        if self._progress is None or self._progress.done():
            self._progress = self._loop.create_future()
        await self._progress

    def _signal_progress(self) -> None:
        fut = self._progress
        if fut is not None and not fut.done():
            fut.set_result(None)


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
        self._server: QuicServer | None = None
        self._conns: set[_Connection] = set()
        self._known: dict[str, Peer] = {}
        self._stream_handlers: dict[StreamType, StreamHandler] = {}
        self._rpc_handlers: dict[StreamType, RpcHandler] = {}
        self._join_handler: JoinHandler | None = None
        self._keep: dict[str, asyncio.Task[None]] = {}
        self._up_events: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._ratelog = RateLimitedLog(log, self.config.log_interval_s)
        self._closing = False

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

    def _quic_config(self, is_client: bool) -> QuicConfiguration:
        cfg = QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[ALPN],
            idle_timeout=self.config.idle_timeout_s,
            max_datagram_size=self.config.max_datagram_size,
            max_data=self.config.quic_max_data,
            max_stream_data=self.config.quic_max_stream_data,
        )
        if is_client:
            cfg.verify_mode = ssl.CERT_NONE  # the meshd handshake authenticates, bound to this cert
        else:
            cfg.certificate = self._tls_cert
            cfg.private_key = self.identity.private_key()
        return cfg

    async def listen(self, host: str, port: int) -> Address:
        """Bind the QUIC server; returns the address actually bound."""
        self._server = await serve(
            host,
            port,
            configuration=self._quic_config(False),
            create_protocol=partial(_Connection, mesh=self, is_client=False),
        )
        sockname = self._server._transport.get_extra_info("sockname")  # type: ignore[union-attr]
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

    async def connect(self, addr: Address, expected_node_id: str | None = None) -> Peer:
        """Dial and authenticate. Raises HandshakeRefused(reason) or TransportError."""
        if expected_node_id is not None and (existing := self.peer(expected_node_id)) is not None:
            return existing
        if self.credentials is None:
            raise TransportError("this node has no mesh credentials yet")
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
        delay = self.config.reconnect_min_s
        while True:
            peer = self.peer(node_id)
            if peer is None:
                for addr in addrs:
                    try:
                        peer = await self.connect(addr, expected_node_id=node_id)
                        break
                    except (TransportError, OSError) as e:
                        self._count("reconnect_failures")
                        self._ratelog.debug(time.monotonic(), "reconnect_failed", peer=node_id, error=str(e))
                if peer is None:
                    await asyncio.sleep(delay * (0.5 + 0.5 * self._rng.random()))
                    delay = min(delay * 2, self.config.reconnect_max_s)
                    continue
            delay = self.config.reconnect_min_s
            conn = peer._conn
            if conn is not None:
                await conn._closed.wait()
            else:
                await asyncio.sleep(self.config.reconnect_min_s)

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
        quic = QuicConnection(configuration=self._quic_config(True))
        _, protocol = await loop.create_datagram_endpoint(
            lambda: _Connection(
                quic, mesh=self, is_client=True, mode=mode, expected_node_id=expected_node_id,
                join_request=join_request,
            ),
            local_addr=local,
            family=family,
        )
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

    def _admission_capacity(self) -> tuple[ErrorCode, str] | None:
        if self._closing:
            return (ErrorCode.SHUTDOWN, "node shutting down")
        if len(self._conns) > self.config.max_connections:
            return (ErrorCode.TOO_MANY_CONNECTIONS, "too many connections")
        pending = sum(1 for c in self._conns if not c.admitted and not c.closed)
        if pending > self.config.max_pending_handshakes:
            return (ErrorCode.TOO_MANY_CONNECTIONS, "too many pending handshakes")
        return None

    def _admitted(self, conn: _Connection, ev: PeerAdmitted) -> None:
        peer = self._known.get(ev.node_id)
        if peer is None:
            peer = self._known[ev.node_id] = Peer(self, ev.node_id, ev.public_key)
        old = peer._conn
        if old is not None and old is not conn and not old.closed:
            if conn.admitted_at - old.admitted_at < self.config.simultaneous_dial_window_s:
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
            return
        peer.cert = ev.cert
        peer.protocol_version = ev.protocol_version
        peer._conn = conn
        conn.peer = peer
        self._count("peers_admitted")
        log.info("peer_connected", peer=ev.node_id, addr=conn.remote_address, outbound=conn.is_client)
        event = self._up_events.get(ev.node_id)
        if event is not None:
            event.set()
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
        log.info("peer_disconnected", peer=peer.node_id, code=int(conn.close_code or 0), reason=conn.close_reason)
        for cb in list(self.on_peer_down):
            try:
                _maybe_task(cb(peer), self._tasks)
            except Exception as e:  # noqa: BLE001
                log.warning("peer_down_callback_failed", error=repr(e))

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
            stream._set_error(StreamReset(ErrorCode.NO_HANDLER, "no handler"))
            return
        task = asyncio.ensure_future(coro)
        stream._handler_task = task
        conn._tasks.add(task)
        task.add_done_callback(conn._tasks.discard)

    async def _serve_rpc(self, peer: Peer, stream: Stream, handler: RpcHandler) -> None:
        try:
            request = await stream.recv()
            if request is None:
                raise RpcError(ErrorCode.PROTOCOL_ERROR, "empty request")
            try:
                reply = await handler(peer, request)
            except RpcError as e:
                await stream._send_frame(FrameType.ERROR, encode_error(e.code, e.reason), True)
                return
            except (asyncio.CancelledError, TransportError):
                raise
            except Exception as e:  # noqa: BLE001 - a handler bug must not take the connection down
                self._count("rpc_handler_errors")
                log.warning("rpc_handler_failed", stream_type=str(stream.stream_type), error=repr(e))
                await stream._send_frame(FrameType.ERROR, encode_error(ErrorCode.INTERNAL_ERROR, "handler failed"), True)
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
        """Drop our bookkeeping once the stream's user is done with it (aioquic keeps its own)."""
        stream._conn.streams.pop(stream.stream_id, None)
