"""The listening side of the QUIC layer: routes datagrams to connections and admits new ones.

Replaces aioquic's ``QuicServer`` so that admission is ours (see ``transport.admission``): a first
datagram creates a connection only if its Initial decrypts; above ``retry_above_pending`` handshakes in
progress a new client must pass address validation (Retry) first; every unproven handshake counts against
a per-source and a total cap, and a full cap evicts the least promising one (or refuses the new one while
every candidate is younger than ``evict_min_age_s``). Nothing a stranger sends stays behind once it has
been refused.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import structlog
from aioquic.buffer import Buffer  # type: ignore[attr-defined]
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import (
    QuicPacketType,
    encode_quic_retry,
    encode_quic_version_negotiation,
    pull_quic_header,
)

from transport import limits
from transport.admission import (
    HINT_KIND,
    InitialHints,
    Pending,
    RetryTokens,
    choose_eviction,
    hint_key,
    initial_decrypts,
)
from transport.framing import ErrorCode
from transport.handshake import mesh_key

if TYPE_CHECKING:
    from transport.connection import _Connection
    from transport.quic import MeshTransport

log = structlog.get_logger("meshd.transport")

MIN_INITIAL_DATAGRAM_BYTES = 1200  # RFC 9000 14.1: a client's first datagram is padded to this


class MeshServer(asyncio.DatagramProtocol):
    """One UDP socket serving many connections (made by ``create_protocol(quic)``)."""

    def __init__(
        self,
        *,
        mesh: MeshTransport,
        configuration: QuicConfiguration,
        create_protocol: Callable[[QuicConnection], _Connection],
    ) -> None:
        self._mesh = mesh
        self._configuration = configuration
        self._create_protocol = create_protocol
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.DatagramTransport | None = None
        self.protocols: dict[bytes, _Connection] = {}  # every connection id in use -> its connection
        self._retry = RetryTokens(os.urandom(32), mesh.config.retry_token_lifetime_s)
        self._hints = InitialHints(limits.HINT_WINDOW_S, limits.MAX_REMEMBERED_HINTS)
        self._hint_genesis = b""
        self._hint_key = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def close(self) -> None:
        for protocol in set(self.protocols.values()):
            protocol.close()
        self.protocols.clear()
        if self._transport is not None:
            self._transport.close()

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        try:
            self._received(data if isinstance(data, bytes) else data.encode(), addr)
        except Exception as e:  # noqa: BLE001 - a network callback never raises
            self._mesh._count("internal_errors")
            log.warning("transport_server_datagram_failed", error=repr(e))

    # -- admission -------------------------------------------------------------------------------

    def _received(self, data: bytes, addr: Any) -> None:
        mesh = self._mesh
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=self._configuration.connection_id_length)
        except ValueError:
            self._drop("datagrams_garbage", "datagram_garbage", addr, len(data))
            return
        protocol = self.protocols.get(header.destination_cid)
        if protocol is not None:
            protocol.datagram_received(data, addr)
            return
        if header.packet_type != QuicPacketType.INITIAL or len(data) < MIN_INITIAL_DATAGRAM_BYTES:
            self._drop("datagrams_dropped", "datagram_dropped", addr, len(data))
            return
        assert self._transport is not None  # noqa: S101 - datagrams arrive after connection_made
        if header.version not in self._configuration.supported_versions:
            self._transport.sendto(
                encode_quic_version_negotiation(
                    source_cid=header.destination_cid,
                    destination_cid=header.source_cid,
                    supported_versions=self._configuration.supported_versions,
                ),
                addr,
            )
            return
        if not initial_decrypts(data, self._configuration.connection_id_length):
            self._drop("datagrams_garbage_initial", "datagram_garbage_initial", addr, len(data))
            return
        now = self._loop.time()
        who = (str(addr[0]), int(addr[1]))
        original_dcid: bytes | None = header.destination_cid
        retry_scid: bytes | None = None
        hinted = False
        if header.token and header.token[0] == HINT_KIND:
            hinted = self._hint_ok(header.token)
            mesh._count("handshakes_hinted" if hinted else "hints_refused")
        elif header.token:
            original_dcid = self._retry.check(who, header.token, header.destination_cid, now)
            if original_dcid is None:
                self._drop("refused_retry_token", "retry_token_refused", addr, len(data))
                return
            retry_scid = header.destination_cid
        if retry_scid is None and not hinted and mesh._pending_handshakes() >= mesh.config.retry_above_pending:
            scid = os.urandom(8)
            self._transport.sendto(
                encode_quic_retry(
                    version=header.version,
                    source_cid=scid,
                    destination_cid=header.source_cid,
                    original_destination_cid=header.destination_cid,
                    retry_token=self._retry.issue(who, header.destination_cid, scid, now),
                ),
                addr,
            )
            mesh._count("retries_sent")
            return
        if not self._make_room(who[0], now, hinted):
            self._drop("refused_pending_handshakes", "handshake_refused_pending_cap", addr, len(data))
            return
        self._accept(data, addr, header.destination_cid, original_dcid, retry_scid, hinted)

    def _hint_ok(self, token: bytes) -> bool:
        creds = self._mesh.credentials
        if creds is None:
            return False
        if self._hint_genesis != creds.genesis.encoded:
            self._hint_genesis = creds.genesis.encoded
            self._hint_key = hint_key(mesh_key(creds.genesis.encoded))
        return self._hints.check(self._hint_key, token, time.time())

    def _make_room(self, source: str, now: float, hinted: bool) -> bool:
        """Evict unproven handshakes until one more from ``source`` fits under both caps; False if the
        new one must be refused instead (see ``admission.choose_eviction``)."""
        mesh = self._mesh
        cfg = mesh.config
        while True:
            pending = [
                Pending(c, c.remote_address[0] if c.remote_address else "", c.started_at, c.stage, c.hinted)
                for c in mesh._unproven()
            ]
            admit, victim = choose_eviction(
                pending, source, now, cfg.max_pending_handshakes, cfg.max_pending_handshakes_per_source,
                cfg.evict_min_age_s, hinted,
            )
            if victim is None:
                return admit
            conn: _Connection = victim  # type: ignore[assignment]
            mesh._count("handshakes_evicted")
            mesh._ratelog.debug(now, "handshake_evicted", addr=conn.remote_address, stage=conn.stage.name)
            conn.close_with(ErrorCode.TOO_MANY_CONNECTIONS, "too many handshakes in progress")

    def _accept(
        self, data: bytes, addr: Any, dcid: bytes, original_dcid: bytes | None, retry_scid: bytes | None,
        hinted: bool,
    ) -> None:
        connection = QuicConnection(
            configuration=self._configuration,
            original_destination_connection_id=original_dcid,
            retry_source_connection_id=retry_scid,
        )
        protocol = self._create_protocol(connection)
        protocol.hinted = hinted
        protocol.connection_made(self._transport)  # type: ignore[arg-type]
        protocol._connection_id_issued_handler = partial(self._cid_issued, protocol=protocol)
        protocol._connection_id_retired_handler = partial(self._cid_retired, protocol=protocol)
        protocol._connection_terminated_handler = partial(self._terminated, protocol=protocol)
        self.protocols[dcid] = protocol
        self.protocols[connection.host_cid] = protocol
        protocol.datagram_received(data, addr)
        if protocol.closing and not protocol.admitted:
            # refused on its first datagram (a bad ClientHello, the node shutting down): the close is
            # queued; send it now and keep nothing
            protocol.transmit()
            self._terminated(protocol)
            protocol.discard()

    def _drop(self, counter: str, event: str, addr: Any, size: int) -> None:
        self._mesh._count(counter)
        self._mesh._ratelog.debug(time.monotonic(), event, addr=addr, size=size)

    # -- aioquic's connection callbacks ----------------------------------------------------------

    def _cid_issued(self, cid: bytes, protocol: _Connection) -> None:
        self.protocols[cid] = protocol

    def _cid_retired(self, cid: bytes, protocol: _Connection) -> None:
        if self.protocols.get(cid) is protocol:
            del self.protocols[cid]

    def _terminated(self, protocol: _Connection) -> None:
        for cid in [cid for cid, p in self.protocols.items() if p is protocol]:
            del self.protocols[cid]
