"""Loopback benchmark: meshd's QUIC transport against plain asyncio TCP and TLS over TCP.

    python bench/transport.py [--mb 64] [--rtt-n 2000] [--variants]

Each server runs in its own process (tests/transport_peer.py for QUIC, this file with ``--serve`` for
TCP/TLS); the client runs here. Measures bulk MB/s on one stream (send N MiB in 64 KiB writes to a sink
that answers the byte count at the end) and the median / p99 round trip of a 4 KiB request with a
4 KiB response on one connection. For QUIC the round trip is measured twice: ``Peer.request`` (a new
stream per request, the RPC helper) and ping-pong on one long-lived stream. Prints a table and the
ratios to TCP. ``--variants`` also tries QUIC packet sizes and uvloop.
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


async def _serve_tcp(tls_dir: str | None) -> None:
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
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=ctx)
    print(json.dumps({"port": server.sockets[0].getsockname()[1]}), flush=True)
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
    t0 = time.perf_counter()
    writer.write(struct.pack(">BI", 1, total))
    for _ in range(total // CHUNK):
        writer.write(blob)
        await writer.drain()
    await reader.readexactly(5)
    bulk_s = time.perf_counter() - t0
    writer.close()
    return _summary(times, total, bulk_s)


def _summary(times: list[float], total: int, bulk_s: float) -> dict[str, float]:
    times.sort()
    return {
        "mb_s": total / bulk_s / 1e6,
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
        total = mb * 1024 * 1024
        blob = os.urandom(CHUNK)
        sink = await peer.open_stream(StreamType.GOSSIP)
        t0 = time.perf_counter()
        for _ in range(total // CHUNK):
            await sink.send(blob)
        await sink.end()
        count = await sink.recv()
        bulk_s = time.perf_counter() - t0
        assert count == str(total).encode(), count
        out = _summary(times, total, bulk_s)
        stimes.sort()
        out["stream_rtt_median_us"] = statistics.median(stimes) * 1e6
        out["stream_rtt_p99_us"] = stimes[int(len(stimes) * 0.99) - 1] * 1e6
        return out
    finally:
        await mesh.close()


def run_quic(tmp: Path, mb: int, n: int, overrides: dict, use_uvloop: bool) -> dict[str, float]:
    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    from transport_peer import PeerProcess, member_of, peer_config

    from transport.credentials import create_mesh
    from transport.identity import NodeIdentity
    from transport.quic import TransportConfig

    server_ident, client_ident = NodeIdentity.generate(), NodeIdentity.generate()
    creds = create_mesh(server_ident, "bench", int(time.time()), 1, 1)
    proc = PeerProcess(
        peer_config(server_ident, member_of(creds, server_ident), transport=overrides), tmp, use_uvloop
    )
    try:
        tconfig = replace(TransportConfig(), **overrides)
        coro = _quic_client(proc.addr, proc.node_id, member_of(creds, client_ident), client_ident, tconfig, mb, n)
        if use_uvloop:
            import uvloop

            return uvloop.run(coro)
        return asyncio.run(coro)
    finally:
        proc.stop()


def run_tcp(tmp: Path, tls: bool, mb: int, n: int) -> dict[str, float]:
    argv = [sys.executable, __file__, "--serve", str(tmp) if tls else ""]
    proc, info = _start(argv)
    try:
        return asyncio.run(_tcp_client(info["port"], tls, mb, n))
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=64)
    ap.add_argument("--rtt-n", type=int, default=2000)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        asyncio.run(_serve_tcp(args.serve or None))
        return
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        _tls_files(tmp)
        rows: list[tuple[str, dict[str, float]]] = []
        rows.append(("tcp", run_tcp(tmp, False, args.mb, args.rtt_n)))
        rows.append(("tls-tcp", run_tcp(tmp, True, args.mb, args.rtt_n)))
        variants: list[tuple[str, dict, bool]] = [("quic default (1350 B)", {}, False)]
        variants.append(("quic loopback preset", {"max_datagram_size": 16384}, False))
        if args.variants:
            variants += [
                ("quic 1350 B + uvloop", {}, True),
                ("quic 16 KiB + uvloop", {"max_datagram_size": 16384}, True),
                ("quic 64000 B", {"max_datagram_size": 64000}, False),
            ]
        for name, overrides, uv in variants:
            rows.append((name, run_quic(tmp, args.mb, args.rtt_n, overrides, uv)))
    tcp = rows[0][1]
    print(f"{'transport':26} {'bulk MB/s':>10} {'rtt med us':>11} {'rtt p99 us':>11} {'x TCP rtt':>9}"
          f" {'stream med':>11} {'x TCP':>6}")
    for name, r in rows:
        line = (f"{name:26} {r['mb_s']:10.1f} {r['rtt_median_us']:11.0f} {r['rtt_p99_us']:11.0f}"
                f" {r['rtt_median_us'] / tcp['rtt_median_us']:9.2f}")
        if "stream_rtt_median_us" in r:
            line += f" {r['stream_rtt_median_us']:11.0f} {r['stream_rtt_median_us'] / tcp['rtt_median_us']:6.2f}"
        print(line)
    print(f"bulk ratio quic/tcp: {rows[2][1]['mb_s'] / tcp['mb_s']:.2f} (default), "
          f"{rows[3][1]['mb_s'] / tcp['mb_s']:.2f} (loopback preset)")


if __name__ == "__main__":
    main()
