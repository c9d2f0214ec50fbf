"""The data lane: TLS 1.3 over TCP between members already admitted over QUIC, for bulk and
latency-critical streams (``streams.LANE_STREAM_TYPES``: expert RPC, pipeline activations).

aioquic's per-packet Python work caps QUIC at a few hundred MB/s and adds ~0.3 ms per round trip; the
kernel's TCP and OpenSSL do not. A lane carries the same streams (``transport.stream.Stream``, the same
preamble and frames) multiplexed over one TLS connection (``transport.lane_wire``), bound to the node keys
both sides proved over QUIC; see ``lane_wire`` for the proof and why a TLS-terminating middlebox fails.

``LaneManager`` listens (``--lane-listen``), keeps one lane per connected member (the member with the
smaller node id dials, at the port the other reports over a RELAY control request), attaches it to the
``Peer`` (``Peer.open_stream`` then puts lane stream types on it) and redials a lost lane with backoff
while the QUIC connection lasts. A lane that dies fails its open streams as a reset would; new streams use
QUIC until the lane is back. Strangers are refused within ``LANE_AUTH_TIMEOUT_S`` with per-source and total
caps on connections still authenticating, checked before TLS costs anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import ssl
import struct
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from transport import PROTOCOL_MAX, PROTOCOL_MIN, PROTOCOL_VERSION, lane_wire, limits
from transport.config import backoff_delay_s
from transport.errors import StreamReset, TransportError
from transport.framing import ErrorCode, FrameDecoder, RemoteProtocolError, encode_preamble
from transport.identity import NodeIdentity, node_id_from_public_key
from transport.lane_wire import MuxKind
from transport.stream import Stream
from transport.stream_api import PATH_LANE, PATH_RELAY, Address
from transport.streams import LANE_STREAM_TYPES, StreamType
from transport.tls import certificate_der, self_signed_certificate

log = structlog.get_logger("meshd.transport")

_JOIN_BELOW_BYTES = 16 * 1024  # messages up to this size are joined into one TLS record (each piece
#   written separately becomes a record of its own: header + AEAD tag + one more encryption call)
CONTROL_LANE_PORT = b"\x01"  # RELAY control request: "which TCP port is your lane on?" -> u16 (0 = none)


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
        if stream is self._throttled_by and stream.queued_bytes <= self._throttle_at // 2:
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
        if stream_type not in LANE_STREAM_TYPES:
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
                if stream.stream_type not in LANE_STREAM_TYPES:
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


class _Accept(asyncio.Protocol):
    """A fresh TCP connection on the lane port: capped per source before any TLS work, then handed over."""

    def __init__(self, manager: LaneManager) -> None:
        self.manager = manager

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        raw: asyncio.Transport = transport  # type: ignore[assignment]
        raw.pause_reading()  # start_tls resumes it; nothing may be read before the TLS protocol is in place
        peername = raw.get_extra_info("peername")
        source = str(peername[0]) if peername else "?"
        self.manager.accept(raw, source)

    def data_received(self, data: bytes) -> None:  # pragma: no cover - reading is paused until start_tls
        pass


class LaneManager:
    """One node's lanes: the listener, a dialler per connected member, and their attachment to peers."""

    def __init__(self, mesh: Any, config: LaneConfig | None = None, rng: random.Random | None = None) -> None:
        self.mesh = mesh
        self.identity: NodeIdentity = mesh.identity
        self.config = config or LaneConfig()
        self.address: Address | None = None
        self.on_path_change: list[Callable[[Any], Any]] = []
        self.stats: dict[str, int] = {}
        self._rng = rng or random.Random()
        self._server_ctx = _server_context(self.identity)
        self._client_ctx = _client_context()
        self.cert_hash = lane_wire.cert_hash(certificate_der(self_signed_certificate(self.identity)))
        self._server: asyncio.AbstractServer | None = None
        self._pending: dict[str, int] = {}
        self._pending_conns: set[LaneConnection] = set()
        self._lanes: dict[str, LaneConnection] = {}
        self._dialers: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._last_log = 0.0
        self._closing = False
        mesh.lane = self
        mesh.on_peer_up.append(self._peer_up)
        mesh.on_peer_down.append(self._peer_down)
        mesh.on_path_change.append(self._path_moved)
        mesh.on_stream(StreamType.RELAY, self._control)

    # -- lifecycle -------------------------------------------------------------------------------

    async def listen(self, host: str, port: int) -> Address:
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_server(lambda: _Accept(self), host, port, reuse_address=True)
        except OSError as e:
            raise TransportError(f"cannot listen on {host}:{port} (TCP): {e.strerror or e}") from None
        sockname = self._server.sockets[0].getsockname()
        self.address = (str(sockname[0]), int(sockname[1]))
        for peer in self.mesh.peers():  # members connected before the lane started
            self._peer_up(peer)
        return self.address

    async def close(self) -> None:
        self._closing = True
        for task in list(self._dialers.values()) + list(self._tasks):
            task.cancel()
        for lane in list(self._lanes.values()) + list(self._pending_conns):
            lane.close("node shutting down")
        if self._server is not None:
            self._server.close()
            self._server = None

    def lane_count(self) -> int:
        return len(self._lanes)

    def status(self) -> dict[str, Any]:
        return {"address": None if self.address is None else f"{self.address[0]}:{self.address[1]}",
                "lanes": sorted(self._lanes), "pending": len(self._pending_conns), "stats": dict(self.stats)}

    # -- bookkeeping -------------------------------------------------------------------------------

    def count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1

    def ratelog(self, event: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self._last_log >= self.mesh.config.log_interval_s:
            self._last_log = now
            log.debug(event, **fields)

    def unpend(self, lane: LaneConnection) -> None:
        if lane in self._pending_conns:
            self._pending_conns.discard(lane)
            src = lane._source or "?"
            n = self._pending.get(src, 0) - 1
            if n > 0:
                self._pending[src] = n
            else:
                self._pending.pop(src, None)

    def attach(self, lane: LaneConnection) -> None:
        peer = lane.peer
        node_id = peer.node_id
        if self.mesh.peer(node_id) is not peer:
            lane.close("the member's QUIC connection is gone")
            return
        old = self._lanes.get(node_id)
        self._lanes[node_id] = lane
        peer._lane = lane
        if old is not None and old is not lane:
            old.close("replaced by a newer lane")
        self.count("lanes_opened")
        log.info("lane_up", peer=node_id, addr=lane.remote_address, outbound=lane.is_client)
        self._changed(peer)

    def detach(self, lane: LaneConnection) -> None:
        peer = lane.peer
        if peer is None or self._lanes.get(peer.node_id) is not lane:
            return
        del self._lanes[peer.node_id]
        if getattr(peer, "_lane", None) is lane:
            peer._lane = None
        log.info("lane_down", peer=peer.node_id, reason=lane.close_reason)
        if not self._closing:
            self._changed(peer)

    def _changed(self, peer: Any) -> None:
        for cb in list(self.on_path_change):
            try:
                result = cb(peer)
                if asyncio.iscoroutine(result):
                    self._spawn(result)
            except Exception as e:  # noqa: BLE001
                log.warning("lane_path_callback_failed", error=repr(e))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- accepting -------------------------------------------------------------------------------

    def accept(self, raw: asyncio.Transport, source: str) -> None:
        cfg = self.config
        if self._closing or len(self._pending_conns) >= cfg.max_pending:
            self.count("lane_refused_pending_cap")
            raw.abort()
            return
        if self._pending.get(source, 0) >= cfg.max_pending_per_source:
            self.count("lane_refused_source_cap")
            raw.abort()
            return
        lane = LaneConnection(self, False, source=source)
        lane._raw = raw
        self._pending[source] = self._pending.get(source, 0) + 1
        self._pending_conns.add(lane)
        self._spawn(self._start_tls(raw, lane))

    async def _start_tls(self, raw: asyncio.Transport, lane: LaneConnection) -> None:
        loop = asyncio.get_running_loop()
        try:
            tls = await loop.start_tls(raw, lane, self._server_ctx, server_side=True,
                                       ssl_handshake_timeout=self.config.auth_timeout_s)
        except (OSError, ssl.SSLError, ConnectionError, TimeoutError, asyncio.CancelledError) as e:
            self.count("lane_tls_failed")
            self.ratelog("lane_tls_failed", error=repr(e))
            raw.abort()
            lane.close("TLS failed")
            return
        if tls is None or lane.closed:
            raw.abort()
            lane.close("closed during TLS")
            return
        lane._tls_up(tls)

    # -- dialling ----------------------------------------------------------------------------------

    def _path_moved(self, peer: Any) -> None:
        """The peer's QUIC connection moved (relayed -> direct): a lane may be possible now."""
        self._peer_up(peer)
        self._changed(peer)

    def _peer_up(self, peer: Any) -> None:
        if self._closing or self._server is None or peer.path == PATH_RELAY:
            return
        if self.identity.node_id < peer.node_id and peer.node_id not in self._dialers:
            self._dialers[peer.node_id] = asyncio.ensure_future(self._dialer(peer))

    def _peer_down(self, peer: Any) -> None:
        task = self._dialers.pop(peer.node_id, None)
        if task is not None:
            task.cancel()
        lane = self._lanes.get(peer.node_id)
        if lane is not None:
            lane.close("the member disconnected")

    async def _control(self, peer: Any, stream: Any) -> None:
        """A RELAY stream: the lane's port, or a relay request (``transport.relay``)."""
        first = await stream.recv()
        if first == CONTROL_LANE_PORT:
            port = self.address[1] if self.address is not None and self._server is not None else 0
            await stream.send(struct.pack(">H", port), end=True)
        elif first and self.mesh.relay is not None:
            await self.mesh.relay.serve(peer, stream, first)
        else:
            stream.reset(ErrorCode.PROTOCOL_ERROR)

    async def _dialer(self, peer: Any) -> None:
        cfg = self.config
        attempt = 0
        try:
            while self.mesh.peer(peer.node_id) is peer and not self._closing:
                try:
                    reply = await peer.request(StreamType.RELAY, CONTROL_LANE_PORT, cfg.connect_timeout_s)
                    (port,) = struct.unpack(">H", reply[:2])
                    if port == 0:
                        log.info("lane_unavailable", peer=peer.node_id, reason="the peer has no lane")
                        return
                    host = peer.address[0] if peer.address is not None else None
                    if host is None:
                        return
                    lane = await self._dial(peer, (host, port))
                    attempt = 0
                    await lane.closed_event.wait()
                except asyncio.CancelledError:
                    raise
                except StreamReset as e:
                    if e.code == ErrorCode.NO_HANDLER:
                        log.info("lane_unavailable", peer=peer.node_id, reason="the peer runs no lanes")
                        return
                    self.count("lane_dial_failures")
                except Exception as e:  # noqa: BLE001 - keep trying while the member is connected
                    self.count("lane_dial_failures")
                    self.ratelog("lane_dial_failed", peer=peer.node_id, error=str(e))
                delay = backoff_delay_s(attempt, cfg.retry_min_s, cfg.retry_max_s, self._rng.random())
                attempt += 1
                await asyncio.sleep(delay)
        finally:
            if self._dialers.get(peer.node_id) is asyncio.current_task():
                del self._dialers[peer.node_id]

    async def _dial(self, peer: Any, addr: Address) -> LaneConnection:
        loop = asyncio.get_running_loop()
        lane = LaneConnection(self, True, peer)
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                await loop.create_connection(lambda: lane, addr[0], addr[1], ssl=self._client_ctx,
                                             ssl_handshake_timeout=self.config.connect_timeout_s)
                await lane.ready
        except BaseException:
            lane.close("dial failed")
            raise
        return lane

