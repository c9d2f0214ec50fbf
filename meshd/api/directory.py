"""Which peers serve what, right now: the router's view of the mesh.

``TunnelDirectory`` asks every connected peer ``GET /meshd/v1/node`` over the HTTP tunnel every
``TUNNEL_POLL_INTERVAL_S`` and keeps only peers that are connected and answered the last poll, so a
model disappears from ``/v1/models`` as soon as its last server is gone (no phantoms). When membership
exposes signed records with served models and load, ``MembershipDirectory``-style adapters can replace it
behind the same ``MeshView`` protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from meshd.api.errors import ApiError
from meshd.api.router import NodeInfo
from meshd.api.tunnel import TunnelClient, TunnelPeer
from transport import limits

log = structlog.get_logger(__name__)

NODE_INFO_PATH = "/meshd/v1/node"


class MeshView(Protocol):
    def nodes(self) -> list[NodeInfo]: ...  # reachable peers (not this node)
    def handle(self, node_id: str) -> TunnelPeer | None: ...
    def peer_states(self) -> dict[str, int]: ...


def parse_node_info(data: bytes, rtt_ms: float) -> NodeInfo:
    """Strictly parse a peer's ``/meshd/v1/node`` answer; raises ValueError."""
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError("not an object")
    node_id, role, models = obj.get("node_id"), obj.get("role"), obj.get("models")
    in_flight, capacity = obj.get("in_flight", 0), obj.get("capacity", 1)
    if not isinstance(node_id, str) or role not in ("serve", "client") or not isinstance(models, list) \
            or not all(isinstance(m, str) for m in models) or len(models) > 4096 \
            or not isinstance(in_flight, int) or not isinstance(capacity, int):
        raise ValueError("bad node info")
    return NodeInfo(node_id, role, tuple(models), max(0, in_flight), max(1, capacity), rtt_ms)


class TunnelDirectory:
    """``MeshView`` built by polling peers over the tunnel (see module docstring)."""

    def __init__(self, peers: Callable[[], list[Any]], tunnel: TunnelClient,
                 interval_s: float = limits.TUNNEL_POLL_INTERVAL_S,
                 timeout_s: float = limits.TUNNEL_POLL_TIMEOUT_S) -> None:
        self._peers = peers
        self.tunnel = tunnel
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._info: dict[str, NodeInfo] = {}
        self._failed: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.states_source: Callable[[], dict[str, int]] | None = None  # e.g. membership's view

    def _connected(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for p in self._peers():
            nid = getattr(p, "node_id", None)
            if isinstance(nid, str):
                out[nid] = p
        return out

    def nodes(self) -> list[NodeInfo]:
        live = self._connected()
        return [i for nid, i in sorted(self._info.items()) if nid in live]

    def handle(self, node_id: str) -> TunnelPeer | None:
        return self._connected().get(node_id)

    def peer_states(self) -> dict[str, int]:
        if self.states_source is not None:
            try:
                return self.states_source()
            except Exception:  # noqa: BLE001 - metrics must not fail
                pass
        live = self._connected()
        alive = sum(1 for nid in live if nid in self._info)
        return {"alive": alive, "suspect": len(live) - alive}

    def forget(self, node_id: str) -> None:
        """Drop a peer at once (its connection went down)."""
        self._info.pop(node_id, None)

    def poke(self) -> None:
        """Refresh soon (a peer came up)."""
        self._wake.set()

    def update_load(self, node_id: str, delta: int) -> None:
        """Count our own requests on a peer until its next poll says otherwise."""
        info = self._info.get(node_id)
        if info is not None:
            self._info[node_id] = NodeInfo(info.node_id, info.role, info.models,
                                           max(0, info.in_flight + delta), info.capacity, info.rtt_ms)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:  # noqa: BLE001 - keep polling whatever happens
                log.debug("directory_refresh_failed", error=type(e).__name__)
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)

    async def refresh(self) -> None:
        live = self._connected()
        for nid in list(self._info):
            if nid not in live:
                del self._info[nid]
        await asyncio.gather(*(self._poll(nid, p) for nid, p in live.items()))

    async def _poll(self, node_id: str, peer: Any) -> None:
        try:
            reply = await asyncio.wait_for(self.tunnel.request(peer, "GET", NODE_INFO_PATH), self.timeout_s)
            try:
                data = b"".join([c async for c in reply.body])
            finally:
                await reply.aclose()
            rtt = getattr(peer, "rtt_ms", None)
            info = parse_node_info(data, float(rtt) if isinstance(rtt, (int, float)) else 0.0)
            if info.node_id != node_id:
                raise ValueError("node id does not match the connection")
        except (ApiError, ValueError, asyncio.TimeoutError) as e:
            if node_id not in self._failed:
                log.info("directory_peer_unavailable", peer=node_id, reason=str(e) or type(e).__name__)
            self._failed.add(node_id)
            self._info.pop(node_id, None)
            return
        if node_id in self._failed or node_id not in self._info or self._info[node_id].models != info.models:
            log.info("directory_peer_models", peer=node_id, role=info.role, models=list(info.models))
        self._failed.discard(node_id)
        self._info[node_id] = info


class StaticView:
    """A mesh with no peers (a node without a transport, or tests)."""

    def nodes(self) -> list[NodeInfo]:
        return []

    def handle(self, node_id: str) -> TunnelPeer | None:
        return None

    def peer_states(self) -> dict[str, int]:
        return {}
