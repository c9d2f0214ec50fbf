"""A stranger attacking a node on loopback, before and after a change (issue 15): one table.

    flock /tmp/meshd-bench.lock python bench/hostile.py [--before DIR] [--skip-http]

Transport rows (this file): a real node process (tests/transport_peer.py of each tree) under
- a junk-Initial flood: 10,000 datagrams of 1200 B (long header 0xC3, QUIC v1, random 8-byte connection
  ids, random payload) in 10 s from one loopback socket: the node's RSS growth (VmRSS, 1 s after the
  flood, against just before it) and the member connect times during the flood (3 connects);
- held handshake slots: 200 silent TLS connections, reopened as they close, from another loopback address
  (127.0.0.2) and from the member's own address (127.0.0.1, as behind a NAT); 10 member connects, 0.3 s
  apart, starting 3 s into the attack: median [min-max] and how many connected within 1 s.
A member connect is a fresh MeshTransport of the same tree (bench/hostile_probe.py) until admitted.

"before" is the code in ``--before DIR`` (default: ``git archive main`` into a temporary directory),
"after" this working tree; the sides run one after the other, never at once. If ``bench/hostile_http.py``
exists, its ``rows()`` (HTTP API under slowloris) are added to the same table.
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hostile_tools import flood, rss_bytes  # noqa: E402

from transport.credentials import create_mesh  # noqa: E402
from transport.identity import NodeIdentity  # noqa: E402

MB = 1024 * 1024


class Side:
    """One tree's code: runs its node process and its member probe."""

    def __init__(self, name: str, tree: Path, workdir: Path) -> None:
        self.name = name
        self.tree = tree
        self.workdir = workdir
        self.env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"}
        alpn = subprocess.run(
            [sys.executable, "-c", "import transport; print(transport.ALPN)"],
            env=self.env, capture_output=True, text=True, check=True, cwd=str(tree),
        )
        self.alpn = alpn.stdout.strip()

    def start_node(self, mesh: Any) -> tuple[subprocess.Popen[str], tuple[str, int], str]:
        ident = NodeIdentity.generate()
        from transport_peer import member_of, peer_config

        path = self.workdir / f"{self.name}-node.json"
        path.write_text(json.dumps(peer_config(ident, member_of(mesh, ident))))
        proc = subprocess.Popen(
            [sys.executable, str(self.tree / "tests" / "transport_peer.py"), str(path)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=self.env, cwd=str(self.tree),
        )
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        return proc, (info["addr"][0], int(info["addr"][1])), info["node_id"]

    def probe(self, mesh: Any, addr: tuple[str, int], node_id: str, count: int, interval_s: float) -> dict[str, Any]:
        assert mesh.admin is not None
        path = self.workdir / f"{self.name}-probe-{time.monotonic_ns()}.json"
        path.write_text(json.dumps({
            "genesis": base64.b64encode(mesh.genesis.encoded).decode(), "admin": mesh.admin.private_bytes().hex(),
            "addr": list(addr), "node_id": node_id, "count": count, "interval_s": interval_s, "timeout_s": 5.0,
        }))
        out = subprocess.run(
            [sys.executable, str(ROOT / "bench" / "hostile_probe.py"), str(path)],
            env=self.env, capture_output=True, text=True, timeout=120, cwd=str(self.tree),
        )
        lines = out.stdout.strip().splitlines()
        if out.returncode != 0 or not lines:
            raise RuntimeError(f"{self.name} probe failed: {out.stderr[-1500:]}")
        result: dict[str, Any] = json.loads(lines[-1])
        return result


def stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def fmt_times(times: list[float | None]) -> str:
    ok = [t for t in times if t is not None]
    within = sum(1 for t in ok if t < 1.0)
    if not ok:
        return f"0/{len(times)} connected"
    ms = [t * 1000 for t in ok]
    return f"{statistics.median(ms):.0f} ms [{min(ms):.0f}-{max(ms):.0f}], {within}/{len(times)} < 1 s"


def junk_flood(side: Side, mesh: Any) -> dict[str, str]:
    proc, addr, node_id = side.start_node(mesh)
    try:
        side.probe(mesh, addr, node_id, 1, 0.0)  # warm up what a member uses
        time.sleep(0.5)
        rss0 = rss_bytes(proc.pid)
        sent: list[int] = []
        flooder = threading.Thread(target=lambda: sent.append(flood(addr, 10_000, 10.0)))
        flooder.start()
        time.sleep(2.0)
        during = side.probe(mesh, addr, node_id, 3, 2.5)
        flooder.join()
        time.sleep(1.0)
        rss1 = rss_bytes(proc.pid)
    finally:
        stop(proc)
    return {"rss": f"+{(rss1 - rss0) / MB:.0f} MB ({rss0 / MB:.0f} -> {rss1 / MB:.0f})",
            "connect": fmt_times(during["times"]), "errors": "; ".join(sorted(set(during["errors"])))[:200]}


def held_slots(side: Side, mesh: Any, source: str) -> dict[str, str]:
    proc, addr, node_id = side.start_node(mesh)
    holder = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "hostile_tools.py"), "hold", addr[0], str(addr[1]), "200", "14",
         source, side.alpn],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        time.sleep(3.0)
        result = side.probe(mesh, addr, node_id, 10, 0.3)
        held = json.loads(holder.communicate(timeout=60)[0])
    finally:
        if holder.poll() is None:
            holder.kill()
        stop(proc)
    return {"connect": fmt_times(result["times"]), "held": f"{held.get('opened', 0)} opened",
            "errors": "; ".join(sorted(set(result["errors"])))[:200]}


def transport_rows(before: Side, after: Side) -> list[dict[str, str]]:
    mesh = create_mesh(NodeIdentity.generate(), "hostile-bench", int(time.time()), 1, 1)
    rows: list[dict[str, str]] = []
    res = {s.name: junk_flood(s, mesh) for s in (before, after)}
    rows.append({"attack": "10,000 junk Initials in 10 s", "measure": "node RSS growth",
                 "before": res["before"]["rss"], "after": res["after"]["rss"], "target": "<= 20 MB"})
    rows.append({"attack": "10,000 junk Initials in 10 s", "measure": "member connect during flood",
                 "before": res["before"]["connect"], "after": res["after"]["connect"], "target": "< 1 s"})
    for row in rows:
        print(f"# {json.dumps(row)}", file=sys.stderr, flush=True)
    for source, label in (("127.0.0.2", "another address"), ("127.0.0.1", "the member's address")):
        res = {s.name: held_slots(s, mesh, source) for s in (before, after)}
        rows.append({"attack": f"200 silent connections from {label}", "measure": "member connect (10 tries)",
                     "before": res["before"]["connect"], "after": res["after"]["connect"],
                     "target": "10/10 < 1 s"})
        print(f"# {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
        for name in ("before", "after"):
            if res[name]["errors"]:
                print(f"# {name}, {label}: {res[name]['errors']}", file=sys.stderr)
    return rows


def http_rows() -> list[dict[str, Any]]:
    """The api engineer's rows (bench/hostile_http.py ``rows()``), if that module exists."""
    path = ROOT / "bench" / "hostile_http.py"
    if not path.exists():
        return []
    sys.path.insert(0, str(path.parent))
    import hostile_http  # type: ignore[import-not-found]

    rows: list[dict[str, Any]] = hostile_http.rows()
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    cols: list[str] = []
    for row in rows:
        cols += [k for k in row if k not in cols]
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    print("| " + " | ".join(c.ljust(widths[c]) for c in cols) + " |")
    print("|" + "|".join("-" * (widths[c] + 2) for c in cols) + "|")
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, default=None,
                    help="tree with the code before the change (default: git archive main into a temp dir)")
    ap.add_argument("--skip-http", action="store_true", help="leave out bench/hostile_http.py's rows (default: run them)")
    ap.add_argument("--skip-transport", action="store_true", help="leave out the QUIC rows (default: run them)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshd-hostile-") as tmp:
        work = Path(tmp)
        rows: list[dict[str, Any]] = []
        if not args.skip_transport:
            before_tree = args.before
            if before_tree is None:
                before_tree = work / "before"
                before_tree.mkdir()
                archive = subprocess.run(["git", "-C", str(ROOT), "archive", "main"], capture_output=True, check=True)
                subprocess.run(["tar", "-x", "-C", str(before_tree)], input=archive.stdout, check=True)
            before = Side("before", before_tree.resolve(), work)
            after = Side("after", ROOT, work)
            print(f"# before: {before.tree} ({before.alpn}); after: {after.tree} ({after.alpn})", file=sys.stderr)
            rows += transport_rows(before, after)
        if not args.skip_http:
            rows += http_rows()
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
