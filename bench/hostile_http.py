"""API latency of a normal request while 100 slowloris connections are held open, before and after.

Each side is a real ``meshd serve --model tiny`` process on loopback (--no-mdns), started from a source
tree: "before" is a git ref extracted with ``git archive`` (default ``main``), "after" is this checkout.
The sides run one after the other, so each is timed while the other is not running at all.

Per side: 5 warm-up requests, then 20 normal requests with nothing else going on ("quiet"), then 100
attacker slots (a third each: connect and send nothing; send a head one header line per second and never
end it; send a complete head announcing a 100 kB body and then one byte per second). An attacker whose
connection is closed reopens it after 1 s, as slowloris does. For 30 s normal requests run back to back
("attack"); at the end we count the first 100 attacker connections the server has not closed.

A normal request is ``POST /v1/chat/completions`` for 4 tokens of the tiny model, on a new connection.

    python bench/hostile_http.py [--before-ref main] [--slots 100] [--window-s 30]

``rows()`` returns the table as dicts (``bench/hostile.py`` imports it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4,
                   "temperature": 0}).encode()
REQUEST = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(BODY), BODY))


def extract_ref(ref: str, into: Path) -> Path:
    """``git archive REF`` of this repository, unpacked into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


class Node:
    def __init__(self, src: Path, state: Path) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MESHD_")}
        env["PYTHONPATH"] = str(src)
        self.state = state
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "meshd", "serve", "--state-dir", str(state), "--no-mdns", "--listen",
             "127.0.0.1:0", "--api", "127.0.0.1:0", "--model", "tiny", "--log-format", "json",
             "--log-level", "warning"],
            env=env, cwd=str(src), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"meshd from {src} exited with {self.proc.returncode}")
            try:
                host, _, port = json.loads((state / "run.json").read_text())["api"].rpartition(":")
                self.addr = (host, int(port))
                return
            except (OSError, ValueError, KeyError, AttributeError):
                if time.monotonic() > deadline:
                    raise RuntimeError("meshd did not start within 60 s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def normal_request(addr: tuple[str, int]) -> float:
    """Seconds for one complete request on a new connection. Raises on anything but a 200."""
    t0 = time.perf_counter()
    r, w = await asyncio.open_connection(*addr)
    try:
        w.write(REQUEST)
        data = await asyncio.wait_for(r.read(), 60)
    finally:
        w.close()
    if not data.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"normal request failed: {data[:120]!r}")
    return time.perf_counter() - t0


async def attacker(addr: tuple[str, int], kind: str, stop: asyncio.Event, first_closed: list[float | None],
                   slot: int, t_start: float) -> None:
    """One slowloris slot: hold a connection open without finishing a request; reopen 1 s after a close."""
    generation = 0
    while not stop.is_set():
        try:
            r, w = await asyncio.open_connection(*addr)
        except OSError:
            await asyncio.sleep(1.0)
            continue
        if kind == "head":
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
        elif kind == "body":
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100000\r\n\r\n{")
        try:
            while not stop.is_set():
                try:
                    if not await asyncio.wait_for(r.read(4096), 1.0):
                        break  # the server closed it
                except TimeoutError:
                    if kind == "head":
                        w.write(b"X-Slow: 1\r\n")
                    elif kind == "body":
                        w.write(b" ")
        except OSError:
            pass
        finally:
            w.close()
        if generation == 0 and not stop.is_set():
            first_closed[slot] = time.monotonic() - t_start
        generation += 1
        if not stop.is_set():
            await asyncio.sleep(1.0)


def _stats(xs: list[float]) -> dict[str, Any]:
    ms = [x * 1000 for x in xs]
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 2), "min_ms": round(min(ms), 2),
            "max_ms": round(max(ms), 2)}


async def measure(addr: tuple[str, int], slots: int, window_s: float) -> dict[str, Any]:
    for _ in range(5):
        await normal_request(addr)
    quiet = [await normal_request(addr) for _ in range(20)]
    stop = asyncio.Event()
    first_closed: list[float | None] = [None] * slots
    t_start = time.monotonic()
    kinds = ["idle", "head", "body"]
    tasks = [asyncio.create_task(attacker(addr, kinds[i % 3], stop, first_closed, i, t_start))
             for i in range(slots)]
    await asyncio.sleep(1.0)
    attack: list[float] = []
    failures = 0
    while time.monotonic() - t_start < window_s:
        try:
            attack.append(await normal_request(addr))
        except (OSError, RuntimeError, TimeoutError):
            failures += 1
        await asyncio.sleep(0.1)
    still_open = sum(1 for c in first_closed if c is None)
    closed = [c for c in first_closed if c is not None]
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"quiet": quiet, "attack": attack, "failures": failures, "still_open": still_open,
            "closed_s": closed}


def run_side(src: Path, slots: int, window_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hostile-http-") as tmp:
        node = Node(src, Path(tmp) / "state")
        try:
            return asyncio.run(measure(node.addr, slots, window_s))
        finally:
            node.stop()


def rows(before_ref: str = "main", slots: int = 100, window_s: float = 30.0) -> list[dict[str, Any]]:
    """The table: per side, the normal request's latency quiet and under attack, failed normal requests,
    and the first ``slots`` attacker connections still open after ``window_s``."""
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hostile-http-before-") as tmp:
        sides = {"before": extract_ref(before_ref, Path(tmp) / "src"), "after": REPO}
        for side, src in sides.items():
            res = run_side(src, slots, window_s)
            label = f"{side} ({before_ref})" if side == "before" else "after (this checkout)"
            q = _stats(res["quiet"])
            a = _stats(res["attack"]) if res["attack"] else {"n": 0}
            out.append({"bench": "api_slowloris", "side": label, "measure": "normal request, quiet", **q})
            out.append({"bench": "api_slowloris", "side": label,
                        "measure": f"normal request, {slots} slowloris slots", **a,
                        "failed": res["failures"],
                        "ratio_to_quiet": round(a["median_ms"] / q["median_ms"], 2) if a.get("n") else None})
            closed = res["closed_s"]
            out.append({"bench": "api_slowloris", "side": label,
                        "measure": f"slowloris connections still open after {window_s:g} s",
                        "open": res["still_open"], "of": slots,
                        "closed_after_s_max": round(max(closed), 1) if closed else None})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before-ref", default="main", help="git ref of the 'before' side (default main)")
    ap.add_argument("--slots", type=int, default=100, help="slowloris connections held open (default 100)")
    ap.add_argument("--window-s", type=float, default=30.0, help="attack window in seconds (default 30)")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON lines (default: a table)")
    args = ap.parse_args()
    table = rows(args.before_ref, args.slots, args.window_s)
    for row in table:
        if args.json:
            print(json.dumps(row))
        else:
            rest = {k: v for k, v in row.items() if k not in ("bench", "side", "measure")}
            print(f"{row['side']:<24} {row['measure']:<44} {rest}")


if __name__ == "__main__":
    main()
