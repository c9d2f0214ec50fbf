"""A minimal mesh node process for API tests and bench: real ``MeshTransport`` (QUIC on loopback) plus
``ApiService``, serving seeded stand-in models in process and/or ``openai:URL`` backends.

Until the daemon (``meshd serve``) is merged this is how the API is run across processes; it wires the
API exactly as the daemon service does (``ApiService``). Mesh membership comes from credentials the test
writes: one genesis, each node's own key and a certificate issued by the admin key (``make_mesh``).

    python tests/api_node.py --creds FILE [--standin a,b] [--model openai:URL] [--role client]
        [--connect HOST:PORT@NODE_ID]... [--keepalive S --idle-timeout S]      # prints "READY {json}"
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import structlog  # noqa: E402

from transport import PROTOCOL_MAX, PROTOCOL_MIN  # noqa: E402
from transport.credentials import Genesis, MemberCert, MeshCredentials  # noqa: E402
from transport.identity import NodeIdentity  # noqa: E402


def make_mesh(dirpath: Path, n: int) -> list[tuple[Path, str]]:
    """Write credentials for ``n`` members of one new mesh; returns (creds file, node id) per node."""
    admin = NodeIdentity.generate()
    now = int(time.time())
    genesis = Genesis.create(admin, "apitest", now, PROTOCOL_MIN, PROTOCOL_MAX)
    out = []
    for i in range(n):
        ident = NodeIdentity.generate()
        cert = MemberCert.issue(admin, genesis, ident.public_key, now)
        f = dirpath / f"node{i}.json"
        f.write_text(json.dumps({"identity": base64.b64encode(ident.private_bytes()).decode(),
                                 "genesis": base64.b64encode(genesis.encoded).decode(),
                                 "cert": base64.b64encode(cert.encoded).decode()}))
        f.chmod(0o600)
        out.append((f, ident.node_id))
    return out


def load_creds(path: str) -> tuple[NodeIdentity, MeshCredentials]:
    d = json.loads(Path(path).read_text())
    ident = NodeIdentity.from_private_bytes(base64.b64decode(d["identity"]))
    genesis = Genesis.decode(base64.b64decode(d["genesis"]))
    cert = MemberCert.decode(base64.b64decode(d["cert"]), genesis)
    return ident, MeshCredentials(genesis=genesis, cert=cert)


async def run(args: argparse.Namespace) -> None:
    from dataclasses import replace

    from api_standin import standin_backends
    from meshd.api.service import ApiService, openai_backend_from_spec
    from meshd.api.tunnel import TunnelConfig
    from transport.quic import MeshTransport, TransportConfig

    ident, creds = load_creds(args.creds)
    tcfg = TransportConfig()
    if args.keepalive is not None:
        tcfg = replace(tcfg, keepalive_interval_s=args.keepalive, idle_timeout_s=args.idle_timeout,
                       dead_peer_timeout_s=args.idle_timeout)
    transport = MeshTransport(ident, creds, tcfg)
    qhost, qport = await transport.listen("127.0.0.1", 0)
    backends: list[Any] = []
    if args.role != "client":
        if args.standin:
            backends += standin_backends(args.standin.split(","), args.max_active, args.token_delay)
        for spec in args.model or []:
            b = openai_backend_from_spec(spec)
            if b is not None:
                backends.append(b)
    tun = TunnelConfig()
    if args.heartbeat_timeout is not None:
        tun = replace(tun, heartbeat_timeout_s=args.heartbeat_timeout)
    if args.sse_keepalive is not None:
        tun = replace(tun, sse_keepalive_s=args.sse_keepalive)
    svc = ApiService(node_id=ident.node_id, host="127.0.0.1", port=0, role=args.role, backends=backends,
                     transport=transport, tunnel_config=tun, poll_interval_s=args.poll)
    await svc.start()
    assert svc.server is not None
    svc.server.config.extra_fields = frozenset({"standin"})  # the stand-in backend's per-request knobs
    for c in args.connect or []:
        addr, _, nid = c.partition("@")
        h, _, p = addr.rpartition(":")
        transport.keep_connected(nid, [(h, int(p))])
    assert svc.address is not None
    sys.stdout.write("READY " + json.dumps({"node_id": ident.node_id, "quic": qport, "api": svc.address[1],
                                            "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await svc.stop()
    await transport.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--creds", required=True)
    ap.add_argument("--standin", default="")
    ap.add_argument("--model", action="append")
    ap.add_argument("--role", default="serve")
    ap.add_argument("--connect", action="append")
    ap.add_argument("--max-active", type=int, default=64)
    ap.add_argument("--token-delay", type=float, default=0.0)
    ap.add_argument("--keepalive", type=float, default=None)
    ap.add_argument("--idle-timeout", type=float, default=None)
    ap.add_argument("--heartbeat-timeout", type=float, default=None)
    ap.add_argument("--sse-keepalive", type=float, default=None)
    ap.add_argument("--poll", type=float, default=0.3)
    ap.add_argument("--log-level", default="WARNING")
    a = ap.parse_args()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr),
                        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, a.log_level)))
    asyncio.run(run(a))
