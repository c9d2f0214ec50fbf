"""Tunnel overhead on loopback: a request straight to the serving node vs through a second node.

Starts two node processes (``tests/api_node.py``: real QUIC + the API service, as the daemon wires it):
A serves a fast in-process stand-in model (no model compute, so the transport is what is measured),
B is a headless client connected to A. Then, in one run:

- latency of a one-token non-streaming completion, direct (A) and through B: median and p99;
- time to the first streamed token, the same way;
- streamed tokens/s with 1 and 16 concurrent streams, direct and through B.

    python bench/tunnel.py [--requests 200] [--tokens 20000] [--rounds 3] [--json]

Latencies alternate direct and tunnelled requests one by one; throughput alternates runs and reports
the best of ``--rounds`` for each path, plus the CPU each node spent per token (less noisy than wall
time on a shared machine).

Targets (issue 5): at most 2 ms added at the median, at least 0.8x direct streaming throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import aiohttp  # noqa: E402

from api_helpers import NodeProcess, wait_models  # noqa: E402
from api_node import make_mesh  # noqa: E402

MSGS = [{"role": "user", "content": "bench"}]


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


async def one_token(s: aiohttp.ClientSession, url: str) -> float:
    t0 = time.perf_counter()
    async with s.post(url + "/chat/completions", json={"model": "fast", "messages": MSGS, "max_tokens": 1}) as r:
        await r.read()
        assert r.status == 200, r.status
    return (time.perf_counter() - t0) * 1000


async def first_token(s: aiohttp.ClientSession, url: str) -> float:
    t0 = time.perf_counter()
    body = {"model": "fast", "messages": MSGS, "max_tokens": 1, "stream": True}
    async with s.post(url + "/chat/completions", json=body) as r:
        assert r.status == 200, r.status
        async for line in r.content:
            if line.startswith(b"data: ") and b'"content":" ' in line:  # the first token (not the role chunk)
                dt = (time.perf_counter() - t0) * 1000
                break
        else:
            raise RuntimeError("no token")
        await r.read()
    return dt


async def stream_tokens(s: aiohttp.ClientSession, url: str, n: int) -> int:
    body = {"model": "fast", "messages": MSGS, "max_tokens": n, "stream": True}
    got = 0
    async with s.post(url + "/chat/completions", json=body) as r:
        assert r.status == 200, r.status
        async for line in r.content:
            if line.startswith(b"data: {") and b'"content":" ' in line:
                got += 1
    return got


async def throughput(url: str, streams: int, n: int) -> float:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        await stream_tokens(s, url, 50)  # warm up
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(stream_tokens(s, url, n) for _ in range(streams)))
        dt = time.perf_counter() - t0
    assert all(c == n for c in counts), counts
    return sum(counts) / dt


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    import os

    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def paired_latencies(direct: str, hop: str, fn: Any, n: int) -> tuple[list[float], list[float]]:
    """Alternate direct and tunnelled requests one by one, so both see the same machine load."""
    async with aiohttp.ClientSession() as s:
        for _ in range(max(5, n // 10)):
            await fn(s, direct)
            await fn(s, hop)
        d, h = [], []
        for _ in range(n):
            d.append(await fn(s, direct))
            h.append(await fn(s, hop))
    return d, h


async def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="meshd-bench-"))
    creds = make_mesh(tmp, 2)
    a = NodeProcess(creds[0][0], "--standin", "fast", "--max-active", "256")
    b = NodeProcess(creds[1][0], "--role", "client", "--connect", a.addr)
    try:
        if wait_models(b.url, {"fast"}) != {"fast"}:
            raise RuntimeError("client did not see the model")
        res: dict[str, Any] = {}
        for label, fn in (("one_token_ms", one_token), ("first_token_ms", first_token)):
            d, h = await paired_latencies(a.url, b.url, fn, args.requests)
            res[label] = {"direct": {"median": statistics.median(d), "p99": pct(d, 99)},
                          "tunnel": {"median": statistics.median(h), "p99": pct(h, 99)}}
        for streams in (1, 16):
            n = args.tokens if streams == 1 else max(100, args.tokens // 8)
            d_rates, h_rates = [], []
            cpu = {"a_direct": 0.0, "a_tunnel": 0.0, "b_tunnel": 0.0}
            for _ in range(args.rounds):  # alternate; best of rounds (least disturbed by other load)
                ca = cpu_s(a.proc.pid)
                d_rates.append(await throughput(a.url, streams, n))
                cb, ca2 = cpu_s(b.proc.pid), cpu_s(a.proc.pid)
                cpu["a_direct"] += ca2 - ca
                h_rates.append(await throughput(b.url, streams, n))
                cpu["a_tunnel"] += cpu_s(a.proc.pid) - ca2
                cpu["b_tunnel"] += cpu_s(b.proc.pid) - cb
            total = args.rounds * streams * (n + 50)
            d_rate, h_rate = max(d_rates), max(h_rates)
            res[f"tokens_per_s_{streams}"] = {
                "direct": d_rate, "tunnel": h_rate, "ratio": h_rate / d_rate,
                "cpu_us_per_token": {k: v / total * 1e6 for k, v in cpu.items()}}
        return res
    finally:
        a.stop()
        b.stop()


def table(res: dict[str, Any]) -> str:
    lines = ["| measure | direct | through a 2nd node | added / ratio |", "|---|---|---|---|"]
    for key, name in (("one_token_ms", "one-token completion"), ("first_token_ms", "first streamed token")):
        for q in ("median", "p99"):
            d, h = res[key]["direct"][q], res[key]["tunnel"][q]
            lines.append(f"| {name} {q} (ms) | {d:.2f} | {h:.2f} | +{h - d:.2f} ms |")
    for streams in (1, 16):
        r = res[f"tokens_per_s_{streams}"]
        lines.append(f"| streamed tokens/s, {streams} stream{'s' if streams > 1 else ''} | {r['direct']:.0f} | "
                     f"{r['tunnel']:.0f} | {r['ratio']:.2f}x |")
    for streams in (1, 16):
        c = res[f"tokens_per_s_{streams}"]["cpu_us_per_token"]
        lines.append(f"| CPU per streamed token, {streams} stream{'s' if streams > 1 else ''} (us) | "
                     f"{c['a_direct']:.0f} (serving node) | {c['a_tunnel']:.0f} serving + {c['b_tunnel']:.0f} "
                     f"front | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=200,
                    help="latency requests per path and kind (default 200)")
    ap.add_argument("--tokens", type=int, default=20000,
                    help="streamed tokens for the 1-stream throughput run; 16 streams take tokens/8 each, at least 100 (default 20000)")
    ap.add_argument("--rounds", type=int, default=3, help="throughput runs per path, best kept (default 3)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table (default: a table)")
    args = ap.parse_args()
    res = asyncio.run(run(args))
    sys.stdout.write((json.dumps(res, indent=1) if args.json else table(res)) + "\n")


if __name__ == "__main__":
    main()
