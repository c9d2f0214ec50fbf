"""Many membership cores in the deterministic simulator: spread, detection, loss, a healing partition."""

from __future__ import annotations

import pytest

from meshd.membership.config import MembershipConfig
from meshd.membership.events import PeerDied
from meshd.membership.records import ModelInfo
from meshd.membership.sim import Sim


def _spread_and_kill(sim: Sim, spread_limit_s: float, dead_limit_s: float) -> None:
    ids = list(sim.nodes)
    origin, victim = ids[0], ids[1]
    sim.run_until(sim.now + 2.0)
    sim.nodes[origin].update_local(sim.now, models=(ModelInfo("new", "moe", "fp-new", 8),))
    version = sim.nodes[origin].incarnation
    t0 = sim.now

    def spread() -> bool:
        return all((v := m.member(origin)) is not None and v.record.version == version
                   for i, m in sim.nodes.items() if i != origin)

    assert sim.run_until(t0 + spread_limit_s, spread, 0.05), "record did not reach every node in time"
    sim.kill(victim)
    t0 = sim.now

    def dead() -> bool:
        return all((v := m.member(victim)) is not None and v.state == "dead" for m in sim.live_nodes())

    assert sim.run_until(t0 + dead_limit_s, dead, 0.1), "killed node not dead everywhere in time"
    assert not any(m.member(victim).state == "alive" for m in sim.live_nodes())  # type: ignore[union-attr]
    # nobody else was declared dead on the way (no false positives under loss)
    wrongly = {(n, e.node_id) for _, n, e in sim.events if isinstance(e, PeerDied) and e.node_id != victim}
    assert wrongly == set()


def test_50_nodes_with_10_percent_loss() -> None:
    sim = Sim(50, MembershipConfig.lan(), seed=5, loss=0.10)
    _spread_and_kill(sim, spread_limit_s=5.0, dead_limit_s=20.0)


@pytest.mark.slow
def test_1000_nodes_with_loss_and_a_partition_that_heals(n: int = 1000) -> None:
    """1,000 nodes, 2% loss: a record spreads, a killed node dies everywhere, then a rack of 20 nodes is
    cut off until everyone else declared it dead, and the mesh heals once the link returns."""
    sim = Sim(n, MembershipConfig.default(), seed=11, loss=0.02)
    _spread_and_kill(sim, spread_limit_s=10.0, dead_limit_s=40.0)
    ids = [i for i in sim.nodes if i not in sim.down]
    rack = set(ids[:20])
    sim.partition = {i: (1 if i in rack else 0) for i in ids}
    t0 = sim.now

    def cut() -> bool:
        return all(all(m.member(j).state == "dead" for j in rack)  # type: ignore[union-attr]
                   for i, m in sim.nodes.items() if i not in sim.down and i not in rack)

    assert sim.run_until(t0 + 60.0, cut, 0.5), "the cut-off rack was not declared dead"
    sim.partition = None
    t0 = sim.now

    def healed() -> bool:
        return all(len(m.live_ids()) == len(ids) - 1 for i, m in sim.nodes.items() if i not in sim.down)

    assert sim.run_until(t0 + 60.0, healed, 0.5), "partition did not heal"
