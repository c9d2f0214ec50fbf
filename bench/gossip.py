"""Gossip benchmark on the membership simulator (no network).

For each N: seconds and gossip rounds (at the default interval) until a changed record reaches every
node, and until a killed node is declared dead by every live node; bytes sent per node per second in a
quiet period, while the record spreads, during detection, and with records carrying load: every node's
load changes every second and each node re-signs its record as the daemon does (only when changed, at
most every ``load_interval_s(N)``, ``meshd.membership.load``), measured over ``--load-s`` seconds.

    python bench/gossip.py [--sizes 10,100,1000] [--loss 0.0] [--seed 1] [--load-s 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from meshd.membership.config import MembershipConfig  # noqa: E402
from meshd.membership.load import load_changed, load_interval_s  # noqa: E402
from meshd.membership.records import Capacity, Load, ModelInfo  # noqa: E402
from meshd.membership.sim import Sim  # noqa: E402


def load_phase(sim: Sim, seconds: float, seed: int) -> tuple[float, int]:
    """Every node's load changes every second; nodes re-sign as the daemon does. Returns bytes per node
    per second over the phase, and the number of load re-signs mesh-wide."""
    import random

    rng = random.Random(seed)
    ids = list(sim.nodes)
    n = len(ids)
    m0 = sim.nodes[ids[0]]
    interval = load_interval_s(n, len(m0.local_record.encoded), m0.config.retransmit_mult)
    next_ok = {i: sim.now + rng.uniform(0, interval) for i in ids}  # nodes started at different times
    b0, t0 = sum(sim.bytes_sent.values()), sim.now
    resigns = 0
    while sim.now < t0 + seconds:
        sim.run_until(sim.now + 1.0)
        for i in ids:
            m = sim.nodes[i]
            cap = m.local_record.capacity
            new_cap = Capacity(cap.cpus, cap.ram_mb, rng.randint(0, 8), cap.free_mb)
            new = Load(queue=rng.randint(0, 3), tok_s=round(rng.uniform(0, 50), 1), slots=4)
            if sim.now >= next_ok[i] and load_changed(cap, m.local_record.load, new_cap, new):
                m.update_local(sim.now, capacity=new_cap, load=new)
                next_ok[i] = sim.now + interval
                resigns += 1
                sim.flush(i)
    return (sum(sim.bytes_sent.values()) - b0) / n / (sim.now - t0), resigns


def run(n: int, loss: float, seed: int, load_s: float = 30.0) -> dict[str, float]:
    cfg = MembershipConfig.default()
    wall = time.perf_counter()
    sim = Sim(n, cfg, seed=seed, loss=loss)
    ids = list(sim.nodes)
    origin, victim = ids[0], ids[-1]

    def bytes_total() -> int:
        return sum(sim.bytes_sent.values())

    sim.run_until(2.0)
    b0, t0 = bytes_total(), sim.now
    sim.run_until(7.0)
    quiet = (bytes_total() - b0) / n / (sim.now - t0)

    sim.nodes[origin].update_local(sim.now, models=(ModelInfo("new", "moe", "fp-new", 8),))
    version = sim.nodes[origin].incarnation
    b0, t0 = bytes_total(), sim.now
    ok = sim.run_until(t0 + 60.0, lambda: all(
        (v := m.member(origin)) is not None and v.record.version == version
        for i, m in sim.nodes.items() if i != origin), 0.01)
    spread_s = sim.now - t0 if ok else float("nan")
    spread_bytes = (bytes_total() - b0) / n / max(sim.now - t0, 1e-9)

    sim.kill(victim)
    b0, t0 = bytes_total(), sim.now
    first_not_alive: float | None = None

    def dead() -> bool:
        nonlocal first_not_alive
        views = [m.member(victim) for m in sim.live_nodes()]
        if first_not_alive is None and all(v is not None and v.state != "alive" for v in views):
            first_not_alive = sim.now - t0
        return all(v is not None and v.state == "dead" for v in views)

    ok = sim.run_until(t0 + 120.0, dead, 0.05)
    dead_s = sim.now - t0 if ok else float("nan")
    detect_bytes = (bytes_total() - b0) / n / max(sim.now - t0, 1e-9)
    sim.run_until(sim.now + 5.0)
    b0, t0 = bytes_total(), sim.now
    sim.run_until(t0 + load_s)
    quiet_again = (bytes_total() - b0) / n / (sim.now - t0)  # same span as the load phase, for the ratio
    load_bytes, resigns = load_phase(sim, load_s, seed)
    return {
        "n": n, "loss": loss,
        "spread_s": round(spread_s, 3), "spread_rounds": round(spread_s / cfg.gossip_interval_s, 1),
        "not_alive_anywhere_s": round(first_not_alive or float("nan"), 3),
        "dead_by_all_s": round(dead_s, 3), "dead_rounds": round(dead_s / cfg.gossip_interval_s, 1),
        "bytes_per_node_s_quiet": round(quiet), "bytes_per_node_s_spread": round(spread_bytes),
        "bytes_per_node_s_detect": round(detect_bytes),
        "bytes_per_node_s_quiet_span": round(quiet_again), "bytes_per_node_s_load": round(load_bytes),
        "load_over_quiet": round(load_bytes / max(quiet_again, 1e-9), 2), "load_resigns": resigns,
        "load_interval_s": round(load_interval_s(n, len(sim.nodes[origin].local_record.encoded)), 1),
        "record_bytes": len(sim.nodes[origin].local_record.encoded), "wall_s": round(time.perf_counter() - wall, 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10,100,1000",
                    help="mesh sizes to simulate, comma list (default 10,100,1000)")
    ap.add_argument("--loss", type=float, default=0.0,
                    help="probability that a gossip frame is lost (default 0.0)")
    ap.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    ap.add_argument("--load-s", type=float, default=30.0, help="length of the load phase (default: 30)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table (default: a table)")
    args = ap.parse_args()
    rows = [run(int(n), args.loss, args.seed, args.load_s) for n in args.sizes.split(",")]
    if args.json:
        sys.stdout.write(json.dumps(rows) + "\n")
        return 0
    cols = list(rows[0])
    sys.stdout.write(" ".join(f"{c:>14}" for c in cols) + "\n")
    for r in rows:
        sys.stdout.write(" ".join(f"{r[c]!s:>14}" for c in cols) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
