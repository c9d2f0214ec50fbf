"""One data lane (``transport.lane``): TLS 1.3 over TCP, the proof of identity inside it
(``transport.lane_wire``), then streams multiplexed over it, each a ``transport.stream.Stream`` whose carrier
is the :class:`LaneConnection`. Made and attached to peers by ``transport.lane.LaneManager``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from transport import PROTOCOL_MAX, PROTOCOL_MIN, PROTOCOL_VERSION, lane_wire, limits
from transport.errors import StreamReset, TransportError
from transport.framing import ErrorCode, FrameDecoder, RemoteProtocolError, encode_preamble
from transport.identity import NodeIdentity, node_id_from_public_key
from transport.lane_wire import MuxKind
from transport.stream import Stream
from transport.stream_api import PATH_LANE, Address
from transport.streams import LANE_ACCEPTED_TYPES, StreamType
from transport.tls import self_signed_certificate

if TYPE_CHECKING:
    from transport.lane import LaneManager

log = structlog.get_logger("meshd.transport")

_JOIN_BELOW_BYTES = 16 * 1024  # messages up to this size are joined into one TLS record (each piece
#   written separately becomes a record of its own: header + AEAD tag + one more encryption call)


@dataclass(frozen=True, slots=True)
class LaneConfig:
    """Lane tuning; times in seconds, sizes in bytes."""

    auth_timeout_s: float = limits.LANE_AUTH_TIMEOUT_S
    connect_timeout_s: float = 5.0  # a dial (TCP + TLS + proof) by a member
    max_pending: int = limits.LANE_MAX_PENDING
    max_pending_per_source: int = limits.LANE_MAX_PENDING_PER_SOURCE
    max_lanes: int = limits.LANE_MAX_CONNECTIONS
    keepalive_s: float = limits.LANE_KEEPALIVE_S
    dead_s: float = limits.LANE_DEAD_S
    retry_min_s: float = limits.LANE_RETRY_MIN_S
    retry_max_s: float = limits.LANE_RETRY_MAX_S
    send_buffer_bytes: int = limits.LANE_SEND_BUFFER_BYTES


def _server_context(identity: NodeIdentity) -> ssl.SSLContext:
    """TLS 1.3 server context with the node's self-signed certificate (loaded without touching disk
    where the platform allows: a memfd)."""
    cert = self_signed_certificate(identity)
    pem = cert.public_bytes(serialization.Encoding.PEM) + identity.private_key().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    memfd = getattr(os, "memfd_create", None)
    if memfd is not None:
        fd = memfd("meshd-lane", 0)
        try:
            os.write(fd, pem)
            ctx.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
    else:  # pragma: no cover - non-Linux
        with tempfile.NamedTemporaryFile() as f:  # created 0600
            f.write(pem)
            f.flush()
            ctx.load_cert_chain(f.name)
    return ctx


def _client_context() -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # the certificate is checked against the QUIC-proven key below
    return ctx


def _cert_public_key(der: bytes) -> bytes | None:
    try:
        key = x509.load_der_x509_certificate(der).public_key()
    except ValueError:
        return None
    if not isinstance(key, Ed25519PublicKey):
        return None
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class LaneConnection(asyncio.Protocol):
    """One lane: the proof of identity, then streams (a ``StreamCarrier`` for ``Stream``)."""

    path = PATH_LANE

    def __init__(self, manager: LaneManager, is_client: bool, peer: Any = None,
                 source: str | None = None) -> None:
        self.manager = manager
        self.is_client = is_client
        self.peer: Any = peer  # client: the peer dialled; server: set once it proved its key
        self.remote_address: Address | None = None
        self.open = False
        self.closed = False
        self.close_reason = ""
        self.closed_event = asyncio.Event()
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._raw: asyncio.Transport | None = None  # server: the TCP transport while TLS is being set up
        self._source = source  # server: counted in the manager's pending caps until open or closed
        self._sniff_cleanup: Any = None  # server: ends LaneManager._sniff_start's wait
        self._early = bytearray()  # auth bytes (and, server, bytes that beat the TLS transport's hand-over)
        self._nonce = os.urandom(lane_wire.NONCE_BYTES)
        self._pub_c = self._pub_s = self._nonce_c = self._nonce_s = self._cert_hash = b""
        self._auth_step = 0
        self._decoder = lane_wire.MuxDecoder()
        self.streams: dict[int, Stream] = {}
        self._next_sid = 0 if is_client else 1
        self._max_remote_sid = -1
        self._preambles: dict[int, bytes] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._drain: asyncio.Future[None] | None = None
        self._throttled_by: Stream | None = None  # the stream whose unread input stopped the lane's reading
        self._throttle_at = max(1, manager.mesh.config.stream_recv_queue_bytes // 2)
        self._mss = 1448
        self.last_rx = self._loop.time()
        self._timers: list[asyncio.TimerHandle] = [
            self._loop.call_later(manager.config.auth_timeout_s if not is_client else
                                  manager.config.connect_timeout_s, self._auth_deadline)]

    # -- the StreamCarrier interface -------------------------------------------------------------

    @property
    def max_datagram_bytes(self) -> int:
        return self._mss

    async def write(self, stream_id: int, parts: Sequence[bytes], end: bool) -> None:
        while True:
            self._check_writable(stream_id)
            t = self._transport
            assert t is not None  # noqa: S101 - open
            if t.get_write_buffer_size() <= self.manager.config.send_buffer_bytes:
                break
            if self._drain is None or self._drain.done():
                self._drain = self._loop.create_future()
            await self._drain
        self._send(stream_id, parts, end)

    def write_now(self, stream_id: int, parts: Sequence[bytes]) -> bool:
        self._check_writable(stream_id)
        t = self._transport
        assert t is not None  # noqa: S101 - open
        if t.get_write_buffer_size() > self.manager.config.send_buffer_bytes:
            return False
        self._send(stream_id, parts, False)
        return True

    def reset_stream(self, stream_id: int, code: int) -> None:
        self._preambles.pop(stream_id, None)
        if self.streams.pop(stream_id, None) is not None and self.open and not self.closed:
            assert self._transport is not None  # noqa: S101 - open
            self._transport.write(lane_wire.encode_reset(stream_id, int(code)))

    def stream_done(self, stream_id: int) -> None:
        stream = self.streams.pop(stream_id, None)
        if stream is not None and stream is self._throttled_by:
            self._unthrottle()

    def consumed(self, stream: Any) -> None:
        """The application took input from ``stream``: if it was the one holding the lane's reading, and
        it is under half the limit again, read on."""
        held = self._throttled_by
        if held is not None and stream is held and held.queued_bytes <= self._throttle_at // 2:
            self._unthrottle()

    def _throttle(self, stream: Stream) -> None:
        """A stream's reader fell behind: stop reading the lane (TCP then slows the sender, as QUIC's
        per-stream credit would) until it catches up. Other streams on the lane wait meanwhile."""
        if self._throttled_by is None and self._transport is not None:
            self._throttled_by = stream
            self.manager.count("lane_read_paused")
            self._transport.pause_reading()

    def _unthrottle(self) -> None:
        self._throttled_by = None
        if self._transport is not None and not self.closed:
            self._transport.resume_reading()

    # -- streams ---------------------------------------------------------------------------------

    def open_stream(self, stream_type: StreamType) -> Stream:
        if not self.open or self.closed:
            raise TransportError("lane not open")
        if stream_type not in LANE_ACCEPTED_TYPES:
            raise TransportError(f"{stream_type.name} streams do not use the lane")
        local = sum(1 for sid in self.streams if (sid & 1) == (0 if self.is_client else 1))
        if local >= self.manager.mesh.config.max_streams_per_peer:
            raise TransportError("too many open streams to this peer")
        sid = self._next_sid
        self._next_sid += 2
        stream = Stream(self, sid, stream_type, FrameDecoder(stream_type))
        self.streams[sid] = stream
        self._preambles[sid] = encode_preamble(stream_type, PROTOCOL_VERSION)
        return stream

    def _check_writable(self, stream_id: int) -> None:
        if self.closed or not self.open:
            raise TransportError(f"lane closed: {self.close_reason or 'closed'}")
        stream = self.streams.get(stream_id)
        if stream is None:
            raise TransportError("stream closed")

    def _send(self, stream_id: int, parts: Sequence[bytes], end: bool) -> None:
        """One write of one message: record header, (preamble), frame pieces, (FIN); a large payload is never
        joined or copied before encryption."""
        pieces: list[bytes] = []
        size = sum(len(p) for p in parts)
        pre = self._preambles.pop(stream_id, None)
        if pre is not None:
            size += len(pre)
        if size:
            pieces.append(lane_wire.mux_header(MuxKind.DATA, stream_id, size))
            if pre is not None:
                pieces.append(pre)
            pieces.extend(p for p in parts if p)
        if end:
            pieces.append(lane_wire.mux_header(MuxKind.FIN, stream_id, 0))
        if pieces:
            assert self._transport is not None  # noqa: S101 - checked by _check_writable
            if size <= _JOIN_BELOW_BYTES:
                self._transport.write(b"".join(pieces))  # one TLS record for a small message
            else:  # headers, then the payload as it is: TLS encrypts it from where it lies
                self._transport.writelines((b"".join(pieces[:-1]), pieces[-1]) if not end else
                                           (b"".join(pieces[:-2]), pieces[-2], pieces[-1]))

    # -- asyncio protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Client: TLS is up (``create_connection`` with ``ssl``)."""
        self._tls_up(transport)  # type: ignore[arg-type]

    def _tls_up(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        peername = transport.get_extra_info("peername")
        if peername is not None:
            self.remote_address = (str(peername[0]), int(peername[1]))
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._mss = max(536, sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG))
        try:
            if self.is_client:
                self._client_start()
            elif self._early:
                data, self._early = bytes(self._early), bytearray()
                self._input(data)
        except RemoteProtocolError as e:
            self._fail(e)

    def data_received(self, data: bytes) -> None:
        try:
            self.last_rx = self._loop.time()
            if self._transport is None:
                self._early += data  # server: TLS data that arrived before start_tls handed us the transport
                return
            self._input(data)
        except RemoteProtocolError as e:
            self._fail(e)
        except Exception as e:  # noqa: BLE001 - a network callback never raises
            self.manager.count("lane_internal_errors")
            log.warning("lane_internal_error", error=repr(e))
            self._fail(RemoteProtocolError(ErrorCode.INTERNAL_ERROR, "internal error"))

    def eof_received(self) -> bool | None:
        self.close("peer closed the lane")
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.close("connection lost" if exc is None else f"connection lost: {exc}")

    def pause_writing(self) -> None:
        pass  # write() checks the buffer size itself

    def resume_writing(self) -> None:
        fut = self._drain
        if fut is not None and not fut.done():
            fut.set_result(None)

    # -- the proof of identity -------------------------------------------------------------------

    def _client_start(self) -> None:
        assert self._transport is not None and self.peer is not None  # noqa: S101
        sslobj = self._transport.get_extra_info("ssl_object")
        der = sslobj.getpeercert(binary_form=True) if sslobj is not None else None
        if not der or _cert_public_key(der) != self.peer.public_key:
            raise RemoteProtocolError(ErrorCode.HANDSHAKE_FAILED, "lane certificate is not the peer's node key")
        self._cert_hash = lane_wire.cert_hash(der)
        self._pub_c, self._pub_s = self.manager.identity.public_key, self.peer.public_key
        self._nonce_c = self._nonce
        self._transport.write(lane_wire.encode_hello(self._pub_c, self._nonce_c))

    def _input(self, data: bytes) -> None:
        if self.open:
            self._records(self._decoder.feed(data))
            return
        self._early += data
        while not self.open and not self.closed:
            need = self._auth_need()
            if len(self._early) < need:
                return
            msg, self._early = bytes(self._early[:need]), self._early[need:]
            self._auth(msg)
        if self.open and self._early:
            data, self._early = bytes(self._early), bytearray()
            self._records(self._decoder.feed(data))

    def _auth_need(self) -> int:
        if self.is_client:
            if self._auth_step == 0:
                return lane_wire.SERVER_AUTH_BYTES
            if len(self._early) >= 2:
                return 2 + self._early[1]
            return 2
        return lane_wire.HELLO_BYTES if self._auth_step == 0 else lane_wire.CLIENT_AUTH_BYTES

    def _auth(self, msg: bytes) -> None:
        m, ident = self.manager, self.manager.identity
        assert self._transport is not None  # noqa: S101
        if self.is_client and self._auth_step == 0:
            self._nonce_s, sig_s = msg[: lane_wire.NONCE_BYTES], msg[lane_wire.NONCE_BYTES:]
            lane_wire.verify(self._pub_s, sig_s, False, self._pub_c, self._pub_s, self._nonce_c, self._nonce_s,
                             self._cert_hash)
            self._transport.write(lane_wire.sign(ident, True, self._pub_c, self._pub_s, self._nonce_c,
                                                 self._nonce_s, self._cert_hash))
            self._auth_step = 1
        elif self.is_client:
            if msg[0] != 0:
                reason = msg[2:].decode("utf-8", "replace")
                raise RemoteProtocolError(ErrorCode.REFUSED, f"lane refused: {reason}")
            self._opened()
        elif self._auth_step == 0:
            self._pub_c, self._nonce_c = lane_wire.decode_hello(msg)
            node_id = node_id_from_public_key(self._pub_c)
            peer = m.mesh.peer(node_id)
            if peer is None or peer.public_key != self._pub_c:
                self._refuse("not a connected member")
                return
            self.peer = peer
            self._pub_s, self._nonce_s, self._cert_hash = ident.public_key, self._nonce, m.cert_hash
            sig = lane_wire.sign(ident, False, self._pub_c, self._pub_s, self._nonce_c, self._nonce_s,
                                 self._cert_hash)
            self._transport.write(self._nonce_s + sig)
            self._auth_step = 1
        else:
            lane_wire.verify(self._pub_c, msg, True, self._pub_c, self._pub_s, self._nonce_c, self._nonce_s,
                             self._cert_hash)
            if m.lane_count() >= m.config.max_lanes:
                self._refuse("too many lanes")
                return
            self._transport.write(lane_wire.encode_ready(True))
            self._opened()

    def _refuse(self, reason: str) -> None:
        self.manager.count("lanes_refused")
        if self._transport is not None:
            self._transport.write(lane_wire.encode_ready(False, reason))
        self.close(f"refused: {reason}")

    def _opened(self) -> None:
        self.open = True
        self.manager.unpend(self)
        for t in self._timers:
            t.cancel()
        self._timers = [self._loop.call_later(self.manager.config.keepalive_s, self._tick)]
        if not self.ready.done():
            self.ready.set_result(None)
        self.manager.attach(self)

    def _auth_deadline(self) -> None:
        if not self.open and not self.closed:
            self.manager.count("lane_auth_timeouts")
            self._fail(RemoteProtocolError(ErrorCode.HANDSHAKE_TIMEOUT, "lane proof not done in time"))

    def _tick(self) -> None:
        if self.closed or self._transport is None:
            return
        cfg = self.manager.config
        silent = self._loop.time() - self.last_rx
        if silent >= cfg.dead_s:
            self.manager.count("lanes_dead")
            self.close("peer stopped answering on the lane")
            return
        if silent >= cfg.keepalive_s:
            self._transport.write(lane_wire.mux_header(MuxKind.PING, 0, 0))
        self._timers = [self._loop.call_later(cfg.keepalive_s / 2, self._tick)]

    # -- streams in --------------------------------------------------------------------------------

    def _records(self, records: list[lane_wire.MuxRecord]) -> None:
        limit = self.manager.mesh.config.stream_recv_queue_bytes
        for rec in records:
            if self.closed:
                return
            kind, sid = rec.kind, rec.stream_id
            if kind is MuxKind.PING:
                assert self._transport is not None  # noqa: S101
                self._transport.write(lane_wire.mux_header(MuxKind.PONG, 0, 0))
                continue
            if kind is MuxKind.PONG:
                continue
            stream = self.streams.get(sid)
            if stream is None:
                if kind is not MuxKind.DATA or (sid & 1) == (0 if self.is_client else 1) \
                        or sid <= self._max_remote_sid:
                    continue  # late input for a stream finished here
                stream = self._new_remote(sid)
                if stream is None:
                    continue
            if kind is MuxKind.RESET:
                (code,) = struct.unpack(">H", rec.payload)
                stream.fail(StreamReset(code))
                continue
            if stream.done:
                continue
            if kind is MuxKind.DATA:
                frames = stream.decoder.feed(rec.payload)
                end = False
            else:
                stream.decoder.feed_eof()
                frames, end = [], True
            if stream.stream_type is None and stream.decoder.stream_type is not None:
                stream.stream_type = stream.decoder.stream_type
                if stream.stream_type not in LANE_ACCEPTED_TYPES:
                    raise RemoteProtocolError(ErrorCode.PROTOCOL_ERROR,
                                              f"{stream.stream_type.name} stream on a lane")
                self.manager.mesh.dispatch_stream(self, stream)
            if not stream.deliver(frames, end, limit):
                self.manager.count("lane_streams_reset_recv_overflow")
                stream.fail(StreamReset(ErrorCode.RECV_OVERFLOW, "receive queue overflow"))
                self.reset_stream(sid, ErrorCode.RECV_OVERFLOW)
            elif stream.queued_bytes > self._throttle_at and not stream.done:
                self._throttle(stream)

    def _new_remote(self, sid: int) -> Stream | None:
        self._max_remote_sid = sid
        remote = sum(1 for s in self.streams if (s & 1) != (0 if self.is_client else 1))
        if remote >= self.manager.mesh.config.max_streams_per_peer:
            self.manager.count("lane_streams_refused_cap")
            assert self._transport is not None  # noqa: S101
            self._transport.write(lane_wire.encode_reset(sid, ErrorCode.TOO_MANY_STREAMS))
            return None
        stream = Stream(self, sid, None, FrameDecoder(None, (PROTOCOL_MIN, PROTOCOL_MAX)))
        self.streams[sid] = stream
        return stream

    # -- the end -----------------------------------------------------------------------------------

    def _fail(self, e: RemoteProtocolError) -> None:
        self.manager.count(f"lane_refused_{e.code.name.lower()}")
        self.manager.ratelog("lane_failed", code=e.code.name, reason=e.reason, addr=self.remote_address,
                             peer=getattr(self.peer, "node_id", None))
        if not self.ready.done():
            self.ready.set_exception(TransportError(f"lane failed: {e.reason}"))
            self.ready.exception()
        self.close(e.reason)

    def close(self, reason: str) -> None:
        """Close the lane (abortively: nothing more is read or sent). Its streams fail with TransportError."""
        if self.closed:
            return
        self.closed = True
        self.close_reason = reason
        self.manager.unpend(self)
        for t in self._timers:
            t.cancel()
        self._timers.clear()
        if self._sniff_cleanup is not None:
            cleanup, self._sniff_cleanup = self._sniff_cleanup, None
            cleanup()
        if self._transport is not None:
            self._transport.abort()
        elif self._raw is not None:
            self._raw.abort()  # still in TLS: a stranger holds nothing once refused
        err = TransportError(f"lane closed: {reason}")
        for stream in list(self.streams.values()):
            stream.fail(err)
        self.streams.clear()
        for task in list(self._tasks):
            task.cancel()
        fut = self._drain
        if fut is not None and not fut.done():
            fut.set_result(None)
        if not self.ready.done():
            self.ready.set_exception(TransportError(f"lane closed: {reason}"))
            self.ready.exception()
        self.closed_event.set()
        self.manager.detach(self)
