"""The data lane: TLS 1.3 over TCP between members already admitted over QUIC, for bulk and
latency-critical streams (``streams.LANE_STREAM_TYPES``: expert RPC, pipeline activations).

aioquic's per-packet Python work caps QUIC at a few hundred MB/s and adds ~0.3 ms per round trip; the
kernel's TCP and OpenSSL do not. A lane carries the same streams (``transport.stream.Stream``, the same
preamble and frames) multiplexed over one TLS connection (``transport.lane_wire``), bound to the node keys
both sides proved over QUIC; see ``lane_wire`` for the proof and why a TLS-terminating middlebox fails,
and ``lane_conn`` for one lane.

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
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from transport import lane_direct, lane_wire, limits
from transport.config import backoff_delay_s
from transport.errors import StreamReset, TransportError
from transport.framing import ErrorCode
from transport.identity import NodeIdentity
from transport.lane_conn import LaneConfig, LaneConnection, _client_context, _server_context
from transport.stream_api import PATH_RELAY, Address
from transport.streams import StreamType
from transport.tls import certificate_der, self_signed_certificate

__all__ = ["CONTROL_LANE_PORT", "LaneConfig", "LaneConnection", "LaneManager"]

log = structlog.get_logger("meshd.transport")

CONTROL_LANE_PORT = b"\x01"  # RELAY control request: "which TCP port is your lane on?" -> u16 (0 = none)


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


class PendingSlots:
    """Connections still authenticating (lanes, direct channels): at most ``total`` in all and ``per_source``
    from one source address, so one stranger's share cannot keep the members out. Loop thread."""

    def __init__(self, total: int, per_source: int) -> None:
        self.total, self.per_source = total, per_source
        self.count = 0
        self._by_source: dict[str, int] = {}

    def full(self, source: str) -> str:
        """Why no slot is free for ``source``: "pending" (all taken), "source" (its share taken), or ""."""
        if self.count >= self.total:
            return "pending"
        return "source" if self._by_source.get(source, 0) >= self.per_source else ""

    def take(self, source: str) -> None:
        self.count += 1
        self._by_source[source] = self._by_source.get(source, 0) + 1

    def give(self, source: str) -> None:
        self.count -= 1
        n = self._by_source.pop(source, 0) - 1
        if n > 0:
            self._by_source[source] = n


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
        self._lane_slots = PendingSlots(self.config.max_pending, self.config.max_pending_per_source)
        self._pending_conns: set[LaneConnection] = set()
        self._lanes: dict[str, LaneConnection] = {}
        self._dialers: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._last_log = 0.0
        self._closing = False
        # direct channels (transport.lane_direct): service -> handler(peer, channel), run in the channel's
        # own thread until it returns (then the channel is closed)
        self.direct_handlers: dict[int, Callable[[Any, lane_direct.DirectChannel], None]] = {}
        self._direct_slots = PendingSlots(limits.LANE_DIRECT_MAX_PENDING, limits.LANE_DIRECT_MAX_PENDING_PER_SOURCE)
        self._directs: set[lane_direct.DirectChannel] = set()
        self._direct_lock = threading.Lock()
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
        with self._direct_lock:
            directs = list(self._directs)
        for ch in directs:
            ch.close("node shutting down")
        if self._server is not None:
            self._server.close()
            self._server = None

    def lane_count(self) -> int:
        return len(self._lanes)

    def status(self) -> dict[str, Any]:
        with self._direct_lock:
            directs = len(self._directs)
        return {"address": None if self.address is None else f"{self.address[0]}:{self.address[1]}",
                "lanes": sorted(self._lanes), "pending": len(self._pending_conns), "direct_channels": directs,
                "stats": dict(self.stats)}

    # -- bookkeeping -------------------------------------------------------------------------------

    def count(self, key: str) -> None:
        self.stats[key] = self.stats.get(key, 0) + 1  # (from a direct channel's thread too: a lost
        #   increment under a race only makes a counter low)

    def ratelog(self, event: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self._last_log >= self.mesh.config.log_interval_s:
            self._last_log = now
            log.debug(event, **fields)

    def unpend(self, lane: LaneConnection) -> None:
        if lane in self._pending_conns:
            self._pending_conns.discard(lane)
            self._lane_slots.give(lane._source or "?")

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
        refused = "pending" if self._closing else self._lane_slots.full(source)
        if refused:
            self.count(f"lane_refused_{refused}_cap")
            raw.abort()
            return
        lane = LaneConnection(self, False, source=source)
        lane._raw = raw
        self._lane_slots.take(source)
        self._pending_conns.add(lane)
        self._sniff_start(raw, lane)

    # -- a lane or a direct channel? -------------------------------------------------------------

    def _sniff_start(self, raw: asyncio.Transport, lane: LaneConnection) -> None:
        """Wait for the connection's first bytes without reading them (a duplicate descriptor, MSG_PEEK):
        a TLS record starts a lane, ``lane_direct``'s magic a direct channel. The pending lane's auth timer
        covers a connection that sends nothing."""
        loop = asyncio.get_running_loop()
        sock = raw.get_extra_info("socket")
        try:
            probe = socket.socket(fileno=os.dup(sock.fileno()))
            probe.setblocking(False)
        except (OSError, AttributeError):
            self._spawn(self._start_tls(raw, lane))
            return
        fd = probe.fileno()

        def stop() -> None:
            with contextlib.suppress(Exception):
                loop.remove_reader(fd)

        def cleanup() -> None:
            stop()
            probe.close()

        def readable() -> None:
            if lane.closed:
                cleanup()
                return
            try:
                head = probe.recv(limits.LANE_DIRECT_MAGIC_BYTES, socket.MSG_PEEK)
            except BlockingIOError:
                return
            except OSError:
                head = b""
            n = len(head)
            if n and n < limits.LANE_DIRECT_MAGIC_BYTES and head == lane_direct.DIRECT_MAGIC[:n]:
                return  # the magic's first bytes: wait for the rest
            lane._sniff_cleanup = None
            if n == limits.LANE_DIRECT_MAGIC_BYTES and head[:-1] == lane_direct.DIRECT_MAGIC:
                stop()
                self._direct_accept(raw, lane, probe, head[-1])
                return
            cleanup()
            self._spawn(self._start_tls(raw, lane))

        lane._sniff_cleanup = cleanup
        loop.add_reader(fd, readable)

    def _direct_accept(self, raw: asyncio.Transport, lane: LaneConnection, sock: socket.socket,
                       service: int) -> None:
        """A direct channel: its TLS and proof in a thread of its own (blocking), then its service's handler
        there. The lane object that counted it as pending is dropped; the socket lives on in ``sock``."""
        deadline = time.monotonic() + self.config.auth_timeout_s
        handler = self.direct_handlers.get(service)
        source = lane._source or "?"
        lane._raw = None  # closing the pending lane must not close the TCP connection we keep
        lane.close("direct channel")
        raw.abort()  # the transport's descriptor only: ``sock`` is a duplicate
        cap = self._direct_slots.full(source)
        refused = "direct_refused" if handler is None or self._closing else f"direct_refused_{cap}_cap" if cap else ""
        if refused:
            self.count(refused)
            sock.close()
            return
        self._direct_slots.take(source)
        loop = asyncio.get_running_loop()
        proved: list[str] = []  # the member's node id, once its key is known

        def member(public_key: bytes) -> Any:
            peer = self.mesh.peer(lane_direct.node_id_from_public_key(public_key))
            if peer is None or peer.public_key != public_key:
                return None
            proved.append(peer.node_id)
            return peer

        def may_open() -> str | None:
            with self._direct_lock:
                full = len(self._directs) >= limits.LANE_DIRECT_MAX_CHANNELS
                mine = sum(1 for ch in self._directs if proved and ch.peer_id == proved[0] and not ch.is_client)
            if full or self._closing:
                return "too many direct channels"
            if mine >= limits.LANE_DIRECT_MAX_CHANNELS_PER_PEER:
                self.count("direct_refused_peer_cap")
                return "too many direct channels from this member"
            return None

        def run() -> None:
            try:
                sock.setblocking(True)
                sock.recv(limits.LANE_DIRECT_MAGIC_BYTES)  # peeked whole already: take it off
                peer, ch = lane_direct.accept(sock, service, self.identity, self.cert_hash, self._server_ctx,
                                              member, deadline, may_open)
            except (TransportError, OSError) as e:
                self.count("direct_refused_proof")
                self.ratelog("direct_refused", error=str(e))
                return
            finally:
                loop.call_soon_threadsafe(self._direct_slots.give, source)
            self._direct_track(ch)
            self.count("direct_accepted")
            log.info("direct_channel_up", peer=ch.peer_id, service=service, outbound=False)
            try:
                handler(peer, ch)
            except Exception as e:  # noqa: BLE001 - a handler's bug ends its channel, not the node
                log.warning("direct_handler_failed", peer=ch.peer_id, error=repr(e))
            finally:
                ch.close("served")

        threading.Thread(target=run, name=f"meshd-direct-{service}", daemon=True).start()

    def _direct_track(self, ch: lane_direct.DirectChannel) -> None:
        with self._direct_lock:
            self._directs.add(ch)
        ch.on_close.append(self._direct_gone)

    def _direct_gone(self, ch: lane_direct.DirectChannel) -> None:
        with self._direct_lock:
            self._directs.discard(ch)
        log.info("direct_channel_down", peer=ch.peer_id, reason=ch.close_reason)

    async def dial_direct(self, peer: Any, service: int) -> lane_direct.DirectChannel:
        """A direct channel to ``peer`` for ``service`` (``transport.lane_direct``), at the lane port it
        reports over QUIC. Raises ``TransportError`` (no lane there, refused, not in time)."""
        cfg = self.config
        if self._closing or peer.address is None or peer.path == PATH_RELAY:
            raise TransportError("no direct path to the peer")
        reply = await peer.request(StreamType.RELAY, CONTROL_LANE_PORT, cfg.connect_timeout_s)
        (port,) = struct.unpack(">H", reply[:2])
        if port == 0:
            raise TransportError("the peer has no lane")
        ch = await asyncio.to_thread(lane_direct.dial, self.identity, peer.public_key,
                                     (peer.address[0], port), service, self._client_ctx, cfg.connect_timeout_s)
        if self._closing or self.mesh.peer(peer.node_id) is not peer:
            ch.close("the member is gone")
            raise TransportError("the member disconnected")
        self._direct_track(ch)
        self.count("direct_dialled")
        log.info("direct_channel_up", peer=peer.node_id, service=service, outbound=True)
        return ch

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
        with self._direct_lock:
            gone = [ch for ch in self._directs if ch.peer_id == peer.node_id]
        for ch in gone:
            ch.close("the member disconnected")

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
