"""``MeshView``: the one view of the mesh, built from the signed membership records.

Every member's record says what it serves (models with fingerprint and context, expert shards, pipeline
stages or any other field), its load (in flight, queue, recent tokens/s, slots), its API address and its
capacity (cores, memory). The router, ``/v1/models``, ``meshd status`` and the console all read this
class; nothing polls peers. Per member it adds what this node measured: state (alive, suspect, dead,
left), round trip, last seen, whether a connection is up and its path kind.

For routing (``nodes``) a member counts while it is alive or suspect (a suspect one is tried last and is
not listed in ``/v1/models``), and so does one declared dead that sent this node a frame in the last
``HEARD_RECENTLY_S`` (it is alive, just slow to refute, e.g. on a starved machine); ``handle(node_id)`` gives a peer whose streams dial the member on demand
(``meshd.mesh.links``), so a member this node is not connected to is still routed to.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from meshd.api.router import NodeInfo
from transport.errors import TransportError

if TYPE_CHECKING:
    from meshd.membership.core import MemberView
    from meshd.membership.service import MembershipService

ROUTABLE = ("alive", "suspect")
HEARD_RECENTLY_S = 2.0  # a member declared dead that sent us a frame this recently is evidently alive


class OnDemandPeer:
    """A member as the tunnel client sees it: ``open_stream`` connects first when needed."""

    def __init__(self, view: MeshView, node_id: str) -> None:
        self._view = view
        self.node_id = node_id

    @property
    def rtt_ms(self) -> float | None:
        peer = self._view.transport_peer(self.node_id)
        return peer.rtt_ms if peer is not None else None

    async def open_stream(self, stream_type: Any) -> Any:
        links = self._view.membership.links
        if links is None:
            raise ConnectionError("this node has no transport")
        for attempt in range(2):  # a connection closing just now (idle, or replaced) is dialled again once
            peer = await links.get(self.node_id)
            if peer is None:
                raise ConnectionError(f"node {self.node_id[:12]} cannot be reached at its addresses")
            links.touch(self.node_id)
            try:
                return await peer.open_stream(stream_type)
            except TransportError:
                if attempt:
                    raise
        raise AssertionError("unreachable")


class MeshView:
    """See module docstring. Built by ``MembershipService`` (``membership.view``)."""

    def __init__(self, membership: MembershipService) -> None:
        self.membership = membership
        self._bumps: dict[str, tuple[int, int]] = {}  # node -> (record version, our requests on it)

    # ----- members ---------------------------------------------------------------------------------
    def members(self) -> list[MemberView]:
        core = self.membership.core
        return core.members() if core is not None else []

    def transport_peer(self, node_id: str) -> Any:
        daemon = self.membership.daemon
        t = daemon.transport if daemon is not None else None
        return t.peer(node_id) if t is not None else None

    def _rtt(self, v: MemberView) -> float | None:
        peer = self.transport_peer(v.node_id)
        rtt = peer.rtt_ms if peer is not None and peer.rtt_ms is not None else v.rtt_ms
        return None if rtt is None else round(float(rtt), 2)

    # ----- the router's side -------------------------------------------------------------------
    def nodes(self) -> list[NodeInfo]:
        """Members that can be routed to now (alive or suspect, not leaving), not this node."""
        out = []
        now = self.membership._now()
        for v in self.members():
            rec = v.record
            state = v.state
            if state == "dead" and v.last_seen is not None and now - v.last_seen < HEARD_RECENTLY_S:
                state = "suspect"  # declared dead (an overloaded machine missed its probes) yet talking to us
            if state not in ROUTABLE or rec.leaving:
                continue
            bump = self._bumps.get(v.node_id)
            ours = bump[1] if bump is not None and bump[0] == rec.version else 0
            out.append(NodeInfo(v.node_id, rec.role, tuple(m.name for m in rec.models),
                                rec.capacity.in_flight + ours, max(1, rec.load.slots), self._rtt(v) or 0.0,
                                state=state))
        return sorted(out, key=lambda n: n.node_id)

    def handle(self, node_id: str) -> OnDemandPeer | None:
        core = self.membership.core
        v = core.member(node_id) if core is not None else None
        if v is None or v.state not in ROUTABLE:
            return None
        return OnDemandPeer(self, node_id)

    def hold(self, node_id: str) -> Any:
        """Context manager: the link to ``node_id`` is busy (not closed for room) meanwhile."""
        links = self.membership.links
        if links is None:
            import contextlib

            return contextlib.nullcontext()
        return links.hold(node_id)

    def update_load(self, node_id: str, delta: int) -> None:
        """Count our own requests on a member until its next record says otherwise."""
        core = self.membership.core
        v = core.member(node_id) if core is not None else None
        if v is None:
            return
        version, n = self._bumps.get(node_id, (v.record.version, 0))
        if version != v.record.version:
            n = 0
        self._bumps[node_id] = (v.record.version, max(0, n + delta))

    def peer_states(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for v in self.members():
            counts[v.state] = counts.get(v.state, 0) + 1
        return counts

    # ----- status and console ------------------------------------------------------------------
    def member_json(self, v: MemberView, now: float) -> dict[str, Any]:
        rec = v.record
        live = v.state in ROUTABLE
        peer = self.transport_peer(v.node_id)
        return {
            **rec.extra,
            "node_id": v.node_id, "addrs": list(rec.addrs), "state": v.state, "rtt_ms": self._rtt(v),
            "models": [m.to_json() for m in rec.models] if live else [],
            "experts": [e.to_json() for e in rec.experts] if live else [],
            "stages": [st.to_json() for st in rec.stages] if live else [],  # --stage offers (the console's drawer)
            "version": rec.software, "protocol": rec.proto,
            "last_seen_s": None if v.last_seen is None else round(now - v.last_seen, 2),
            "role": rec.role, "api": rec.api, "incarnation": v.incarnation, "admin": rec.admin,
            "load": {"in_flight": rec.capacity.in_flight, **rec.load.to_json()} if live else None,
            "capacity": {"cpus": rec.capacity.cpus, "ram_mb": rec.capacity.ram_mb,
                         "free_mb": rec.capacity.free_mb},
            "connected": peer is not None, "path": _path_kind(peer) if peer is not None else None,
            "leaving": rec.leaving,
        }

    def peers_json(self) -> list[dict[str, Any]]:
        now = self.membership._now()
        return [self.member_json(v, now) for v in sorted(self.members(), key=lambda v: v.node_id)]

    def self_json(self) -> dict[str, Any] | None:
        core = self.membership.core
        if core is None:
            return None
        rec = core.local_record
        return {
            **rec.extra,
            "node_id": rec.node_id, "addrs": list(rec.addrs), "state": "alive", "rtt_ms": 0.0,
            "models": [m.to_json() for m in rec.models], "experts": [e.to_json() for e in rec.experts],
            "stages": [st.to_json() for st in rec.stages],
            "version": rec.software, "protocol": rec.proto, "last_seen_s": 0.0, "role": rec.role,
            "api": rec.api, "incarnation": rec.version, "admin": rec.admin,
            "load": {"in_flight": rec.capacity.in_flight, **rec.load.to_json()},
            "capacity": {"cpus": rec.capacity.cpus, "ram_mb": rec.capacity.ram_mb, "free_mb": rec.capacity.free_mb},
            "connected": True, "path": None, "leaving": rec.leaving, "self": True,
        }

    def snapshot(self) -> dict[str, Any]:
        """The console's JSON (``GET /meshd/v1/mesh``): this node, every member, this node's links, and
        headline counters."""
        me = self.self_json()
        peers = self.peers_json()
        nodes = ([me] if me is not None else []) + peers
        links = [{"from": me["node_id"], "to": p["node_id"], "rtt_ms": p["rtt_ms"], "path": p["path"]}
                 for p in peers if me is not None and p["connected"]]
        live = [n for n in nodes if n["state"] in ROUTABLE]
        models = sorted({m["name"] for n in live if n["role"] != "client" for m in n["models"]})
        daemon = self.membership.daemon
        creds = daemon.credentials if daemon is not None else None
        core = self.membership.core
        rev = core.revocations if core is not None else None
        return {
            "node_id": me["node_id"] if me else None,
            "mesh_id": creds.mesh_id if creds else None, "mesh_name": creds.genesis.name if creds else None,
            "time": time.time(),
            "counters": {"nodes": len(live), "models": len(models),
                         "in_flight": sum((n["load"] or {}).get("in_flight", 0) for n in live),
                         "tok_s": round(sum((n["load"] or {}).get("tok_s", 0.0) for n in live), 1)},
            "models": models, "nodes": nodes, "links": links,
            "banned": sorted(rev.banned) if rev else [],
        }


def _path_kind(peer: Any) -> str:
    """How this node reaches a connected peer: ``quic``, or what the transport says (lane, relay)."""
    kind = getattr(peer, "path", None)
    return kind if isinstance(kind, str) else "quic"
