"""Relay through a member: two members with no direct path talk through one both reach.

The relayed path is a whole meshd QUIC connection (``transport.connection._Connection``: TLS 1.3, the
meshd handshake with member certificates, pinned ids, bans, every stream type) whose UDP datagrams ride,
one per DATA frame, in a pair of RELAY streams through the relaying member B::

    A --RELAY stream (A-B QUIC)--> B --RELAY stream (B-C QUIC)--> C

B forwards frames (each the datagrams one send of the connection emitted) it cannot read (QUIC packets encrypted with keys only A and C hold) or forge (QUIC's
AEAD and the handshake's signatures fail on any change). Like the network it replaces, B's forwarding is
lossy: a datagram that finds the next stream's send buffer full is dropped and QUIC recovers it, so B
holds at most one stream buffer per direction. ``Peer.path`` is "relay" for such a peer.

``RelayManager``: serves relay requests (``allow_relay``; refusals and forwarded bytes counted in
``stats``), learns that a direct dial failed (``MeshTransport.on_dial_failed``) and then tries the
members it is connected to directly as relays, the lowest round trip first; while a peer is relayed it
retries the direct address every ``direct_retry_s`` and a direct connection replaces the relayed one.

RELAY stream requests (the first DATA frame; ``transport.lane`` also answers ``CONTROL_LANE_PORT``)::

    OPEN     0x02 | target node id (ASCII)   A -> B: relay me to target; B answers 0x00 (ok) or 0x01 | reason
    INCOMING 0x03 | source node id (ASCII)   B -> C: a relayed connection from source follows
"""

from __future__ import annotations

import asyncio
import random
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from aioquic.buffer import Buffer  # type: ignore[attr-defined]
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import pull_quic_header

from transport import limits
from transport.connection import _Connection
from transport.errors import TransportError
from transport.framing import ErrorCode
from transport.handshake import Mode
from transport.identity import is_node_id
from transport.stream_api import PATH_LANE, PATH_RELAY, Address
from transport.streams import StreamType

log = structlog.get_logger("meshd.transport")

OP_OPEN = b"\x02"
OP_INCOMING = b"\x03"
REPLY_OK = b"\x00"
REPLY_REFUSED = b"\x01"
RELAY_ADDR: Address = ("relay", 0)  # the "address" aioquic sees for a relayed peer (not an IP: no lane)


@dataclass(frozen=True, slots=True)
class RelayConfig:
    allow_relay: bool = True  # relay for other members (--relay)
    relay_after_s: float = 0.0  # after a failed direct dial, wait this long before trying relays
    direct_retry_s: float = 5.0  # while relayed, try the direct address this often
    open_timeout_s: float = 5.0  # a relay's answer plus the relayed handshake
    give_up_s: float = 60.0  # no relay found for this long: stop trying until the next failed dial
    legs_on_lanes: bool = True  # a relay leg rides the data lane to the relay / to the target when one is up


class _StreamDatagrams(asyncio.DatagramTransport):
    """A datagram transport over a RELAY stream. The datagrams one ``transmit`` of the QUIC connection
    emits go out as one DATA frame (``u16 length | datagram`` each), sent at the end of that loop turn:
    one packet on the relay's legs instead of one per datagram. Lossy when the stream's buffer is full."""

    def __init__(self, stream: Any, on_drop: Callable[[], None]) -> None:
        super().__init__()
        self._stream = stream
        self._on_drop = on_drop
        self._closing = False
        self._batch: list[bytes] = []
        self._batch_bytes = 0

    def sendto(self, data: bytes, addr: Any = None) -> None:  # type: ignore[override]
        if self._closing:
            return
        if self._batch_bytes + 2 + len(data) > limits.MAX_RELAY_FRAME_BYTES:
            self._flush()
        if not self._batch:
            asyncio.get_running_loop().call_soon(self._flush)
        self._batch.append(struct.pack(">H", len(data)))
        self._batch.append(bytes(data))
        self._batch_bytes += 2 + len(data)

    def attach(self, conn: _Connection) -> None:
        """Send the batch at the end of each of ``conn``'s transmits, not a loop turn later."""
        transmit = conn.transmit

        def transmit_and_flush() -> None:
            transmit()
            self._flush()

        conn.transmit = transmit_and_flush  # type: ignore[method-assign]

    def _flush(self) -> None:
        if not self._batch or self._closing:
            return
        frame = b"".join(self._batch)
        self._batch.clear()
        self._batch_bytes = 0
        try:
            if not self._stream.send_now(frame):
                self._on_drop()
        except TransportError:
            self._closing = True

    def close(self) -> None:
        if not self._closing:
            self._flush()
            self._closing = True
            self._stream.reset(ErrorCode.NO_ERROR)

    def abort(self) -> None:
        self.close()

    def is_closing(self) -> bool:
        return self._closing

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def split_datagrams(frame: bytes) -> list[bytes]:
    """The datagrams of one relayed frame; raises TransportError if it is malformed."""
    out: list[bytes] = []
    at = 0
    while at < len(frame):
        if at + 2 > len(frame):
            raise TransportError("truncated relayed frame")
        (n,) = struct.unpack_from(">H", frame, at)
        if n == 0 or at + 2 + n > len(frame):
            raise TransportError("truncated relayed frame")
        out.append(frame[at + 2: at + 2 + n])
        at += 2 + n
    return out


class RelayManager:
    """Relaying for others, and relayed connections to members this node cannot reach directly."""

    def __init__(self, mesh: Any, config: RelayConfig | None = None, rng: random.Random | None = None) -> None:
        self.mesh = mesh
        self.config = config or RelayConfig()
        self.stats: dict[str, int] = {}
        self.tap: Callable[[bytes], None] | None = None  # sees every frame this node forwards (tests)
        self._rng = rng or random.Random()
        self._direct: dict[str, Address] = {}  # node id -> the direct address that failed
        self._trying: dict[str, asyncio.Task[Any]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        mesh.relay = self
        mesh.on_dial_failed.append(self._dial_failed)
        mesh.on_peer_down.append(self._peer_down)

    def count(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    def status(self) -> dict[str, Any]:
        return {"allow": self.config.allow_relay, "relayed_peers": sorted(
            p.node_id for p in self.mesh.peers() if p.path == PATH_RELAY), "stats": dict(self.stats)}

    async def close(self) -> None:
        self._closing = True
        for task in [*self._trying.values(), *self._tasks]:
            task.cancel()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- serving RELAY streams (called by transport.lane's RELAY handler) ------------------------

    async def serve(self, peer: Any, stream: Any, first: bytes) -> None:
        if first[:1] == OP_OPEN:
            await self._relay(peer, stream, first[1:].decode("ascii", "replace"))
        elif first[:1] == OP_INCOMING:
            await self._incoming(peer, stream, first[1:].decode("ascii", "replace"))
        else:
            stream.reset(ErrorCode.PROTOCOL_ERROR)

    async def _relay(self, source: Any, up: Any, target: str) -> None:
        """Be B: connect ``source``'s stream to ``target`` and forward frames both ways until either ends."""
        reason = ""
        down_peer = self.mesh.peer(target) if is_node_id(target) else None
        if not self.config.allow_relay:
            reason = "this node does not relay"
        elif down_peer is None or down_peer.path == PATH_RELAY or target == source.node_id:
            reason = "target not reachable from the relay"
        if reason:
            self.count("relay_refused")
            await up.send(REPLY_REFUSED + reason.encode(), end=True)
            return
        assert down_peer is not None  # noqa: S101 - checked above
        try:
            down = await down_peer.open_stream(StreamType.RELAY, lane=self.config.legs_on_lanes)
            await down.send(OP_INCOMING + source.node_id.encode())
        except TransportError as e:
            self.count("relay_refused")
            await up.send(REPLY_REFUSED + f"target unreachable: {e}".encode(), end=True)
            return
        await up.send(REPLY_OK)
        self.count("relays_opened")
        if up.path == PATH_LANE and down.path == PATH_LANE:
            self.count("relays_opened_on_lanes")
        log.info("relay_opened", source=source.node_id, target=target, legs=(up.path, down.path))
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def forward(to: Any) -> Callable[[bytes], None]:
            def on_data(data: bytes) -> None:
                tap = self.tap
                if tap is not None:
                    tap(data)
                self.count("relay_frames")
                self.count("relay_bytes", len(data))
                try:
                    if not to.send_now(data):
                        self.count("relay_dropped")
                except TransportError:
                    if not done.done():
                        done.set_result(None)

            return on_data

        def ended(_: Exception | None) -> None:
            if not done.done():
                done.set_result(None)

        up.set_receiver(forward(down), ended)
        down.set_receiver(forward(up), ended)
        try:
            await done
        finally:
            up.reset(ErrorCode.NO_ERROR)
            down.reset(ErrorCode.NO_ERROR)
            log.info("relay_closed", source=source.node_id, target=target)

    async def _incoming(self, relay: Any, stream: Any, source: str) -> None:
        """Be C: the QUIC server end of a relayed connection from ``source`` through ``relay``."""
        if not is_node_id(source):
            stream.reset(ErrorCode.PROTOCOL_ERROR)
            return
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        transport = _StreamDatagrams(stream, lambda: self.count("relay_dropped"))
        conn: _Connection | None = None

        def on_data(frame: bytes) -> None:
            nonlocal conn
            for data in split_datagrams(frame):
                if conn is None:
                    try:
                        header = pull_quic_header(Buffer(data=data),
                                                  host_cid_length=self.mesh._quic_config(False).connection_id_length)
                    except ValueError:
                        raise TransportError("not a QUIC packet") from None
                    quic = QuicConnection(configuration=self.mesh._quic_config(False),
                                          original_destination_connection_id=header.destination_cid)
                    conn = _Connection(quic, mesh=self.mesh, is_client=False)
                    conn.path = PATH_RELAY
                    size = self.mesh.config.loopback_datagram_size
                    if size:  # its packets travel in a stream, never as UDP: no path MTU to respect
                        conn._set_datagram_size(size)
                    conn.connection_made(transport)
                    transport.attach(conn)
                    self._spawn(_close_when_finished(conn, transport))
                conn.datagram_received(data, RELAY_ADDR)

        def on_end(_: Exception | None) -> None:
            if conn is not None:
                conn.close_with(ErrorCode.DISCONNECT, "relay path lost")
            if not done.done():
                done.set_result(None)

        stream.set_receiver(on_data, on_end)
        await done

    # -- relayed connections from here -------------------------------------------------------------

    def _dial_failed(self, node_id: str, addr: Address) -> None:
        if self._closing or not is_node_id(node_id):
            return
        self._direct[node_id] = addr
        if node_id not in self._trying and self.mesh.peer(node_id) is None:
            self._trying[node_id] = self._spawn(self._keep_relayed(node_id))

    def _peer_down(self, peer: Any) -> None:
        if peer.node_id in self._direct and peer.node_id not in self._trying and not self._closing:
            self._trying[peer.node_id] = self._spawn(self._keep_relayed(peer.node_id))

    async def _keep_relayed(self, node_id: str) -> None:
        """Reach ``node_id`` through a relay while no direct connection is up; retry direct meanwhile."""
        loop = asyncio.get_running_loop()
        try:
            await asyncio.sleep(self.config.relay_after_s)
            alone_since = loop.time()
            while not self._closing:
                peer = self.mesh.peer(node_id)
                if peer is None:
                    peer = await self._via_any(node_id)
                if peer is None:
                    if loop.time() - alone_since > self.config.give_up_s:
                        self.count("relay_gave_up")
                        self._direct.pop(node_id, None)  # a later failed dial starts over
                        return
                    await asyncio.sleep(self.config.direct_retry_s * (0.5 + self._rng.random()))
                    continue
                alone_since = loop.time()
                if peer.path != PATH_RELAY:
                    return  # direct now
                await asyncio.sleep(self.config.direct_retry_s * (0.5 + 0.5 * self._rng.random()))
                addr = self._direct.get(node_id)
                if addr is not None and self.mesh.peer(node_id) is not None:
                    try:
                        await self.mesh.connect(addr, expected_node_id=node_id, replace_relayed=True)
                        self.count("direct_recovered")
                        log.info("relay_direct_path_found", peer=node_id)
                    except (TransportError, OSError, TimeoutError) as e:
                        self.count("direct_retry_failed")
                        log.debug("relay_direct_retry_failed", peer=node_id, error=str(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - never let the keeper die silently
            log.warning("relay_keeper_failed", peer=node_id, error=repr(e))
        finally:
            if self._trying.get(node_id) is asyncio.current_task():
                del self._trying[node_id]

    async def _via_any(self, node_id: str) -> Any:
        relays = [p for p in self.mesh.peers() if p.node_id != node_id and p.path != PATH_RELAY]
        relays.sort(key=lambda p: p.rtt_ms if p.rtt_ms is not None else 1e9)
        for relay in relays:
            try:
                return await self.connect_via(relay, node_id)
            except (TransportError, TimeoutError) as e:
                log.debug("relay_attempt_failed", relay=relay.node_id, peer=node_id, error=str(e))
        return None

    async def connect_via(self, relay: Any, node_id: str) -> Any:
        """A relayed, authenticated connection to ``node_id`` through ``relay``: its first leg on the data
        lane to ``relay`` when one is up (``legs_on_lanes``), and over QUIC if that attempt fails. Raises
        TransportError."""
        if self.config.legs_on_lanes and relay.path == PATH_LANE:
            try:
                return await self._connect_via(relay, node_id, True)
            except (TransportError, TimeoutError) as e:
                self.count("relay_lane_leg_failed")
                log.debug("relay_lane_leg_failed", relay=relay.node_id, peer=node_id, error=str(e))
        return await self._connect_via(relay, node_id, False)

    async def _connect_via(self, relay: Any, node_id: str, lane: bool) -> Any:
        mesh = self.mesh
        if mesh.credentials is None:
            raise TransportError("this node has no mesh credentials yet")
        stream = await relay.open_stream(StreamType.RELAY, lane=lane)
        try:
            async with asyncio.timeout(self.config.open_timeout_s):
                await stream.send(OP_OPEN + node_id.encode())
                reply = await stream.recv()
                if reply is None or reply[:1] != REPLY_OK:
                    why = reply[1:].decode("utf-8", "replace") if reply else "closed"
                    self.count("relay_open_refused")
                    raise TransportError(f"relay {relay.node_id} refused: {why}")
                transport = _StreamDatagrams(stream, lambda: self.count("relay_dropped"))
                # loopback-sized packets: they travel in a stream, never as UDP (no path MTU to respect)
                quic = QuicConnection(configuration=mesh._quic_config(True, loopback=True))
                conn = _Connection(quic, mesh=mesh, is_client=True, mode=Mode.MEMBER, expected_node_id=node_id)
                conn.path = PATH_RELAY
                conn.connection_made(transport)
                transport.attach(conn)
                conn.remote_address = RELAY_ADDR

                def on_end(_: Exception | None) -> None:
                    conn.close_with(ErrorCode.DISCONNECT, "relay path lost")

                def on_data(frame: bytes) -> None:
                    for data in split_datagrams(frame):
                        conn.datagram_received(data, RELAY_ADDR)

                stream.set_receiver(on_data, on_end)
                conn.connect(RELAY_ADDR)
                self._spawn(_close_when_finished(conn, transport))
                peer = await conn.result
        except BaseException:
            stream.reset(ErrorCode.CANCELLED)
            raise
        self.count("relayed_connections")
        if stream.path == PATH_LANE:
            self.count("relayed_connections_on_lane")
        log.info("relay_connected", peer=node_id, relay=relay.node_id, first_leg=stream.path)
        return peer


async def _close_when_finished(conn: _Connection, transport: _StreamDatagrams) -> None:
    await conn.finished.wait()
    await asyncio.sleep(0.05)  # let the close frame leave
    transport.close()

