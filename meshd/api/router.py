"""Where a request goes: the local node or a peer, chosen by load and measured speed.

Pure functions (``plan``, ``choose_auto``, ``routable_models``) over ``NodeInfo`` snapshots, tested from
tables; ``PeerStats`` keeps the measurements (EWMA of time to first byte and of streamed tokens/s).

How a target list is built for a model (``plan``):
1. The local node, if it serves the model and is not overloaded (in flight < capacity): local first.
2. Peers that serve it (never headless clients), not saturated, cheapest first, where
   ``cost_ms = rtt_ms + (ttfb_ms + 64 tokens / tok_per_s) * (1 + in_flight) / capacity``: a peer's
   measured time to first byte (50 ms until measured) and streamed tokens/s through it (EWMAs), scaled
   by how many requests share its slots; ties by node id.
3. Saturated peers, then peers that failed a request in the last 30 s (before its first byte or in the
   middle of a stream) or that membership suspects, then the overloaded local node: tried last rather
   than refusing at once.
``model: "auto"`` (``choose_auto``): a model this node serves and has room for (first by name);
otherwise the model served by the most nodes (more nodes, more room), ties by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_TTFB_MS = 50.0
TYPICAL_TOKENS = 64  # answer length used to turn a measured stream rate into milliseconds
FAILURE_PENALTY_S = 30.0
EWMA_ALPHA = 0.3


@dataclass(frozen=True)
class NodeInfo:
    """What the router knows about one node (from membership records or the tunnel directory)."""

    node_id: str
    role: str  # "serve" or "client"
    models: tuple[str, ...]
    in_flight: int = 0
    capacity: int = 1
    rtt_ms: float = 0.0
    state: str = "alive"  # membership state: a "suspect" node is tried last and not listed


@dataclass(frozen=True)
class Target:
    node_id: str
    local: bool


@dataclass
class PeerStats:
    ttfb_ms: float | None = None
    tok_per_s: float | None = None
    failures: int = 0
    failed_at: float | None = None  # monotonic time of the last failure (before or after the first byte)

    def penalized(self, now: float) -> bool:
        """A peer that just failed goes after the others for ``FAILURE_PENALTY_S``."""
        return self.failed_at is not None and now - self.failed_at < FAILURE_PENALTY_S

    def mark_failed(self, now: float) -> None:
        """The node failed a request (before its first byte or mid-response): try it last for a while."""
        self.failures += 1
        self.failed_at = now

    def observe_ttfb(self, ms: float) -> None:
        self.ttfb_ms = ms if self.ttfb_ms is None else (1 - EWMA_ALPHA) * self.ttfb_ms + EWMA_ALPHA * ms

    def observe_rate(self, tok_per_s: float) -> None:
        self.tok_per_s = tok_per_s if self.tok_per_s is None else \
            (1 - EWMA_ALPHA) * self.tok_per_s + EWMA_ALPHA * tok_per_s


def cost_ms(node: NodeInfo, stats: PeerStats | None) -> float:
    """Expected milliseconds until a typical answer from ``node`` (see module docstring)."""
    ttfb = stats.ttfb_ms if stats is not None and stats.ttfb_ms is not None else DEFAULT_TTFB_MS
    decode = 1000.0 * TYPICAL_TOKENS / stats.tok_per_s if stats is not None and stats.tok_per_s else 0.0
    return node.rtt_ms + (ttfb + decode) * (1 + node.in_flight) / max(1, node.capacity)


def _saturated(node: NodeInfo) -> bool:
    return node.in_flight >= max(1, node.capacity)


def plan(model: str, local: NodeInfo | None, peers: list[NodeInfo],
         stats: dict[str, PeerStats] | None = None, now: float = 0.0) -> list[Target]:
    """Ordered targets for ``model`` (see module docstring). Empty: nobody serves it."""
    stats = stats or {}

    suspect = {p.node_id for p in peers if p.state != "alive"}

    def failed(node_id: str) -> bool:
        st = stats.get(node_id)
        return node_id in suspect or (st is not None and st.penalized(now))

    out: list[Target] = []
    local_ok = local is not None and model in local.models
    if local_ok and local is not None and not _saturated(local):
        out.append(Target(local.node_id, True))
    servers = [p for p in peers if p.role != "client" and model in p.models
               and (local is None or p.node_id != local.node_id)]
    servers.sort(key=lambda p: (failed(p.node_id), _saturated(p), cost_ms(p, stats.get(p.node_id)), p.node_id))
    out.extend(Target(p.node_id, False) for p in servers)
    if local_ok and local is not None and _saturated(local):
        out.append(Target(local.node_id, True))
    return out


def routable_models(local: NodeInfo | None, peers: list[NodeInfo]) -> dict[str, list[str]]:
    """model name -> node ids serving it now (the local node first). Clients serve nothing."""
    out: dict[str, list[str]] = {}
    nodes = ([local] if local is not None else []) + [p for p in peers if p.role != "client" and p.state == "alive"]
    for n in nodes:
        for m in n.models:
            ids = out.setdefault(m, [])
            if n.node_id not in ids:
                ids.append(n.node_id)
    return out


def choose_auto(local: NodeInfo | None, peers: list[NodeInfo]) -> str | None:
    """The model ``"auto"`` means right now, or None when the mesh serves nothing."""
    if local is not None and local.models and not _saturated(local):
        return sorted(local.models)[0]
    served = routable_models(local, peers)
    if not served:
        return None
    return min(served, key=lambda m: (-len(served[m]), m))


@dataclass
class RouteTable:
    """Mutable holder of per-peer measurements, shared by the server and the directory."""

    stats: dict[str, PeerStats] = field(default_factory=dict)

    def peer(self, node_id: str) -> PeerStats:
        return self.stats.setdefault(node_id, PeerStats())
