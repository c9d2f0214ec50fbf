"""Relay benchmark: the round trip of a request relayed through a member against the direct one.

    python bench/relay.py [--n 2000] [--size 4096]

B and C are ``tests/transport_peer.py`` processes on loopback (B relays; C answers ``echo:`` RPCs). This
process measures, one after the other with the others idle: the 4 KiB RPC round trip A->C over a direct
QUIC connection, A->B (one hop), and A->C relayed through B (a QUIC connection whose packets ride RELAY
streams through B). The issue's target: relayed - direct <= one hop's round trip + 0.3 ms. Medians with
p10-p90; both QUIC packet sizes (16 KiB loopback default, 1350 B as on a LAN).
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


async def run(n: int, size: int, overrides: dict[str, object], tmp: Path) -> dict[str, float]:
    from transport_peer import PeerProcess, member_of, peer_config

    from transport.config import TransportConfig
    from transport.credentials import create_mesh
    from transport.identity import NodeIdentity
    from transport.lane import LaneManager
    from transport.quic import MeshTransport
    from transport.relay import RelayManager

    ia, ib, ic = (NodeIdentity.generate() for _ in range(3))
    creds = create_mesh(ia, "bench", int(time.time()), 1, 1)
    b = PeerProcess(peer_config(ib, member_of(creds, ib), relay=True, transport=overrides), tmp)
    c = PeerProcess(peer_config(ic, member_of(creds, ic), relay=True, transport=overrides,
                                keep=[[b.node_id, b.addr[0], b.addr[1]]]), tmp)
    tconfig = replace(TransportConfig(), **overrides)  # type: ignore[arg-type]
    direct = MeshTransport(NodeIdentity.generate(), None, tconfig)
    direct.set_credentials(member_of(creds, direct.identity))
    a = MeshTransport(ia, creds, tconfig)
    lanes, relay = LaneManager(a), RelayManager(a)
    try:
        await a.listen("127.0.0.1", 0)
        to_b = await a.connect(b.addr, b.node_id)
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
        print(f"  A->C direct   {_fmt(res['direct'])}")
        print(f"  A->B one hop  {_fmt(res['hop'])}")
        print(f"  A->B->C relay {_fmt(res['relayed'])}")
        med = {k: statistics.median(v) * 1e3 for k, v in res.items()}
        extra = med["relayed"] - med["direct"]
        print(f"  relay adds {extra:.3f} ms = one hop ({med['hop']:.3f} ms) + {extra - med['hop']:+.3f} ms "
              f"(target: at most one hop + 0.3 ms)")
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
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--size", type=int, default=4096)
    args = ap.parse_args()
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {args.n} RPCs of "
          f"{args.size} B each way")
    with tempfile.TemporaryDirectory() as d:
        for name, overrides in (("QUIC 16 KiB packets (loopback default)", {}),
                                ("QUIC 1350 B packets (as on a LAN)", {"loopback_datagram_size": 0})):
            print(name)
            asyncio.run(run(args.n, args.size, overrides, Path(d)))
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
