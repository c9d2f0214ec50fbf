"""A deterministic discrete-event simulator of many membership cores (for tests and bench/gossip.py).

No I/O: frames travel through an in-memory heap with per-frame latency, random loss and partitions. All
nodes share one ``RecordVerifier`` (a memo of signature checks, so 1,000 nodes do not each re-verify
the same bytes; every record is still verified once).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable

from meshd.membership.config import MembershipConfig
from meshd.membership.core import Membership
from meshd.membership.events import Event
from meshd.membership.records import LocalInfo, ModelInfo, RecordVerifier
from transport.credentials import MemberCert, MeshCredentials, create_mesh
from transport.identity import NodeIdentity


class Sim:
    def __init__(self, n: int, config: MembershipConfig, seed: int = 1, loss: float = 0.0,
                 latency_s: tuple[float, float] = (0.001, 0.005), bootstrap: bool = True) -> None:
        self.rng = random.Random(seed)
        self.config = config
        self.loss = loss
        self.latency_s = latency_s
        self.now = 0.0
        self._heap: list[tuple[float, int, int, str, str, bytes]] = []
        self._seq = 0
        self._sched: dict[str, float] = {}
        self.partition: dict[str, int] | None = None
        self.down: set[str] = set()
        self.bytes_sent: dict[str, int] = {}
        self.events: list[tuple[float, str, Event]] = []
        self.on_event: Callable[[float, str, Event], None] | None = None
        first = NodeIdentity.generate()
        self.creds0 = create_mesh(first, "sim", 1, 1, 1)
        self.admin = self.creds0.admin
        self.verifier = RecordVerifier(self.creds0.genesis)
        self.identities = [first] + [NodeIdentity.generate() for _ in range(n - 1)]
        self.nodes: dict[str, Membership] = {}
        for i, ident in enumerate(self.identities):
            self.add_node(ident, incarnation=1, seed=seed * 100_003 + i)
        if bootstrap:
            records = [m.local_record for m in self.nodes.values()]
            for m in self.nodes.values():
                m._bootstrap(records, 0.0)
                m._rumours.clear()  # everyone already knows everyone: start quiet
        for node_id in self.nodes:
            self._schedule(node_id)

    def creds_for(self, ident: NodeIdentity) -> MeshCredentials:
        assert self.admin is not None
        cert = MemberCert.issue(self.admin, self.creds0.genesis, ident.public_key, 1)
        return MeshCredentials(genesis=self.creds0.genesis, cert=cert)

    def add_node(self, ident: NodeIdentity, incarnation: int, seed: int) -> Membership:
        info = LocalInfo(addrs=(f"sim:{ident.node_id[:8]}",), models=(ModelInfo("tiny", "moe", "fp0", 4096),))
        m = Membership(identity=ident, credentials=self.creds_for(ident), info=info, config=self.config,
                       rng=random.Random(seed), now=self.now, incarnation=incarnation, verifier=self.verifier)
        self.nodes[ident.node_id] = m
        return m

    def _schedule(self, node_id: str) -> None:
        t = max(self.nodes[node_id].get_timer(), self.now)
        if self._sched.get(node_id) != t:
            self._sched[node_id] = t
            self._seq += 1
            heapq.heappush(self._heap, (t, self._seq, 0, node_id, "", b""))

    def flush(self, node_id: str) -> None:
        m = self.nodes[node_id]
        for dest, data in m.messages_to_send():
            self.bytes_sent[node_id] = self.bytes_sent.get(node_id, 0) + len(data)
            if dest not in self.nodes or dest in self.down or self.rng.random() < self.loss:
                continue
            if self.partition is not None and self.partition.get(node_id) != self.partition.get(dest):
                continue
            self._seq += 1
            t = self.now + self.rng.uniform(*self.latency_s)
            heapq.heappush(self._heap, (t, self._seq, 1, dest, node_id, data))
        while (ev := m.next_event()) is not None:
            self.events.append((self.now, node_id, ev))
            if self.on_event is not None:
                self.on_event(self.now, node_id, ev)
        self._schedule(node_id)

    def kill(self, node_id: str) -> None:
        self.down.add(node_id)

    def run_until(self, t_end: float, stop: Callable[[], bool] | None = None, check_every_s: float = 0.1
                  ) -> bool:
        """Advance to ``t_end``; returns True early if ``stop()`` became true (checked every step)."""
        next_check = self.now
        while self._heap and self._heap[0][0] <= t_end:
            t, _, kind, node_id, src, data = heapq.heappop(self._heap)
            self.now = t
            if stop is not None and t >= next_check:
                next_check = t + check_every_s
                if stop():
                    return True
            if node_id in self.down:
                continue
            m = self.nodes[node_id]
            if kind == 0:
                if self._sched.get(node_id) != t:
                    continue
                self._sched.pop(node_id, None)
                m.handle_timer(t)
            else:
                m.receive(src, data, t)
            self.flush(node_id)
        self.now = t_end
        return stop() if stop is not None else False

    def live_nodes(self) -> list[Membership]:
        return [m for i, m in self.nodes.items() if i not in self.down]
