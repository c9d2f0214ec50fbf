"""A mesh node process for API tests and bench: the real ``Daemon`` with its membership and API services
(QUIC on loopback, ``--no-mdns``), serving seeded stand-in models in process and/or ``openai:URL``
backends. Mesh credentials come from a file the test writes: one genesis, each node's own key and a
certificate issued by the admin key (``make_mesh``), so no join is needed; ``--connect`` dials a seed
once and membership gossip finds everyone else.

    python tests/api_node.py --creds FILE [--standin a,b] [--model openai:URL] [--role client]
        [--connect HOST:PORT@NODE_ID]... [--keepalive S --idle-timeout S] [--max-links N --link-idle S]
        [--api-key KEY]... [--probe-interval S] [--gossip-interval S]
        # prints "READY {json}"; the state dir is state-NODEID next to FILE, emptied at start
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
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
    import shutil
    from dataclasses import replace

    from api_standin import standin_backends
    from meshd.api.service import ApiService, openai_backend_from_spec
    from meshd.api.tunnel import TunnelConfig
    from meshd.config import DaemonConfig, HostPort
    from meshd.daemon import Daemon
    from meshd.membership.service import MembershipService
    from meshd.state import StateDir
    from transport.quic import MeshTransport, TransportConfig

    ident, creds = load_creds(args.creds)
    # every test node shares 127.0.0.1, which the per-source handshake cap would treat as one stranger
    tcfg = replace(TransportConfig.loopback(), max_pending_handshakes_per_source=TransportConfig().max_pending_handshakes)
    if args.keepalive is not None:
        tcfg = replace(tcfg, keepalive_interval_s=args.keepalive, idle_timeout_s=args.idle_timeout,
                       dead_peer_timeout_s=args.idle_timeout)
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
    state_dir = Path(args.creds).parent / f"state-{ident.node_id[:12]}"
    if state_dir.exists():
        shutil.rmtree(state_dir)  # a restarted node starts fresh (as the test processes always did)
    config = DaemonConfig(role="client" if args.role == "client" else "serve", state_dir=state_dir,
                          listen=HostPort("127.0.0.1", 0), api=HostPort("127.0.0.1", 0), mdns=False)
    from meshd.membership.config import MembershipConfig

    # probes every 1 s by default (the loopback preset's 0.5 s, with 0.25 s to answer, declares nodes of a
    # starved 2-core test machine dead now and then); tests of failure detection pass a shorter one
    preset = replace(MembershipConfig.local(), probe_interval_s=args.probe_interval,
                     probe_timeout_s=args.probe_interval / 2)
    if args.gossip_interval is not None:
        preset = replace(preset, gossip_interval_s=args.gossip_interval,
                         anti_entropy_min_gap_s=args.gossip_interval)
    membership = MembershipService(config, preset=preset, max_links=args.max_links, link_idle_s=args.link_idle)
    api = ApiService(node_id=ident.node_id, host="127.0.0.1", port=0, role=args.role, backends=backends,
                     transport=None, tunnel_config=tun, api_keys=[k.encode() for k in args.api_key or []])

    class _Daemon(Daemon):
        async def _start_transport(self) -> None:  # the daemon's, with this node's transport settings
            transport = MeshTransport(self.identity, self.credentials, tcfg, admission=self.admit)
            host, port = await transport.listen("127.0.0.1", 0)
            self.transport = transport
            self.quic_address = HostPort(host, port)

    state = StateDir(state_dir)
    state.ensure()
    daemon = _Daemon(config, state, ident, creds, services=[membership, api])
    runner = asyncio.ensure_future(daemon.run())
    while daemon.phase != "running" or api.address is None:
        if runner.done():
            runner.result()
            raise SystemExit("daemon stopped while starting")
        await asyncio.sleep(0.01)
    assert daemon.transport is not None and daemon.quic_address is not None
    assert api.server is not None
    api.server.config.extra_fields = frozenset({"standin"})  # the stand-in backend's per-request knobs
    if args.stage_offer:  # FP@FIRST-LAST: gossip a --stage offer as a stage node does (nothing is held)
        from meshd.membership.records import StageOffer

        fp, _, rng = args.stage_offer.partition("@")
        first, _, last = rng.partition("-")
        membership.set_local_stages([StageOffer(fp, 1048576, (int(first), int(last)))])
    for c in args.connect or []:  # a seed: membership learns everyone else from it
        addr, _, nid = c.partition("@")
        h, _, p = addr.rpartition(":")
        asyncio.ensure_future(_seed(daemon.transport, (h, int(p)), nid))
    sys.stdout.write("READY " + json.dumps({"node_id": ident.node_id, "quic": daemon.quic_address.port,
                                            "api": api.address[1], "pid": os.getpid(),
                                            "state_dir": str(state_dir)}) + "\n")
    sys.stdout.flush()
    await runner


async def _seed(transport: Any, addr: tuple[str, int], node_id: str) -> None:
    delay = 0.1
    while True:  # until the seed answered once (it may still be starting, or the machine is busy)
        try:
            await transport.connect(addr, expected_node_id=node_id)
            return
        except Exception:  # noqa: BLE001
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--creds", required=True)
    ap.add_argument("--standin", default="")
    ap.add_argument("--stage-offer", default="")
    ap.add_argument("--model", action="append")
    ap.add_argument("--role", default="serve")
    ap.add_argument("--connect", action="append")
    ap.add_argument("--max-active", type=int, default=64)
    ap.add_argument("--token-delay", type=float, default=0.0)
    ap.add_argument("--keepalive", type=float, default=None)
    ap.add_argument("--idle-timeout", type=float, default=None)
    ap.add_argument("--heartbeat-timeout", type=float, default=None)
    ap.add_argument("--sse-keepalive", type=float, default=None)
    ap.add_argument("--max-links", type=int, default=None)
    ap.add_argument("--link-idle", type=float, default=2.0)
    ap.add_argument("--api-key", action="append")
    ap.add_argument("--probe-interval", type=float, default=1.0)
    ap.add_argument("--gossip-interval", type=float, default=None)
    ap.add_argument("--log-level", default="WARNING")
    a = ap.parse_args()
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr),
                        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, a.log_level)))
    asyncio.run(run(a))
