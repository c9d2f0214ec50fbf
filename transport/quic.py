"""The asyncio QUIC layer (aioquic): authenticated connections, typed streams, RPC, keep-alive.

The only asyncio module of ``transport``. It feeds the sans-I/O cores (``framing``, ``handshake``) and
turns every ``RemoteProtocolError`` into a connection close with its code in one place
(``_Connection._fail``). See docs/DESIGN.md (API) and docs/transport.md (behaviour, limits).
"""

from __future__ import annotations

import asyncio
import inspect
import ipaddress
import os
import random
import socket
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import structlog
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.asyncio.server import QuicServer
from aioquic.buffer import Buffer
from aioquic.quic import events as qe
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection, QuicConnectionState
from aioquic.quic.packet import QuicPacketType, pull_quic_header
from aioquic.quic.recovery import QuicPacketRecovery

from transport import ALPN, PROTOCOL_MAX, PROTOCOL_MIN, PROTOCOL_VERSION, limits
from transport.aioquic_ext import CoarsePacer, MeshQuicConnection
from transport.config import TransportConfig, backoff_delay_s
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
    "backoff_delay_s",
]

log = structlog.get_logger("meshd.transport")

Address = tuple[str, int]
JoinHandler = Callable[[bytes, bytes], Awaitable[bytes]]
StreamHandler = Callable[["Peer", "Stream"], Awaitable[None]]
RpcHandler = Callable[["Peer", bytes], Awaitable[bytes]]
PeerCallback = Callable[["Peer"], Any]

_HANDSHAKE_STREAM_ID = 0  # the first client-initiated bidirectional stream


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
        self._raw_received = 0  # stream bytes received from QUIC (preamble and frames)
        self._raw_queued = 0  # wire bytes of complete frames not yet read by the application
        self._ended = False  # peer finished sending
        self._error: TransportError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._sent_end = False
        self._handler_task: asyncio.Task[Any] | None = None
        self._app_done = False  # its user is finished; kept until aioquic discards the QUIC stream
        self._receiver: tuple[Callable[[bytes], None], Callable[[Exception | None], None]] | None = None
        self._paused = False
        self._delivering = False  # _deliver is running: calls from inside a callback leave it to that run

    @property
    def peer(self) -> Peer | None:
        return self._conn.peer

    @property
    def max_datagram_bytes(self) -> int:
        """The QUIC packet size this stream's connection uses (16 KiB on loopback, else ~1350)."""
        return int(self._conn._quic._max_datagram_size)

    @property
    def on_loopback(self) -> bool:
        """Whether the peer is on this machine's loopback (so it shares this machine's CPU cores)."""
        addr = self._conn.remote_address
        return addr is not None and _is_loopback(addr[0])

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
        if self._error is not None:
            raise self._error
        if not self._sent_end:
            self._sent_end = True
            await self._conn.write(self.stream_id, b"", True)
            self._check_done()

    def _mark_done(self) -> None:
        """The application is finished with this stream: free its slot, stop flow accounting."""
        self._app_done = True
        self._conn._flow.app_consumed.pop(self.stream_id, None)

    def _check_done(self) -> None:
        """Free the stream's slot once both directions ended."""
        if self._sent_end and self._ended and not self._frames:
            self._mark_done()

    def send_now(self, payload: bytes) -> bool:
        """Send one DATA frame at once, without waiting, and flush it to the network in this call.

        False (nothing sent) when the stream's send buffer is over its limit: use :meth:`send` then.
        For latency-bound request/reply traffic (expert RPC): no task switch and no deferred transmit.
        Raises like :meth:`send` if the stream or the connection is gone.
        """
        if self._sent_end:
            raise TransportError("stream already ended")
        if self._error is not None:
            raise self._error
        assert self.stream_type is not None  # noqa: S101 - set for local streams and after preamble
        if not self._conn.write_now(self.stream_id, encode_frame(FrameType.DATA, payload,
                                                                 max_frame_bytes(self.stream_type))):
            return False
        self._check_done()
        return True

    def set_receiver(self, on_data: Callable[[bytes], None], on_end: Callable[[Exception | None], None]) -> None:
        """Deliver this stream's input by callback, on the loop, as each packet is read (no task wake).

        ``on_data(payload)`` for each DATA frame (frames already queued are delivered now), then once
        ``on_end(None)`` at a clean end or ``on_end(error)`` (StreamReset, RemoteError, TransportError).
        :meth:`recv` must not be used afterwards. Input is taken as it arrives, so the receiver bounds what it
        keeps. A callback that raises resets the stream.
        """
        self._receiver = (on_data, on_end)
        self._deliver()

    def pause_receiving(self) -> None:
        """Stop delivering to the receiver: input queues (and its flow credit stops) until resumed."""
        self._paused = True

    def resume_receiving(self) -> None:
        self._paused = False
        self._deliver()

    def _deliver(self) -> None:
        if self._receiver is None or self._paused or self._delivering:
            return
        self._delivering = True
        try:
            self._deliver_queued()
        finally:
            self._delivering = False

    def _deliver_queued(self) -> None:
        assert self._receiver is not None  # noqa: S101 - checked by _deliver
        on_data, on_end = self._receiver
        try:
            while self._frames:
                if self._paused:
                    self._conn._consumed(self)
                    return
                frame = self._pop_frame()
                if frame.type is FrameType.ERROR:
                    self._receiver = None
                    self._frames.clear()
                    self._queued_bytes = self._raw_queued = 0
                    on_end(RemoteError(*decode_error(frame.payload)))
                    return
                on_data(frame.payload)
            self._conn._consumed(self)
            if self._paused:
                return  # the end (or error) is delivered on resume, after any data queued meanwhile
            if self._error is not None:
                self._receiver = None
                on_end(self._error)
            elif self._ended:
                self._receiver = None
                self._check_done()
                on_end(None)
        except Exception as e:  # noqa: BLE001 - a receiver's bug resets its stream, never the connection
            log.warning("stream_receiver_failed", stream_type=self.stream_type, error=repr(e))
            on_end_called = self._receiver is None  # it was on_end that raised
            self._receiver = None
            self.reset(ErrorCode.INTERNAL_ERROR)
            if on_end_called:
                return
            try:
                on_end(TransportError(f"stream receiver failed: {e!r}"))
            except Exception as e2:  # noqa: BLE001
                log.warning("stream_receiver_failed", stream_type=self.stream_type, error=repr(e2))

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
        frame = self._pop_frame()
        self._conn._consumed(self)
        return frame

    def _pop_frame(self) -> Frame:
        frame = self._frames.popleft()
        self._queued_bytes -= len(frame.payload)
        self._raw_queued -= limits.FRAME_HEADER_BYTES + len(frame.payload)
        return frame

    def reset(self, code: int = ErrorCode.CANCELLED) -> None:
        """Abort both directions; the peer's ``recv`` raises ``StreamReset(code)``. A receiver gets no more
        data, only ``on_end(StreamReset)``."""
        if self._receiver is not None:
            self._frames.clear()
            self._queued_bytes = self._raw_queued = 0
        self._conn.reset_stream(self.stream_id, code)
        self._set_error(StreamReset(code, "stream reset locally"))
        self._mark_done()

    # -- called by the connection ----------------------------------------------------------------

    def _wake(self) -> None:
        if self._receiver is not None:
            self._deliver()
        elif self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _on_frames(self, frames: list[Frame], end: bool, recv_limit: int) -> bool:
        """Queue frames; False if the reader fell too far behind (the caller resets the stream)."""
        for frame in frames:
            self._frames.append(frame)
            self._queued_bytes += len(frame.payload)
            self._raw_queued += limits.FRAME_HEADER_BYTES + len(frame.payload)
        if end:
            self._ended = True
        self._wake()
        self._check_done()  # a one-way sender that never reads (gossip) is done once the peer's end arrives
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

    def _connection(self) -> _Connection:
        conn = self._conn
        if conn is None or conn.closing:
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
        quic.__class__ = MeshQuicConnection  # same object layout; adds consumption-based stream credit
        self._flow: MeshQuicConnection = quic  # type: ignore[assignment]
        self._flow.app_consumed = {}
        self._flow.app_window = mesh.config.quic_max_stream_data
        self._set_datagram_size(quic._max_datagram_size)
        self.is_client = is_client
        self.mode = mode
        self.expected_node_id = expected_node_id
        self.join_request = join_request
        self.peer: Peer | None = None
        self.handshake: Handshake | None = None
        self.admitted = False
        self.admitted_at = 0.0
        self.closed = False
        self.closing = False  # we or the peer began closing; no new streams
        self.finished = asyncio.Event()  # set once the connection ended (see _finish)
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
        self._prune_at = 64  # prune finished streams from ``streams`` when it grows to this size
        self._early: list[tuple[int, bytes, bool]] = []  # client: server streams that beat its ACCEPT
        self._early_bytes = 0
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
        if self._open_streams(local=True) >= self.mesh.config.max_streams_per_peer:
            self.mesh._count("streams_refused_local_cap")
            raise TransportError("too many open streams to this peer")
        sid = self._quic.get_next_available_stream_id()
        stream = Stream(self, sid, stream_type, FrameDecoder(stream_type))
        self._add_stream(stream)
        self._quic.send_stream_data(sid, encode_preamble(stream_type, PROTOCOL_VERSION))
        return stream

    async def write(self, stream_id: int, data: bytes, end: bool) -> None:
        limit = self.mesh.config.stream_send_buffer_bytes
        stream = self.streams.get(stream_id)
        while True:
            if self.closing:
                raise TransportError(f"connection closed: {self.close_reason or 'closed'}")
            if stream is not None and stream._error is not None:
                raise stream._error
            if self._pending_send_bytes(stream_id) <= limit:
                break
            await self._wait_progress()
        self._queue_data(stream_id, data, end)
        self._transmit_soon()

    def write_now(self, stream_id: int, data: bytes) -> bool:
        """``write`` without waiting: False if the send buffer is over its limit; sends the packet now."""
        if self.closing:
            raise TransportError(f"connection closed: {self.close_reason or 'closed'}")
        if self._pending_send_bytes(stream_id) > self.mesh.config.stream_send_buffer_bytes:
            return False
        self._queue_data(stream_id, data, False)
        self.transmit()
        return True

    def _queue_data(self, stream_id: int, data: bytes, end: bool) -> None:
        """Hand stream data to aioquic; a pending ACK will ride on the packet that carries it."""
        try:
            self._quic.send_stream_data(stream_id, data, end_stream=end)
        except ValueError as e:  # aioquic: the stream was reset or finished meanwhile
            raise TransportError(f"stream closed: {e}") from None
        self._flow.ack_with_data(self._loop.time())

    def reset_stream(self, stream_id: int, code: int) -> None:
        try:
            self._quic.reset_stream(stream_id, code)
            if stream_id in self._quic._streams:
                self._quic.stop_stream(stream_id, code)
        except ValueError:
            pass  # already finished on our side
        stream = self.streams.get(stream_id)
        if stream is not None:
            stream._mark_done()
        self._transmit_soon()

    def close_with(self, code: ErrorCode, reason: str) -> None:
        if not self.closing:
            self.closing = True
            self.close_code = code
            self.close_reason = reason
            self.close(error_code=int(code), reason_phrase=reason[: limits.MAX_REFUSAL_REASON_BYTES])
            self._check_close_started()

    # -- aioquic hooks (network callbacks: nothing may escape) -----------------------------------

    def _set_datagram_size(self, size: int) -> None:
        """Use ``size``-byte packets; rebuilds aioquic's loss recovery, so only before anything is sent."""
        q = self._quic
        q._max_datagram_size = size
        q._loss = QuicPacketRecovery(
            congestion_control_algorithm=q._configuration.congestion_control_algorithm,
            initial_rtt=q._configuration.initial_rtt,
            max_datagram_size=size,
            peer_completed_address_validation=not q._is_client,
            quic_logger=q._quic_logger,
            send_probe=q._send_probe,
            logger=q._logger,
        )
        if self.mesh.config.coarse_pacing:
            q._loss._pacer = CoarsePacer(max_datagram_size=size)

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        try:
            self.last_rx = self._loop.time()
            if self.remote_address is None:
                self.remote_address = (str(addr[0]), int(addr[1]))
                size = self.mesh.config.loopback_datagram_size
                if not self.is_client and size and _is_loopback(self.remote_address[0]):
                    self._set_datagram_size(size)
            self._quic.receive_datagram(bytes(data), addr, now=self._loop.time())
            self._process_events()
            self._check_close_started()
            if self.mesh.config.coalesce_transmit:
                self._transmit_soon()  # one transmit (and one ACK) for every datagram read this turn
            else:
                self.transmit()
        except Exception as e:  # noqa: BLE001 - a network callback never raises
            self.mesh._count("internal_errors")
            log.warning("transport_datagram_failed", error=repr(e))
        finally:
            self._signal_progress()

    def error_received(self, exc: Exception) -> None:
        """An ICMP error reported by the socket (e.g. nothing listens on that port)."""
        try:
            self.mesh._count("connect_unreachable")
            if self.is_client and not self.admitted and not self.result.done():
                self.result.set_exception(TransportError(f"{self._describe_remote()} unreachable: {exc}"))
                self.close_with(ErrorCode.NO_ERROR, "unreachable")
                self._finish(int(ErrorCode.NO_ERROR), None, "unreachable")
        except Exception as e:  # noqa: BLE001 - a network callback never raises
            log.warning("transport_error_received_failed", error=repr(e))

    def _describe_remote(self) -> str:
        if self.remote_address is None:
            return "peer"
        return f"{self.remote_address[0]}:{self.remote_address[1]}"

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
            elif self._refuse_at_start is not None:
                # Refused once TLS is up, so that the client gets our code and reason (an application
                # close sent during the TLS handshake loses both).
                raise RemoteProtocolError(*self._refuse_at_start)
        elif isinstance(event, qe.StreamReset):
            stream = self.streams.get(event.stream_id)
            if stream is not None:
                stream._mark_done()
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
            hs = self.handshake
            if self.is_client and hs is not None and hs.awaiting_accept:
                # The server admitted us and may already use the connection; its ACCEPT can arrive
                # after such data when packets are reordered or lost. Hold it until the ACCEPT.
                self._early_bytes += len(data)
                if self._early_bytes > limits.MAX_EARLY_STREAM_BYTES:
                    raise RemoteProtocolError(ErrorCode.NOT_ADMITTED, "too much data before the ACCEPT")
                self._early.append((stream_id, data, end))
                return
            raise RemoteProtocolError(ErrorCode.NOT_ADMITTED, "stream opened before the handshake")
        stream = self.streams.get(stream_id)
        if stream is not None and stream._app_done:
            return  # late data for a stream we are done with or reset (stock credit lets it drain)
        if stream is None:
            # aioquic only reports streams it has not discarded, so an unknown id is a new stream
            if self._is_local(stream_id):
                return
            if stream_id % 4 >= 2:
                raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "unidirectional streams are not used")
            if self._open_streams(local=False) >= self.mesh.config.max_streams_per_peer:
                self.mesh._count("streams_refused_cap")
                self.reset_stream(stream_id, ErrorCode.TOO_MANY_STREAMS)
                return
            stream = Stream(self, stream_id, None, FrameDecoder(None, (PROTOCOL_MIN, PROTOCOL_MAX)))
            self._add_stream(stream)
        stream._raw_received += len(data)
        frames = stream._decoder.feed(data)
        if end:
            stream._decoder.feed_eof()
        if stream.stream_type is None and stream._decoder.stream_type is not None:
            stream.stream_type = stream._decoder.stream_type
            if stream.stream_type in HANDSHAKE_STREAM_TYPES:
                raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR, "second handshake stream")
            self.mesh._dispatch(self, stream)
        queue_ok = stream._on_frames(frames, end, self.mesh.config.stream_recv_queue_bytes)
        self._consumed(stream)
        if not queue_ok:
            self.mesh._count("streams_reset_recv_overflow")
            stream._set_error(StreamReset(ErrorCode.RECV_OVERFLOW, "receive queue overflow"))
            self.reset_stream(stream_id, ErrorCode.RECV_OVERFLOW)

    def _on_admitted(self, ev: PeerAdmitted) -> None:
        self.admitted = True
        self.admitted_at = self._loop.time()
        self.mesh._admitted(self, ev)
        if self.is_client and not self.result.done():
            self.result.set_result(self.peer)
        early, self._early = self._early, []
        for stream_id, data, end in early:
            if self.closing:
                break
            self._on_stream_data(stream_id, data, end)

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
        """aioquic's end of the connection (after the 3 PTO closing/draining period)."""
        self._finish(event.error_code, event.frame_type, event.reason_phrase)
        if self.is_client and self._transport is not None:
            self._loop.call_later(0.05, self._transport.close)

    def _check_close_started(self) -> None:
        """React as soon as a close starts (aioquic reports it only after draining, 3 PTO later)."""
        ce = self._quic._close_event
        if ce is not None and not self.closed:
            self._finish(ce.error_code, ce.frame_type, ce.reason_phrase)

    def _finish(self, error_code: int, frame_type: int | None, reason_phrase: str) -> None:
        """Everything the rest of meshd must learn when the connection ends. Runs once."""
        if self.closed:
            return
        if not self.is_client and not self.admitted and self.close_code is None:
            # closed by the peer or by aioquic before admission: TLS failure (e.g. wrong ALPN) or a quitter
            self.mesh._count("handshakes_abandoned" if frame_type is None else "handshakes_tls_failed")
            self.mesh._ratelog.debug(
                self._loop.time(), "connection_failed_before_admission", addr=self.remote_address,
                code=error_code, reason=reason_phrase,
            )
        self.closed = True
        self.closing = True
        self.finished.set()
        if self.close_code is None:
            self.close_code = error_code
            self.close_reason = reason_phrase
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        reason = reason_phrase or "connection closed"
        err = TransportError(f"connection closed: {reason}")
        for stream in self.streams.values():
            stream._set_error(err)
            if stream._handler_task is not None:
                stream._handler_task.cancel()
        for task in self._tasks:
            task.cancel()
        if not self.result.done():
            app_close = frame_type is None
            if app_close and error_code == ErrorCode.JOIN_REFUSED and self.mode is Mode.JOIN:
                self.result.set_exception(JoinRefused(reason))
            elif app_close and error_code != ErrorCode.NO_ERROR:
                self.result.set_exception(HandshakeRefused(reason, error_code))
            else:
                self.result.set_exception(TransportError(f"connection failed: {reason}"))
            self.result.exception()  # mark retrieved: nobody may be waiting any more
        self._signal_progress()
        self.mesh._terminated(self)

    # -- timers ----------------------------------------------------------------------------------

    def _deadline(self) -> None:
        if self.closed or self.admitted:
            return
        if self.is_client and self.handshake is None and not self.result.done():
            # TLS never completed: nobody (or no meshd) answers there; not a refusal
            self.result.set_exception(TransportError(f"no answer from {self._describe_remote()}"))
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

    def discard(self) -> None:
        """Forget a connection that never got a valid packet (no close is sent: there is nobody)."""
        self.closed = self.closing = True
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.mesh._conns.discard(self)

    def _consumed(self, stream: Stream) -> None:
        """Tell the flow controller how much of ``stream`` the application has taken; send credit soon
        if the announced window fell below half."""
        sid = stream.stream_id
        if stream._app_done or sid not in self._flow.app_consumed:
            return
        consumed = stream._raw_received - stream._raw_queued
        self._flow.app_consumed[sid] = consumed
        qstream = self._quic._streams.get(sid)
        if qstream is not None and consumed + self._flow.app_window - qstream.max_stream_data_local >= (
            self._flow.app_window // 2
        ):
            self._transmit_soon()

    def _open_streams(self, local: bool) -> int:
        return sum(1 for s in self.streams.values() if not s._app_done and self._is_local(s.stream_id) == local)

    def _add_stream(self, stream: Stream) -> None:
        if len(self.streams) >= self._prune_at:
            live = self._quic._streams
            for sid in [sid for sid, s in self.streams.items() if s._app_done and sid not in live]:
                del self.streams[sid]
                self._flow.app_consumed.pop(sid, None)
            self._prune_at = max(64, 2 * len(self.streams))
        self.streams[stream.stream_id] = stream
        self._flow.app_consumed[stream.stream_id] = 0

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


class _MeshServer(QuicServer):
    """aioquic's server, counting what it drops (garbage, packets for no connection)."""

    def __init__(self, *, mesh: MeshTransport, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._mesh = mesh
        self._known_cids: set[bytes] = set()  # initial cids of connections that got past their first packet

    def _connection_terminated(self, protocol: QuicConnectionProtocol) -> None:
        for cid, proto in self._protocols.items():
            if proto is protocol:
                self._known_cids.discard(cid)
        super()._connection_terminated(protocol)

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        mesh = self._mesh
        try:
            try:
                header = pull_quic_header(
                    Buffer(data=bytes(data)), host_cid_length=self._configuration.connection_id_length
                )
            except ValueError:
                mesh._count("datagrams_garbage")
                mesh._ratelog.debug(time.monotonic(), "datagram_garbage", addr=addr, size=len(data))
                return
            cid = header.destination_cid
            if cid not in self._protocols:
                if not (header.packet_type == QuicPacketType.INITIAL and len(data) >= 1200):
                    mesh._count("datagrams_dropped")
                    mesh._ratelog.debug(time.monotonic(), "datagram_dropped", addr=addr, size=len(data))
                elif mesh._pending_handshakes() >= mesh.config.max_pending_handshakes:
                    mesh._count("refused_pending_handshakes")
                    mesh._ratelog.debug(time.monotonic(), "connection_refused_pending_cap", addr=addr)
                    return
            super().datagram_received(data, addr)
            new = self._protocols.get(cid) if cid not in self._known_cids else None
            if isinstance(new, _Connection):
                if new._quic._state == QuicConnectionState.FIRSTFLIGHT:
                    # an Initial that did not decrypt: forget the connection it would have created
                    mesh._count("datagrams_garbage_initial")
                    self._connection_terminated(new)
                    new.discard()
                else:
                    self._known_cids.add(cid)
        except Exception as e:  # noqa: BLE001 - a network callback never raises
            mesh._count("internal_errors")
            log.warning("transport_server_datagram_failed", error=repr(e))


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


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an address) is loopback, IPv4 seen through an IPv6 socket (::ffff:127.0.0.1) too."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


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

    def _quic_config(self, is_client: bool, loopback: bool = False) -> QuicConfiguration:
        size = self.config.max_datagram_size
        if loopback and self.config.loopback_datagram_size:
            size = self.config.loopback_datagram_size
        cfg = QuicConfiguration(
            is_client=is_client,
            alpn_protocols=[ALPN],
            idle_timeout=self.config.idle_timeout_s,
            max_datagram_size=size,
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
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _MeshServer(
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

    async def connect(self, addr: Address, expected_node_id: str | None = None) -> Peer:
        """Dial and authenticate. Raises HandshakeRefused(reason) or TransportError."""
        if expected_node_id is not None and (existing := self.peer(expected_node_id)) is not None:
            return existing
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
        quic = QuicConnection(configuration=self._quic_config(True, _is_loopback(str(sockaddr[0]))))
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

    def _pending_handshakes(self) -> int:
        return sum(1 for c in self._conns if not c.admitted and not c.closing and not c.is_client)

    def _admission_capacity(self) -> tuple[ErrorCode, str] | None:
        if self._closing:
            return (ErrorCode.SHUTDOWN, "node shutting down")
        if len(self._conns) > self.config.max_connections:
            return (ErrorCode.TOO_MANY_CONNECTIONS, "too many connections")
        if self._pending_handshakes() > self.config.max_pending_handshakes:
            return (ErrorCode.TOO_MANY_CONNECTIONS, "too many pending handshakes")
        return None

    def _admitted(self, conn: _Connection, ev: PeerAdmitted) -> None:
        peer = self._known.get(ev.node_id)
        if peer is None:
            peer = self._known[ev.node_id] = Peer(self, ev.node_id, ev.public_key)
        old = peer._conn
        if old is not None and old is not conn and not old.closing:
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
                stype = stream.stream_type
                if stype is not None and len(reply) > max_frame_bytes(stype):
                    raise ValueError(f"reply of {len(reply)} bytes exceeds the {stype.name} frame limit")
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
        """The stream's user is done with it: free its slot (late data for it is dropped)."""
        stream._mark_done()
