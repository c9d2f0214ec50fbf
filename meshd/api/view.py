"""What the API's router needs from a view of the mesh (``meshd.mesh.view.MeshView`` in a daemon), and
the empty view of a node that runs without membership."""

from __future__ import annotations

from typing import Any, Protocol

from meshd.api.router import NodeInfo
from meshd.api.tunnel import TunnelPeer


class MeshView(Protocol):
    def nodes(self) -> list[NodeInfo]: ...  # members that can be routed to (not this node)
    def handle(self, node_id: str) -> TunnelPeer | None: ...  # a peer to open tunnel streams on
    def peer_states(self) -> dict[str, int]: ...  # members per membership state (metrics)


class StaticView:
    """A mesh with no peers (a node without membership, or tests)."""

    def nodes(self) -> list[NodeInfo]:
        return []

    def handle(self, node_id: str) -> TunnelPeer | None:
        return None

    def peer_states(self) -> dict[str, int]:
        return {}

    def snapshot(self) -> dict[str, Any]:
        return {"node_id": None, "counters": {"nodes": 0, "models": 0, "in_flight": 0, "tok_s": 0.0},
                "models": [], "nodes": [], "links": [], "banned": []}
