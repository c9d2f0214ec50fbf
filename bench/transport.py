"""Loopback benchmark: meshd's QUIC transport against plain asyncio TCP and TLS over TCP.

    python bench/transport.py [--mb 64] [--bulk-runs 3] [--bulk-seconds 2] [--rtt-n 2000] [--quick]
                              [--mode both|processes|inprocess]

Each server runs in its own process (tests/transport_peer.py for QUIC, this file with ``--serve`` for
TCP/TLS); the client runs here. Measures bulk MB/s on one stream (send N MiB in 64 KiB writes to a sink
that answers the byte count at the end; --bulk-runs runs, the median and the range shown; a QUIC or lane
run also stops after --bulk-seconds, so the 1350-byte QUIC variants do not take minutes) and the median /
p99 round trip of a 4 KiB request with a
4 KiB response on one connection. For QUIC the round trip is measured twice: ``Peer.request`` (a new
stream per request, the RPC helper) and ping-pong on one long-lived stream. The data lane
(``transport.lane``: TLS 1.3 over TCP between two members, carrying EXPERT/PIPELINE streams) is measured
the same way on one EXPERT stream (its "rtt" is that stream's ping-pong; a lane has no per-request stream
setup). With two processes, a direct channel beside the lane (``transport.lane_direct``: a blocking TLS socket
written and read by a plain thread, as the expert decode path uses it) is measured too: round trips on one
channel, bulk in 64 KiB messages on a fresh channel per run. Prints a table and the ratios to TCP. The QUIC
variants try packet sizes (16 KiB exists only on loopback; 1350 B is what a LAN with MTU 1500 gets) and uvloop
when it is installed (``pip install .[bench]``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

CHUNK = 64 * 1024
MSG = 4096
BULK = {"runs": 3, "seconds": 2.0}  # set from --bulk-runs / --bulk-seconds


# -- TCP / TLS ---------------------------------------------------------------------------------------


def _tls_files(tmp: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


async def _serve_tcp(tls_dir: str | None, ready: asyncio.Future[int] | None = None) -> None:
    ctx = None
    if tls_dir:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(Path(tls_dir) / "cert.pem", Path(tls_dir) / "key.pem")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readexactly(5)
                kind, length = head[0], struct.unpack(">I", head[1:])[0]
                if kind == 0:  # echo
                    body = await reader.readexactly(length)
                    writer.write(head + body)
                    await writer.drain()
                else:  # bulk: length bytes follow, answer the count
                    left = length
                    while left:
                        data = await reader.read(min(left, 1 << 20))
                        if not data:
                            return
                        left -= len(data)
                    writer.write(struct.pack(">BI", 1, length))
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except asyncio.CancelledError:
            pass  # the in-process run stops its server with this connection still open: a normal end
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    if ready is not None:
        ready.set_result(port)
    else:
        print(json.dumps({"port": port}), flush=True)
    async with server:
        await server.serve_forever()


async def _tcp_client(port: int, tls: bool, mb: int, n: int) -> dict[str, float]:
    ctx = None
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
    payload = os.urandom(MSG)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        writer.write(struct.pack(">BI", 0, MSG) + payload)
        await writer.drain()
        await reader.readexactly(5 + MSG)
        times.append(time.perf_counter() - t0)
    total = mb * 1024 * 1024
    blob = os.urandom(CHUNK)
    rates = []
    for _ in range(BULK["runs"]):
        t0 = time.perf_counter()
        writer.write(struct.pack(">BI", 1, total))
        for _ in range(total // CHUNK):
            writer.write(blob)
            await writer.drain()
        await reader.readexactly(5)
        rates.append(total / (time.perf_counter() - t0) / 1e6)
    writer.close()
    return _summary(times, rates)


async def _bulk(open_sink: object, mb: int) -> list[float]:
    """MB/s of ``BULK["runs"]`` bulk sends, each on a new sink stream (``await open_sink()``), of ``mb`` MiB
    in CHUNK writes or for ``BULK["seconds"]``, whichever ends first (the slow QUIC variants would take
    minutes for 64 MiB); the sink's byte count must match what was sent."""
    blob = os.urandom(CHUNK)
    rates = []
    for _ in range(BULK["runs"]):
        sink = await open_sink()  # type: ignore[operator]
        sent = 0
        t0 = time.perf_counter()
        stop = t0 + BULK["seconds"]
        while sent < mb * 1024 * 1024 and (sent == 0 or time.perf_counter() < stop):
            await sink.send(blob)
            sent += CHUNK
        await sink.end()
        count = await sink.recv()
        rates.append(sent / (time.perf_counter() - t0) / 1e6)
        assert count == str(sent).encode(), (count, sent)
    return rates


def _summary(times: list[float], rates: list[float]) -> dict[str, float]:
    """Round trips: median and p99; bulk: the median of the runs and their range."""
    times.sort()
    return {
        "mb_s": statistics.median(rates),
        "mb_s_min": min(rates),
        "mb_s_max": max(rates),
        "rtt_median_us": statistics.median(times) * 1e6,
        "rtt_p99_us": times[int(len(times) * 0.99) - 1] * 1e6,
    }


def _start(argv: list[str]) -> tuple[subprocess.Popen[str], dict]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


# -- QUIC ----------------------------------------------------------------------------------------------


async def _quic_client(addr: tuple[str, int], node_id: str, creds: object, ident: object, tconfig: object,
                       mb: int, n: int) -> dict[str, float]:
    from transport.quic import MeshTransport, StreamType

    mesh = MeshTransport(ident, creds, tconfig)  # type: ignore[arg-type]
    try:
        peer = await mesh.connect(addr, expected_node_id=node_id)
        payload = b"echo:" + os.urandom(MSG - 5)
        for _ in range(50):  # warm up
            await peer.request(StreamType.RPC, payload, 5.0)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await peer.request(StreamType.RPC, payload, 5.0)
            times.append(time.perf_counter() - t0)
        stream = await peer.open_stream(StreamType.HTTP_TUNNEL)
        stimes = []
        for _ in range(n):
            t0 = time.perf_counter()
            await stream.send(payload)
            await stream.recv()
            stimes.append(time.perf_counter() - t0)
        await stream.end()
        out = _summary(times, await _bulk(lambda: peer.open_stream(StreamType.GOSSIP), mb))
        stimes.sort()
        out["stream_rtt_median_us"] = statistics.median(stimes) * 1e6
        out["stream_rtt_p99_us"] = stimes[int(len(stimes) * 0.99) - 1] * 1e6
        return out
    finally:
        await mesh.close()


async def _direct_client(lanes: object, peer: object, mb: int, n: int) -> dict[str, float]:
    """A direct channel (``transport.lane_direct``) beside the lane: 4 KiB round trips written and read on a
    plain thread (blocking TLS socket, no event loop), and bulk in CHUNK messages to a sink channel."""
    from transport.lane_direct import SERVICE_PIPELINE

    echo = await lanes.dial_direct(peer, SERVICE_PIPELINE)  # type: ignore[attr-defined]
    dial = lanes.dial_direct  # type: ignore[attr-defined]
    sinks = [await dial(peer, SERVICE_PIPELINE) for _ in range(BULK["runs"])]

    def run() -> dict[str, float]:
        payload, blob = os.urandom(MSG), os.urandom(CHUNK)
        echo.send(b"echo")
        for _ in range(50):  # warm up
            echo.send(payload)
            echo.recv()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            echo.send(payload)
            echo.recv()
            times.append(time.perf_counter() - t0)
        rates = []
        for sink in sinks:
            sink.send(b"sink")
            sent, t0 = 0, time.perf_counter()
            stop = t0 + BULK["seconds"]
            while sent < mb * 1024 * 1024 and (sent == 0 or time.perf_counter() < stop):
                sink.send(blob)
                sent += CHUNK
            sink.send(b"")
            count = struct.unpack(">Q", sink.recv(30.0) or b"")[0]
            rates.append(sent / (time.perf_counter() - t0) / 1e6)
            assert count == sent, (count, sent)
        return _summary(times, rates)

    try:
        return await asyncio.to_thread(run)
    finally:
        for ch in (echo, *sinks):
            ch.close()


async def _lane_client(addr: tuple[str, int], node_id: str, creds: object, ident: object, mb: int,
                       n: int, direct: bool = False) -> dict[str, float]:
    from transport.lane import LaneManager
    from transport.quic import MeshTransport, StreamType

    mesh = MeshTransport(ident, creds)  # type: ignore[arg-type]
    lanes = LaneManager(mesh)
    await mesh.listen("127.0.0.1", 0)
    await lanes.listen("127.0.0.1", 0)
    try:
        peer = await mesh.connect(addr, expected_node_id=node_id)
        deadline = time.monotonic() + 10
        while peer.path != "lane":
            if time.monotonic() > deadline:
                raise RuntimeError("the lane did not come up")
            await asyncio.sleep(0.01)
        payload = os.urandom(MSG)
        stream = await peer.open_stream(StreamType.EXPERT)
        assert stream.path == "lane"
        await stream.send(b"echo")
        for _ in range(50):  # warm up
            await stream.send(payload)
            await stream.recv()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await stream.send(payload)
            await stream.recv()
            times.append(time.perf_counter() - t0)
        await stream.end()
        async def open_sink() -> object:
            sink = await peer.open_stream(StreamType.EXPERT)
            await sink.send(b"sink")
            return sink

        out = _summary(times, await _bulk(open_sink, mb))
        out["stream_rtt_median_us"] = out["rtt_median_us"]
        if direct:
            out["direct"] = await _direct_client(lanes, peer, mb, n)
        return out
    finally:
        await lanes.close()
        await mesh.close()


def run_lane(tmp: Path, mb: int, n: int, inprocess: bool) -> dict[str, float]:
    from transport_peer import PeerProcess, peer_config

    server_ident, server_creds, client_ident, client_creds = _quic_pair({})
    if inprocess:

        async def both() -> dict[str, float]:
            import transport_peer
            from transport.lane import LaneManager
            from transport.quic import MeshTransport

            server = MeshTransport(server_ident, server_creds)  # type: ignore[arg-type]
            lanes = LaneManager(server)
            transport_peer.serve_bench(server, lane=True)
            addr = await server.listen("127.0.0.1", 0)
            await lanes.listen("127.0.0.1", 0)
            try:
                return await _lane_client(addr, server_ident.node_id, client_creds, client_ident, mb, n)  # type: ignore[attr-defined]
            finally:
                await lanes.close()
                await server.close()

        return asyncio.run(both())
    proc = PeerProcess(peer_config(server_ident, server_creds, lane="127.0.0.1:0"), tmp)  # type: ignore[arg-type]
    try:
        return asyncio.run(_lane_client(proc.addr, proc.node_id, client_creds, client_ident, mb, n,
                                        direct=True))
    finally:
        proc.stop()


def _quic_pair(overrides: dict) -> tuple[object, object, object, object]:
    from transport.credentials import create_mesh
    from transport.identity import NodeIdentity
    from transport_peer import member_of

    server_ident, client_ident = NodeIdentity.generate(), NodeIdentity.generate()
    creds = create_mesh(server_ident, "bench", int(time.time()), 1, 1)
    return server_ident, member_of(creds, server_ident), client_ident, member_of(creds, client_ident)


def _run(coro: object, use_uvloop: bool) -> dict[str, float]:
    if use_uvloop:
        import uvloop  # only when installed (the bench extra); see main()

        return uvloop.run(coro)  # type: ignore[arg-type]
    return asyncio.run(coro)  # type: ignore[arg-type]


def run_quic(tmp: Path, mb: int, n: int, overrides: dict, use_uvloop: bool, inprocess: bool) -> dict[str, float]:
    from transport_peer import PeerProcess, peer_config

    from transport.quic import MeshTransport, TransportConfig

    server_ident, server_creds, client_ident, client_creds = _quic_pair(overrides)
    tconfig = replace(TransportConfig(), **overrides)
    if inprocess:

        async def both() -> dict[str, float]:
            import transport_peer

            server = MeshTransport(server_ident, server_creds, tconfig)  # type: ignore[arg-type]
            transport_peer.serve_bench(server)
            addr = await server.listen("127.0.0.1", 0)
            try:
                return await _quic_client(addr, server_ident.node_id, client_creds, client_ident, tconfig, mb, n)  # type: ignore[attr-defined]
            finally:
                await server.close()

        return _run(both(), use_uvloop)
    proc = PeerProcess(peer_config(server_ident, server_creds, transport=overrides), tmp, use_uvloop)  # type: ignore[arg-type]
    try:
        return _run(
            _quic_client(proc.addr, proc.node_id, client_creds, client_ident, tconfig, mb, n), use_uvloop
        )
    finally:
        proc.stop()


def run_tcp(tmp: Path, tls: bool, mb: int, n: int, inprocess: bool) -> dict[str, float]:
    if inprocess:

        async def both() -> dict[str, float]:
            ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            server = asyncio.ensure_future(_serve_tcp(str(tmp) if tls else None, ready))
            try:
                return await _tcp_client(await ready, tls, mb, n)
            finally:
                server.cancel()

        return asyncio.run(both())
    argv = [sys.executable, __file__, "--serve", str(tmp) if tls else ""]
    proc, info = _start(argv)
    try:
        return asyncio.run(_tcp_client(info["port"], tls, mb, n))
    finally:
        proc.terminate()
        proc.wait()


VARIANTS: list[tuple[str, dict, bool]] = [
    ("quic 1350 B, stock pacing", {"loopback_datagram_size": 0, "coarse_pacing": False,
                                   "coalesce_transmit": False}, False),
    ("quic 1350 B", {"loopback_datagram_size": 0}, False),
    ("quic 16 KiB, no coalescing", {"coalesce_transmit": False}, False),
    ("quic 16 KiB (default)", {}, False),
    ("quic 16 KiB + uvloop", {}, True),
]


def table(title: str, rows: list[tuple[str, dict[str, float]]]) -> None:
    tcp = rows[0][1]
    print(f"\n{title}")
    print(f"{'transport':28} {'bulk MB/s':>9} {'(range)':>15} {'x TCP':>6} {'rtt med us':>10} {'p99 us':>8}"
          f" {'x TCP':>6} {'stream med':>10} {'x TCP':>6}")
    for name, r in rows:
        spread = f"({r['mb_s_min']:.0f}-{r['mb_s_max']:.0f})"
        line = (f"{name:28} {r['mb_s']:9.1f} {spread:>15} {r['mb_s'] / tcp['mb_s']:6.3f} {r['rtt_median_us']:10.0f}"
                f" {r['rtt_p99_us']:8.0f} {r['rtt_median_us'] / tcp['rtt_median_us']:6.2f}")
        if "stream_rtt_median_us" in r:
            line += f" {r['stream_rtt_median_us']:10.0f} {r['stream_rtt_median_us'] / tcp['rtt_median_us']:6.2f}"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64, help="MiB per bulk run (default 64)")
    ap.add_argument("--bulk-seconds", type=float, default=2.0,
                    help="a QUIC or lane bulk run stops after this many seconds if its MiB are not sent (default 2)")
    ap.add_argument("--bulk-runs", type=int, default=3, help="bulk runs per path; the median is shown (default 3)")
    ap.add_argument("--rtt-n", type=int, default=2000, help="4 KiB round trips per path (default 2000)")
    ap.add_argument("--quick", action="store_true", help="only the default QUIC variant")
    ap.add_argument("--mode", choices=["both", "processes", "inprocess"], default="both",
                    help="client and server in two processes, in one event loop, or both (default both)")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        asyncio.run(_serve_tcp(args.serve or None))
        return
    BULK.update(runs=max(1, args.bulk_runs), seconds=args.bulk_seconds)
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    variants = [v for v in VARIANTS if v[0] == "quic 16 KiB (default)"] if args.quick else VARIANTS
    try:
        import uvloop  # noqa: F401
    except ImportError:
        print("uvloop is not installed (pip install .[bench]): its variant is left out")
        variants = [v for v in variants if not v[2]]
    modes = [("processes", False), ("inprocess", True)]
    if args.mode != "both":
        modes = [m for m in modes if m[0] == args.mode]
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {args.mb} MiB bulk, "
          f"{args.rtt_n} round trips of 4 KiB")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        _tls_files(tmp)
        for mode, inproc in modes:
            rows: list[tuple[str, dict[str, float]]] = []
            rows.append(("tcp", run_tcp(tmp, False, args.mb, args.rtt_n, inproc)))
            rows.append(("tls-tcp", run_tcp(tmp, True, args.mb, args.rtt_n, inproc)))
            lane = run_lane(tmp, args.mb, args.rtt_n, inproc)
            direct = lane.pop("direct", None)
            rows.append(("lane (tls-tcp, meshd)", lane))
            if direct is not None:  # two processes only: the server end is tests/transport_peer.py's
                rows.append(("lane direct channel", direct))
            for name, overrides, uv in variants:
                rows.append((name, run_quic(tmp, args.mb, args.rtt_n, overrides, uv, inproc)))
            table(f"{mode} (client and server {'in one event loop' if inproc else 'in two processes'})", rows)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
