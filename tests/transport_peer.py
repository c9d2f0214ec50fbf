"""A transport peer process for the QUIC tests (and bench/transport.py).

Usage: ``python tests/transport_peer.py CONFIG.json``. CONFIG holds the node key (hex), the genesis and
member certificate (base64, optional), ``listen`` ("host:port"), ``transport`` (TransportConfig field
overrides), ``join`` (accept joins) and ``keep`` ([[node_id, host, port], ...] to keep connected).
Prints one JSON line ``{"node_id", "addr": [host, port]}`` on stdout when listening, then serves until
SIGTERM/SIGINT (exit 0).

``lane`` ("host:port") also runs a data lane there (transport.lane); ``relay`` (true) runs a relay manager
(transport.relay) that relays for others. EXPERT streams (which use the lane
when it is up) start with ``echo`` (then every frame is echoed) or ``sink`` (then bytes are counted and
the count is the answer at the stream's end), for bench/transport.py.

RPC (StreamType.RPC) commands, by payload prefix: ``echo:`` (reply = payload), ``sleep:S`` (reply after
S seconds of silence), ``stats`` (JSON of stats and peers), ``call:`` (request ``echo:back`` from the
caller and return its reply), ``fail`` (RpcError 7), ``big`` (a reply over the frame limit), ``crash`` (handler bug), ``hang`` (never answers;
counts its cancellation in stats ``hang_cancelled``). HTTP_TUNNEL streams are echoed frame by frame;
GOSSIP streams are a sink that answers the byte count at their end (for bulk benchmarks).
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import structlog  # noqa: E402

from transport.credentials import Genesis, MemberCert, MeshCredentials  # noqa: E402
from transport.errors import JoinRefused, RpcError  # noqa: E402
from transport.identity import NodeIdentity  # noqa: E402
from transport.quic import MeshTransport, Peer, Stream, StreamType, TransportConfig  # noqa: E402


def load(config: dict) -> tuple[NodeIdentity, MeshCredentials | None]:
    identity = NodeIdentity.from_private_bytes(bytes.fromhex(config["key"]))
    creds = None
    if config.get("genesis"):
        genesis = Genesis.decode(base64.b64decode(config["genesis"]))
        cert = MemberCert.decode(base64.b64decode(config["cert"]), genesis)
        creds = MeshCredentials(genesis, cert)
    return identity, creds


def direct_bench(peer: Any, ch: Any) -> None:
    """A direct channel (transport.lane_direct) for bench/transport.py: its first message says ``echo``
    (every message back) or ``sink`` (messages counted until an empty one, then the byte count, u64)."""
    import struct

    if ch.recv() == b"sink":
        total = 0
        while m := ch.recv():
            total += len(m)
        ch.send(struct.pack(">Q", total))
        return
    while (m := ch.recv()) is not None:
        ch.send(m)


def serve_bench(mesh: MeshTransport, lane: bool = False) -> None:
    """HTTP_TUNNEL streams echo frame by frame; GOSSIP streams sink and answer the byte count;
    ``echo:`` RPCs (if no RPC handler is set yet) echo; with ``lane``, EXPERT streams as in the module doc."""

    async def tunnel(peer: Peer, stream: Stream) -> None:
        while (chunk := await stream.recv()) is not None:
            await stream.send(chunk)

    async def sink(peer: Peer, stream: Stream) -> None:
        total = 0
        while (chunk := await stream.recv()) is not None:
            total += len(chunk)
        await stream.send(str(total).encode(), end=True)

    async def echo(peer: Peer, request: bytes) -> bytes:
        return request

    async def lane_bench(peer: Peer, stream: Stream) -> None:
        mode = await stream.recv()
        if mode == b"sink":
            await sink(peer, stream)
        elif mode == b"echo":
            await tunnel(peer, stream)

    mesh.on_stream(StreamType.HTTP_TUNNEL, tunnel)
    mesh.on_stream(StreamType.GOSSIP, sink)
    if lane:
        mesh.on_stream(StreamType.EXPERT, lane_bench)
    if StreamType.RPC not in mesh._rpc_handlers:
        mesh.on_rpc(StreamType.RPC, echo)


async def main(path: str) -> int:
    config = json.loads(Path(path).read_text())
    identity, creds = load(config)
    tconfig = replace(TransportConfig(), **config.get("transport", {}))
    mesh = MeshTransport(identity, creds, tconfig)

    async def rpc(peer: Peer, request: bytes) -> bytes:
        if request.startswith(b"echo:"):
            return request
        if request.startswith(b"sleep:"):
            await asyncio.sleep(float(request[6:]))
            return b"slept"
        if request == b"stats":
            return json.dumps(
                {"stats": mesh.stats, "peers": [p.node_id for p in mesh.peers()],
                 "paths": {p.node_id: p.path for p in mesh.peers()}}
            ).encode()
        if request == b"call":
            return await peer.request(StreamType.RPC, b"echo:back", 5.0)
        if request == b"big":
            return b"x" * (5 * 1024 * 1024)  # above the 4 MiB RPC frame limit
        if request == b"fail":
            raise RpcError(7, "nope")
        if request == b"crash":
            raise ValueError("handler bug")
        if request == b"hang":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                mesh._count("hang_cancelled")
                raise
        return b"unknown"

    async def join(pub: bytes, request: bytes) -> bytes:
        if request == b"bad":
            raise JoinRefused("invite expired")
        return b"joined:" + request

    mesh.on_rpc(StreamType.RPC, rpc)
    serve_bench(mesh, lane=bool(config.get("lane")))
    if config.get("join"):
        mesh.set_join_handler(join)
    host, port = config.get("listen", "127.0.0.1:0").rsplit(":", 1)
    addr = await mesh.listen(host, int(port))
    lanes = relay = None
    if config.get("lane") or config.get("relay"):
        from transport.lane import LaneManager

        lanes = LaneManager(mesh)
        if config.get("lane"):
            from transport.lane_direct import SERVICE_PIPELINE

            lanes.direct_handlers[SERVICE_PIPELINE] = direct_bench  # bench/transport.py's direct channel rows
            lhost, lport = config["lane"].rsplit(":", 1)
            await lanes.listen(lhost, int(lport))
    if config.get("relay"):
        from transport.relay import RelayManager

        relay = RelayManager(mesh)
    for node_id, khost, kport in config.get("keep", []):
        mesh.keep_connected(node_id, [(khost, int(kport))])
    print(json.dumps({"node_id": identity.node_id, "addr": list(addr)}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if relay is not None:
        await relay.close()
    if lanes is not None:
        await lanes.close()
    await mesh.close()
    return 0


# -- helpers for the tests (imported as ``transport_peer``) ----------------------------------------


def member_of(creds: MeshCredentials, identity: NodeIdentity, issued_at: int = 1_700_000_000) -> MeshCredentials:
    """Credentials for ``identity`` in the mesh whose admin key ``creds`` holds."""
    assert creds.admin is not None
    return MeshCredentials(creds.genesis, MemberCert.issue(creds.admin, creds.genesis, identity.public_key, issued_at))


def peer_config(
    identity: NodeIdentity,
    creds: MeshCredentials | None,
    listen: str = "127.0.0.1:0",
    **extra: object,
) -> dict:
    config: dict = {"key": identity.private_bytes().hex(), "listen": listen}
    if creds is not None:
        config["genesis"] = base64.b64encode(creds.genesis.encoded).decode()
        config["cert"] = base64.b64encode(creds.cert.encoded).decode()
    config.update(extra)
    return config


class PeerProcess:
    """A running ``transport_peer.py``; ``addr`` and ``node_id`` once started."""

    def __init__(self, config: dict, workdir: Path, use_uvloop: bool = False) -> None:
        import subprocess

        self.path = workdir / f"peer-{id(self)}.json"
        self.path.write_text(json.dumps(config))
        argv = [sys.executable, str(Path(__file__).resolve()), str(self.path)]
        if use_uvloop:
            argv.append("uvloop")
        self.err_path = workdir / f"peer-{id(self)}.err"
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(5)
            raise RuntimeError(f"peer process failed to start: {self.err_path.read_text()[-2000:]}")
        info = json.loads(line)
        self.node_id: str = info["node_id"]
        self.addr: tuple[str, int] = (info["addr"][0], int(info["addr"][1]))

    def stop(self, kill: bool = False, timeout_s: float = 5.0) -> int:
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except Exception:
            self.proc.kill()
            return self.proc.wait()


if __name__ == "__main__":
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(30),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    if len(sys.argv) > 2 and sys.argv[2] == "uvloop":
        import uvloop

        uvloop.install()
    sys.exit(asyncio.run(main(sys.argv[1])))
