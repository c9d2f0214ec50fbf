"""Connections to members, made on demand and closed least-recently-used.

Nothing keeps a connection to every member: gossip, probes and routed requests ask ``Links.get(node_id)``,
which returns the connected peer or dials it at the addresses in its signed record (concurrent callers
share one dial; gossip, which is lossy anyway, starts at most ``LINK_MAX_GOSSIP_DIALS`` handshakes at once,
so a node that just learnt of many members does not start a handshake storm). Every use by this node ``touch``es the link (what peers send us does not: a peer that
only talks to us does not keep our slot); ``hold`` marks it busy while a routed request streams.
When the connections exceed ``cap`` (default: the transport's cap minus ``LINK_CAP_HEADROOM``), the least
recently used ones that are not busy and idle for ``LINK_MIN_IDLE_S`` are closed, so a mesh larger than
the connection cap still reaches every member.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import structlog

from meshd.config import format_hostport
from meshd.mesh.limits import (
    LINK_CAP_HEADROOM,
    LINK_DIAL_RETRY_S,
    LINK_DIAL_TIMEOUT_S,
    LINK_MAX_GOSSIP_DIALS,
    LINK_MIN_IDLE_S,
)
from transport.errors import TransportError

if TYPE_CHECKING:
    from transport.quic import MeshTransport, Peer

log = structlog.get_logger(__name__)

Address = tuple[str, int]


def parse_addr(text: str) -> Address | None:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


class Links:
    """See module docstring. ``addrs_of(node_id)`` gives the addresses to dial (record, then mDNS)."""

    def __init__(self, transport: MeshTransport, addrs_of: Callable[[str], list[Address]],
                 cap: int | None = None, min_idle_s: float = LINK_MIN_IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.transport = transport
        self.addrs_of = addrs_of
        max_conns = int(getattr(getattr(transport, "config", None), "max_connections", 256))
        self.cap = cap if cap is not None else max(2, max_conns - LINK_CAP_HEADROOM)
        self._clock = clock
        self.min_idle_s = min_idle_s
        self._used: dict[str, float] = {}
        self._busy: dict[str, int] = {}
        self._dials: dict[str, asyncio.Future[Peer | None]] = {}
        self._failed: dict[str, float] = {}
        self.stats = {"dialled": 0, "dial_failures": 0, "closed_idle": 0, "inbound": 0, "dials_deferred": 0}

    def touch(self, node_id: str) -> None:
        self._used[node_id] = self._clock()

    def note_up(self, node_id: str) -> None:
        """A connection came up; one this node was not dialling was made by the peer (``inbound``: proof
        that peers can reach this node's UDP port, for ``meshd doctor``)."""
        if node_id not in self._dials:
            self.stats["inbound"] += 1
        self.touch(node_id)

    def forget_failure(self, node_id: str) -> None:
        self._failed.pop(node_id, None)

    @contextlib.contextmanager
    def hold(self, node_id: str) -> Iterator[None]:
        """Mark the link busy (never closed for room) while the body runs."""
        self._busy[node_id] = self._busy.get(node_id, 0) + 1
        self.touch(node_id)
        try:
            yield
        finally:
            n = self._busy.get(node_id, 1) - 1
            if n > 0:
                self._busy[node_id] = n
            else:
                self._busy.pop(node_id, None)
            self.touch(node_id)

    def connected(self, node_id: str) -> bool:
        return self.transport.peer(node_id) is not None

    async def get(self, node_id: str, retry: bool = True) -> Peer | None:
        """The connected peer, dialled now if needed; None if it cannot be reached (dial failed recently
        with ``retry=False``, or every address failed)."""
        peer = self.transport.peer(node_id)
        if peer is not None:
            self.touch(node_id)
            return peer
        pending = self._dials.get(node_id)
        if pending is None:
            if not retry and (self._clock() - self._failed.get(node_id, -1e18) < LINK_DIAL_RETRY_S
                              or len(self._dials) >= LINK_MAX_GOSSIP_DIALS):
                self.stats["dials_deferred"] += 1
                return None
            pending = asyncio.ensure_future(self._dial(node_id))
            self._dials[node_id] = pending
            pending.add_done_callback(lambda _f: self._dials.pop(node_id, None))
        return await asyncio.shield(pending)

    async def _dial(self, node_id: str) -> Peer | None:
        self.make_room(1)
        for addr in self.addrs_of(node_id):
            try:
                async with asyncio.timeout(LINK_DIAL_TIMEOUT_S):
                    peer = await self.transport.connect(addr, expected_node_id=node_id)
            except (TransportError, TimeoutError, OSError) as e:
                log.debug("link_dial_failed", peer=node_id, addr=format_hostport(*addr), error=str(e))
                continue
            self.stats["dialled"] += 1
            self._failed.pop(node_id, None)
            self.touch(node_id)
            return peer
        self.stats["dial_failures"] += 1
        self._failed[node_id] = self._clock()
        return None

    def make_room(self, extra: int = 0) -> int:
        """Close least recently used idle connections until ``extra`` more fit under the cap; returns
        how many were closed."""
        peers = self.transport.peers()
        excess = len(peers) + extra - self.cap
        if excess <= 0:
            return 0
        now = self._clock()
        idle = [p for p in peers if p.node_id not in self._busy
                and now - self._used.get(p.node_id, -1e18) >= self.min_idle_s]
        idle.sort(key=lambda p: self._used.get(p.node_id, -1e18))
        closed = 0
        for p in idle[:excess]:
            closed += 1
            _spawn(self._close_if_idle(p.node_id))
        return closed

    async def _close_if_idle(self, node_id: str) -> None:
        # checked again here: a request may have started on the link since it was picked
        if node_id in self._busy or self._clock() - self._used.get(node_id, -1e18) < self.min_idle_s:
            return
        self._used.pop(node_id, None)
        self.stats["closed_idle"] += 1
        await self.transport.disconnect(node_id, "idle connection closed to make room")

    def status(self) -> dict[str, Any]:
        return {"cap": self.cap, "connected": len(self.transport.peers()), "busy": len(self._busy), **self.stats}


_TASKS: set[asyncio.Task[Any]] = set()


def _spawn(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)
