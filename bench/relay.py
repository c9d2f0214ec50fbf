"""Relay benchmark: the round trip of a request relayed through a member against the direct one.

    python bench/relay.py [--n 2000] [--size 4096] [--legs quic,lane]

B and C are ``tests/transport_peer.py`` processes on loopback (B relays; C answers ``echo:`` RPCs). This
process measures, one after the other with the others idle: the 4 KiB RPC round trip A->C over a direct
QUIC connection, A->B (one hop), and A->C relayed through B (a QUIC connection whose packets ride RELAY
streams through B). The issue's target: relayed - direct <= one hop's round trip + 0.3 ms. Medians with
p10-p90; both QUIC packet sizes (16 KiB loopback default, 1350 B as on a LAN). The relay's two legs ride
QUIC ("quic": no data lanes anywhere) or the data lanes A-B and B-C ("lane": every node runs a lane, as
daemons do by default; the relay's legs then use them, ``RelayConfig.legs_on_lanes``); for "lane" the
one-hop round trip is also shown on the lane itself (a 4 KiB echo on an EXPERT stream to B).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


async def _rtts(peer: object, n: int, size: int) -> list[float]:
    from transport.quic import StreamType

    payload = b"echo:" + os.urandom(size - 5)
    for _ in range(100):  # warm up
        await peer.request(StreamType.RPC, payload, 5.0)  # type: ignore[attr-defined]
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await peer.request(StreamType.RPC, payload, 5.0)  # type: ignore[attr-defined]
        out.append(time.perf_counter() - t0)
    return out


def _fmt(xs: list[float]) -> str:
    xs = sorted(xs)
    return (f"{statistics.median(xs) * 1e6:7.0f} us (p10 {xs[len(xs) // 10] * 1e6:.0f}, "
            f"p90 {xs[len(xs) * 9 // 10] * 1e6:.0f})")


async def _lane_rtts(peer: object, n: int, size: int) -> list[float]:
    from transport.quic import StreamType

    stream = await peer.open_stream(StreamType.EXPERT)  # type: ignore[attr-defined]
    assert stream.path == "lane", stream.path  # noqa: S101 - bench precondition
    await stream.send(b"echo")
    payload = os.urandom(size)
    out = []
    for i in range(100 + n):
        t0 = time.perf_counter()
        await stream.send(payload)
        await stream.recv()
        if i >= 100:  # the first 100 warm up
            out.append(time.perf_counter() - t0)
    await stream.end()
    return out


async def _wait_lanes(to_b: object, c_id: str) -> None:
    """Until A-B and B-C both have a data lane (B's view, asked over RPC)."""
    import json

    from transport.quic import StreamType

    deadline = time.monotonic() + 15
    while True:
        reply = await to_b.request(StreamType.RPC, b"stats", 5.0)  # type: ignore[attr-defined]
        paths = json.loads(reply).get("paths", {})
        if to_b.path == "lane" and paths.get(c_id) == "lane":  # type: ignore[attr-defined]
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"lanes not up: A-B {to_b.path}, B-C {paths.get(c_id)}")  # type: ignore[attr-defined]
        await asyncio.sleep(0.1)


async def run(n: int, size: int, overrides: dict[str, object], tmp: Path, legs: str) -> dict[str, float]:
    from transport_peer import PeerProcess, member_of, peer_config

    from transport.config import TransportConfig
    from transport.credentials import create_mesh
    from transport.identity import NodeIdentity
    from transport.lane import LaneManager
    from transport.quic import MeshTransport
    from transport.relay import RelayManager

    ia, ib, ic = (NodeIdentity.generate() for _ in range(3))
    creds = create_mesh(ia, "bench", int(time.time()), 1, 1)
    lane = {"lane": "127.0.0.1:0"} if legs == "lane" else {}
    b = PeerProcess(peer_config(ib, member_of(creds, ib), relay=True, transport=overrides, **lane), tmp)
    c = PeerProcess(peer_config(ic, member_of(creds, ic), relay=True, transport=overrides,
                                keep=[[b.node_id, b.addr[0], b.addr[1]]], **lane), tmp)
    tconfig = replace(TransportConfig(), **overrides)  # type: ignore[arg-type]
    direct = MeshTransport(NodeIdentity.generate(), None, tconfig)
    direct.set_credentials(member_of(creds, direct.identity))
    a = MeshTransport(ia, creds, tconfig)
    lanes, relay = LaneManager(a), RelayManager(a)
    try:
        await a.listen("127.0.0.1", 0)
        if lane:
            await lanes.listen("127.0.0.1", 0)
        to_b = await a.connect(b.addr, b.node_id)
        if lane:
            await _wait_lanes(to_b, c.node_id)
        deadline = time.monotonic() + 10
        relayed = None
        while relayed is None:
            try:
                relayed = await relay.connect_via(to_b, c.node_id)
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)  # C is still connecting to B
        to_c = await direct.connect(c.addr, c.node_id)
        res = {"direct": await _rtts(to_c, n, size), "hop": await _rtts(to_b, n, size),
               "relayed": await _rtts(relayed, n, size)}
        if lane:
            res["lane_hop"] = await _lane_rtts(to_b, n, size)
        print(f"  A->C direct   {_fmt(res['direct'])}")
        print(f"  A->B one hop  {_fmt(res['hop'])}")
        if lane:
            print(f"  A->B lane hop {_fmt(res['lane_hop'])}")
        print(f"  A->B->C relay {_fmt(res['relayed'])}")
        assert relay.stats.get("relay_lane_leg_failed", 0) == 0, relay.stats  # noqa: S101 - legs as labelled
        med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
        extra = med["relayed"] - med["direct"]
        print(f"  relay adds {extra:.3f} ms = one hop ({med['hop']:.3f} ms) + {extra - med['hop']:+.3f} ms "
              f"(target: at most one hop + 0.3 ms)")
        if lane:
            print(f"  against the lane hop ({med['lane_hop']:.3f} ms): + {extra - med['lane_hop']:+.3f} ms")
        return med
    finally:
        await relay.close()
        await lanes.close()
        await a.close()
        await direct.close()
        b.stop()
        c.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="round trips per path (default 2000)")
    ap.add_argument("--size", type=int, default=4096, help="request and reply bytes (default 4096)")
    ap.add_argument("--legs", default="quic,lane",
                    help="what the relay's legs ride, comma list of quic and lane (default quic,lane)")
    args = ap.parse_args()
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {args.n} RPCs of "
          f"{args.size} B each way")
    with tempfile.TemporaryDirectory() as d:
        for name, overrides in (("QUIC 16 KiB packets (loopback default)", {}),
                                ("QUIC 1350 B packets (as on a LAN)", {"loopback_datagram_size": 0})):
            for legs in args.legs.split(","):
                print(f"{name}, relay legs on {legs}")
                asyncio.run(run(args.n, args.size, overrides, Path(d), legs))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
