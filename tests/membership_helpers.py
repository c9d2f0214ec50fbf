"""Helpers for membership unit tests: a small mesh of cores wired by an in-memory pipe."""

from __future__ import annotations

import random
from dataclasses import replace

from meshd.membership.config import MembershipConfig
from meshd.membership.core import Membership
from meshd.membership.events import Event
from meshd.membership.records import LocalInfo, ModelInfo
from transport.credentials import MemberCert, MeshCredentials, create_mesh
from transport.identity import NodeIdentity

QUIET = replace(MembershipConfig.default(), gossip_interval_s=1e6, reconnect_interval_s=1e6)
"""Only probes run on their own; gossip rounds are triggered by hand."""


class Mesh:
    def __init__(self, n: int, config: MembershipConfig = QUIET, seed: int = 7) -> None:
        self.config = config
        self.first = NodeIdentity.generate()
        self.creds0 = create_mesh(self.first, "test", 1, 1, 1)
        self.admin = self.creds0.admin
        self.ids: list[NodeIdentity] = [self.first] + [NodeIdentity.generate() for _ in range(n - 1)]
        self.cores: dict[str, Membership] = {}
        self.seed = seed
        for i, ident in enumerate(self.ids):
            self.cores[ident.node_id] = self.make_core(ident, incarnation=10, seed=seed + i)
        self.names = [i.node_id for i in self.ids]
        self.queue: list[tuple[str, str, bytes]] = []
        self.events: dict[str, list[Event]] = {k: [] for k in self.cores}
        self.dropped: set[str] = set()

    def creds(self, ident: NodeIdentity) -> MeshCredentials:
        assert self.admin is not None
        cert = MemberCert.issue(self.admin, self.creds0.genesis, ident.public_key, 1)
        return MeshCredentials(genesis=self.creds0.genesis, cert=cert)

    def make_core(self, ident: NodeIdentity, incarnation: int, seed: int, now: float = 0.0) -> Membership:
        info = LocalInfo(addrs=("127.0.0.1:1",), models=(ModelInfo("tiny", "moe", "fp0", 4096),))
        return Membership(identity=ident, credentials=self.creds(ident), info=info, config=self.config,
                          rng=random.Random(seed), now=now, incarnation=incarnation)

    def introduce_all(self) -> None:
        """Everyone learns everyone's record (no messages); rumours and events cleared."""
        blobs = [c.local_record.encoded for c in self.cores.values()]
        for c in self.cores.values():
            c.add_records(blobs, 0.0)
            c._rumours.clear()
            while c.next_event() is not None:
                pass
            c.messages_to_send()

    def collect(self, node_id: str) -> list[tuple[str, bytes]]:
        c = self.cores[node_id]
        out = c.messages_to_send()
        while (ev := c.next_event()) is not None:
            self.events[node_id].append(ev)
        for dest, data in out:
            self.queue.append((node_id, dest, data))
        return out

    def pump(self, now: float, max_steps: int = 10_000) -> int:
        """Deliver queued frames (and their answers) instantly; frames to ``dropped`` nodes are lost."""
        for k in list(self.cores):
            self.collect(k)
        steps = 0
        while self.queue and steps < max_steps:
            src, dest, data = self.queue.pop(0)
            steps += 1
            if dest in self.dropped or src in self.dropped or dest not in self.cores:
                continue
            self.cores[dest].receive(src, data, now)
            self.collect(dest)
        return steps

    def take_events(self, node_id: str) -> list[Event]:
        self.collect(node_id)
        evs, self.events[node_id] = self.events[node_id], []
        return evs
