"""Paired A/B of a pipeline decode hop's own costs: this checkout's code against another checkout's, in one process.

    python bench/pipeline_hop_ab.py --base DIR [--pairs 400]

``DIR`` is another checkout (``git archive main | tar -x -C /tmp/base``). Two measurements, each alternating the
two codes pair by pair (the order flipped every pair), medians with quartiles and the per-pair difference:

- codec: ``engine/pipeline/wire.py`` of each, encode + decode of a decode step's FORWARD (one row of the
  mid-size model's hidden size, 768) and RESULT (a logits row of its vocabulary, 8192), after a 64 MB sweep
  each time, so the caches are as cold as on the hop (the stage has just streamed its weights through them);
- channel: ``transport/lane_direct.py``'s ``DirectChannel`` of each, over real TLS 1.3 on loopback (a throwaway
  self-signed certificate; the lane's proof of identity is not part of a round trip), 3 KiB out and 32 KiB back
  (the hop's sizes), the far end echoing in its own thread, both ends asleep in ``recv`` for 2 ms before each
  round trip, as between two decode steps;
- hop: the whole decode hop as ``bench/pipeline.py`` counts it (``DirectHop.call``'s latency minus the stage's
  compute), each code's ``engine/pipeline/direct.py``, ``wire.py`` and ``lane_direct.py`` on both ends: the serving
  end here, the stage's ``serve`` in a forked process whose stand-in host "computes" a one-row step by sweeping
  64 MB (as a stage streams its weights) and answers a logits row; this end sweeps 64 MB before each call (its own
  layers). Also the channel's ping (a KEEPALIVE echoed) after the same sweep, and the hop / ping ratio of the
  medians. Two processes, so each hop has the two real wake-ups; the stage's own checks and locks around its
  compute (``StageHost.direct_step``) are not in it.

CPU work of one process, so on a loaded machine the medians hold better than a whole-pipeline bench's; the hop's
wake-ups between processes are not in it (``bench/pipeline_timeline.py`` shows those).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _report(what: str, res: dict[str, list[float]]) -> None:
    for name, v in res.items():
        q = statistics.quantiles(v, n=4)
        print(f"{what}, {name}: median {statistics.median(v):.1f} us [{q[0]:.1f}, {q[2]:.1f}]")
    d = [a - b for a, b in zip(res["base"], res["this"])]
    q = statistics.quantiles(d, n=4)
    print(f"{what}, base - this per pair: median {statistics.median(d):.1f} us [{q[0]:.1f}, {q[2]:.1f}]")


def _order(i: int) -> tuple[str, str]:
    return ("base", "this") if i % 2 else ("this", "base")


def codec(wires: dict[str, ModuleType], pairs: int) -> dict[str, list[float]]:
    from engine.pipeline import limits

    big = np.ones(16 * 1024 * 1024, dtype=np.float32)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 768), dtype=np.float32)
    logits = rng.standard_normal((1, 8192), dtype=np.float32)
    cap = limits.DIRECT_MAX_MESSAGE_BYTES
    res: dict[str, list[float]] = {"this": [], "base": []}
    for i in range(pairs):
        for name in _order(i):
            w = wires[name]
            big.sum()  # the caches as the hop finds them
            t0 = time.perf_counter()
            w.decode_one(w.encode(w.Forward(1, 2, (w.SeqSpan(1, 5, 1),), x, True)), cap)
            w.decode_one(w.encode(w.Result(1, 2, 100, logits, True)), cap)
            res[name].append((time.perf_counter() - t0) * 1e6)
    return res


def _contexts(tmp: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "hop")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    Path(tmp, "c.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    Path(tmp, "k.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.minimum_version = ssl.TLSVersion.TLSv1_3
    server.load_cert_chain(Path(tmp, "c.pem"), Path(tmp, "k.pem"))
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.minimum_version = ssl.TLSVersion.TLSv1_3
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    return server, client


def _channel_pair(mod: ModuleType, server: ssl.SSLContext, client: ssl.SSLContext) -> tuple[Any, Any]:
    listener = socket.create_server(("127.0.0.1", 0))
    got: dict[str, Any] = {}

    def accept() -> None:
        s, _ = listener.accept()
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        got["s"] = mod.DirectChannel(server.wrap_socket(s, server_side=True), "client", 2, False)

    t = threading.Thread(target=accept)
    t.start()
    c = socket.create_connection(listener.getsockname())
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ch = mod.DirectChannel(client.wrap_socket(c), "server", 2, True)
    t.join()
    listener.close()
    return ch, got["s"]


def channel(lanes: dict[str, ModuleType], pairs: int) -> dict[str, list[float]]:
    request, reply = os.urandom(3122), os.urandom(32804)  # a FORWARD of 768 floats, a RESULT of 8192

    def echo(ch: Any) -> None:
        while ch.recv() is not None:
            ch.send(reply)

    with tempfile.TemporaryDirectory() as tmp:
        server, client = _contexts(tmp)
        ends = {}
        for name, mod in lanes.items():
            ch, far = _channel_pair(mod, server, client)
            threading.Thread(target=echo, args=(far,), daemon=True).start()
            ends[name] = (ch, far)
        res: dict[str, list[float]] = {"this": [], "base": []}
        for i in range(pairs):
            for name in _order(i):
                ch = ends[name][0]
                time.sleep(0.002)  # both ends asleep in recv, as between two decode steps
                t0 = time.perf_counter()
                ch.send(request)
                back = ch.recv()
                res[name].append((time.perf_counter() - t0) * 1e6)
                if back is None or len(back) != len(reply):
                    raise RuntimeError(f"{name}: a wrong echo")
        for ch, far in ends.values():
            ch.close("done")
            far.close("done")
    return res


class _Stats:
    def __init__(self) -> None:
        self.got: list[tuple[float, float]] = []
        self.direct_calls = 0

    def add_ping(self, rtt_s: float) -> None:
        pass

    def add(self, latency_s: float, compute_s: float) -> None:
        self.got.append((latency_s, compute_s))


class _Link:
    def __init__(self) -> None:
        self.stats = _Stats()


class _Host:
    """A stage's stand-in for ``direct.serve``: owns run 1 for "client"; a step sweeps 64 MB and answers logits."""

    def __init__(self, w: ModuleType) -> None:
        self.w = w
        self.owners = {1: "client"}
        self.big = np.ones(16 * 1024 * 1024, dtype=np.float32)
        self.logits = np.random.default_rng(1).standard_normal((1, 8192), dtype=np.float32)

        self.compute_cpu_s = 0.0
        self.steps = 0

    def direct_step(self, f: Any, peer_id: str) -> Any:
        t0, c0 = time.perf_counter(), time.thread_time()
        self.big.sum()
        out = self.logits.copy()
        self.compute_cpu_s += time.thread_time() - c0
        self.steps += 1
        return self.w.Result(f.run, f.step, int((time.perf_counter() - t0) * 1e6), out, True)


def _serve_child(mods: dict[str, ModuleType], listener: socket.socket, server: ssl.SSLContext, report: Any) -> None:
    s, _ = listener.accept()
    listener.close()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ch = mods["lane"].DirectChannel(server.wrap_socket(s, server_side=True), "client", 2, False)
    host = _Host(mods["wire"])
    while True:  # the warm-up steps, then the measured ones: CPU time outside the "compute" per step
        c0, n0, k0 = time.thread_time(), host.steps, host.compute_cpu_s
        mods["direct"].serve([host], "client", ch)
        report.send(((time.thread_time() - c0 - (host.compute_cpu_s - k0)) / max(1, host.steps - n0), host.steps - n0))
        return


def hop(versions: dict[str, dict[str, ModuleType]], pairs: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    import multiprocessing

    big = np.ones(16 * 1024 * 1024, dtype=np.float32)
    x = np.random.default_rng(0).standard_normal((1, 768), dtype=np.float32)
    res: dict[str, list[float]] = {"this": [], "base": []}
    pings: dict[str, list[float]] = {"this": [], "base": []}
    cpu: dict[str, list[float]] = {"this": [], "base": []}
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        server, client = _contexts(tmp)
        ends: dict[str, tuple[Any, Any, Any, Any]] = {}
        reports: dict[str, Any] = {}
        for name, mods in versions.items():
            listener = socket.create_server(("127.0.0.1", 0))
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_serve_child, args=(mods, listener, server, there), daemon=True)
            proc.start()
            c = socket.create_connection(listener.getsockname())
            listener.close()
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ch = mods["lane"].DirectChannel(client.wrap_socket(c), "server", 2, True)
            ends[name] = (mods["direct"].DirectHop(ch), _Link(), proc, mods["wire"])
            reports[name] = here
        try:
            for name, (h, link, _, w) in ends.items():  # warm up (first calls, the child's first sweeps)
                # the first exchanges after the forks take copy-on-write faults on both sides (0.05-0.55 s here,
                # more under load: longer than a hop's timeout, which closes the channel): pings with a long
                # timeout first, then steps, each checked
                for _ in range(3):
                    h.channel.send(w.encode(w.Keepalive(1)), 10.0)
                    if h.channel.recv(10.0) is None:
                        raise RuntimeError(f"{name}: the stage ended during the warm-up")
                for _ in range(5):
                    h._pinged = time.perf_counter()
                    if h.call(link, w.Forward(1, 0, (w.SeqSpan(1, 5, 1),), x, True), True) is None:
                        raise RuntimeError(f"{name}: a warm-up step failed ({h.channel.close_reason})")
            for i in range(pairs):
                for name in _order(i):
                    h, link, _, w = ends[name]
                    big.sum()
                    t0 = time.perf_counter()
                    h.channel.send(w.encode(w.Keepalive(7)))
                    echo = w.decode_one(h.channel.recv(), 1 << 22)
                    pings[name].append((time.perf_counter() - t0) * 1e6)
                    if echo != w.Keepalive(7):
                        raise RuntimeError(f"{name}: a wrong ping echo")
                for name in _order(i):
                    h, link, _, w = ends[name]
                    big.sum()
                    h._pinged = time.perf_counter()  # no ping ahead of this step
                    c0 = time.thread_time()
                    r = h.call(link, w.Forward(1, 0, (w.SeqSpan(1, 5, 1),), x, True), True)
                    cpu[name].append((time.thread_time() - c0) * 1e6)
                    if r is None or r.x.shape != (1, 8192):
                        raise RuntimeError(f"{name}: the hop failed")
                    lat, comp = link.stats.got[-1]
                    res[name].append((lat - comp) * 1e6)
        finally:
            for name, (h, _, proc, _) in ends.items():
                h.close("done")
                if reports[name].poll(5):
                    per, n = reports[name].recv()
                    print(f"stage side, {name}: CPU per message outside the compute {per * 1e6:.1f} us "
                          f"(mean over {n} steps and the pings between them)")
                proc.join(5)
    _report("serving side CPU time per hop (thread_time around DirectHop.call)", cpu)
    return res, pings


def _versions(base: Path) -> dict[str, dict[str, ModuleType]]:
    from engine.pipeline import direct, wire
    from transport import lane_direct

    bw = _load(base / "engine/pipeline/wire.py", "base_wire")
    bd = _load(base / "engine/pipeline/direct.py", "base_direct")
    bd.wire = bw  # type: ignore[attr-defined]
    bl = _load(base / "transport/lane_direct.py", "base_lane_direct")
    return {"this": {"wire": wire, "direct": direct, "lane": lane_direct},
            "base": {"wire": bw, "direct": bd, "lane": bl}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", type=Path, required=True, help="the other checkout's root (required)")
    ap.add_argument("--pairs", type=int, default=400, help="measured pairs of each kind (default 400)")
    ap.add_argument("--only", choices=("codec", "channel", "hop"), default=None,
                    help="run one measurement (default: all three)")
    args = ap.parse_args()
    base = args.base.resolve()
    versions = _versions(base)
    with open("/proc/loadavg") as f:
        print(f"load {f.read().split()[0]}; this: {ROOT}, base: {base}")
    if args.only in (None, "codec"):
        _report("codec, cold caches", codec({k: v["wire"] for k, v in versions.items()}, args.pairs))
    if args.only in (None, "channel"):
        _report("direct channel round trip, 3 KiB -> 32 KiB over TLS",
                channel({k: v["lane"] for k, v in versions.items()}, args.pairs))
    if args.only in (None, "hop"):
        res, pings = hop(versions, args.pairs)
        _report("hop overhead (latency - compute), cold caches", res)
        _report("ping (KEEPALIVE echo), cold caches", pings)
        for name in ("this", "base"):
            print(f"hop / ping, {name}: {statistics.median(res[name]) / statistics.median(pings[name]):.2f}")
    with open("/proc/loadavg") as f:
        print(f"load at the end {f.read().split()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
