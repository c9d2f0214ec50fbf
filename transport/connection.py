"""One QUIC connection (aioquic's protocol): the handshake, the streams, and every close with its code.

It feeds the sans-I/O cores (``framing``, ``handshake``) and turns every ``RemoteProtocolError`` into a
connection close in one place (``_Connection._fail``). Made by ``transport.quic.MeshTransport``, whose
state (config, handlers, counters, peers) it reaches through ``mesh``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.quic import events as qe
from aioquic.quic.connection import QuicConnection
from aioquic.quic.recovery import QuicPacketRecovery

from transport import ALPN, ALPN_RETIRED, PROTOCOL_MAX, PROTOCOL_MIN, PROTOCOL_VERSION, limits
from transport.admission import Stage
from transport.aioquic_ext import CoarsePacer, MeshQuicConnection
from transport.config import is_loopback_host
from transport.errors import (
    HandshakeRefused,
    JoinRefused,
    StreamReset,
    TransportError,
)
from transport.framing import (
    ErrorCode,
    FrameDecoder,
    RemoteProtocolError,
    encode_preamble,
)
from transport.handshake import (
    Handshake,
    JoinReplied,
    JoinRequested,
    MembershipProven,
    Mode,
    PeerAdmitted,
    tls_binding,
)
from transport.stream import Stream
from transport.streams import HANDSHAKE_STREAM_TYPES, StreamType
from transport.tls import certificate_der

if TYPE_CHECKING:
    from transport.quic import Address, MeshTransport, Peer

log = structlog.get_logger("meshd.transport")

_HANDSHAKE_STREAM_ID = 0  # the first client-initiated bidirectional stream
_TLS_NO_APPLICATION_PROTOCOL = 0x100 + 120  # QUIC CRYPTO_ERROR carrying TLS alert no_application_protocol


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
        self.proven = False  # server: the peer proved membership (never evicted as a pending handshake)
        self.tls_done = False
        self.hinted = False  # server: its first Initial carried a valid member hint (evicted last)
        self.started_at = self._loop.time()
        self._discarded = False
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
            self._timers.append(
                self._loop.call_later(mesh.config.first_frame_timeout_s, self._guarded, self._first_frame_deadline)
            )
        self._timers.append(self._loop.call_later(mesh.config.handshake_timeout_s, self._guarded, self._deadline))
        if mesh.config.keepalive_interval_s > 0:
            self._timers.append(self._loop.call_later(mesh.config.keepalive_interval_s, self._guarded, self._tick))

    # -- public to the transport -----------------------------------------------------------------

    @property
    def rtt_ms(self) -> float | None:
        """aioquic's smoothed round trip; None only before the first sample (never a silent default: a
        renamed attribute raises, see tests/test_transport_aioquic_pins.py)."""
        loss = self._quic._loss
        return round(loss._rtt_smoothed * 1000.0, 3) if loss._rtt_initialized else None

    @property
    def stage(self) -> Stage:
        """How far an unproven server-side handshake got (what eviction looks at)."""
        if self.handshake is not None:
            return Stage.TALKING
        return Stage.SILENT if self.tls_done else Stage.TLS

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
                if not self.is_client and size and is_loopback_host(self.remote_address[0]):
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
            self.tls_done = True
            if self.is_client:
                self._start_client_handshake()
            elif event.alpn_protocol in ALPN_RETIRED:
                raise RemoteProtocolError(
                    ErrorCode.UNSUPPORTED_VERSION, f"this node speaks {ALPN}, not {event.alpn_protocol}: upgrade meshd"
                )
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
        cert = self._quic.tls._peer_certificate
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
            elif isinstance(ev, MembershipProven):
                self.proven = True  # holds the mesh's genesis: no longer a stranger's handshake to evict
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
        self.proven = True
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
            elif error_code == _TLS_NO_APPLICATION_PROTOCOL:
                self.result.set_exception(
                    TransportError(f"{self._describe_remote()} does not speak {ALPN} (an older meshd?)")
                )
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

    def _first_frame_deadline(self) -> None:
        """Server: a client that has not begun the meshd handshake by now holds a slot for nothing."""
        if self.closed or self.handshake is not None or self.admitted:
            return
        raise RemoteProtocolError(ErrorCode.HANDSHAKE_TIMEOUT, "no handshake frame in time")

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
        """Forget this connection now: no timer, no queued transmit, nothing that keeps it alive (whatever
        is still queued is not sent). For a connection refused on its first datagram."""
        self.closed = self.closing = True
        self._discarded = True
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._transmit_task is not None:
            self._transmit_task.cancel()
            self._transmit_task = None
        self.mesh._conns.discard(self)

    def transmit(self) -> None:
        if not self._discarded:
            super().transmit()

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
