"""Real-QUIC harness for the expert tests and bench: worker processes and an in-process coordinator."""

from __future__ import annotations

import base64
import json
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conftest import meshd_env

from engine.experts.channel import LoopThread
from engine.experts.coordinator import CoordinatorConfig, RemoteExecutor
from meshd.experts_service import ExpertsService
from transport.credentials import MemberCert, MeshCredentials, create_mesh
from transport.identity import NodeIdentity

NODE_SCRIPT = Path(__file__).resolve().parent / "experts_node.py"


class MeshFixture:
    """A mesh created by the test: admin key, genesis, and member credentials on demand."""

    def __init__(self) -> None:
        self.first = NodeIdentity.generate()
        self.creds = create_mesh(self.first, "experts-test", int(time.time()), 1, 1)

    def member(self, ident: NodeIdentity) -> MeshCredentials:
        assert self.creds.admin is not None
        cert = MemberCert.issue(self.creds.admin, self.creds.genesis, ident.public_key, int(time.time()))
        return MeshCredentials(self.creds.genesis, cert)


@dataclass
class WorkerProc:
    proc: subprocess.Popen[bytes]
    node_id: str
    addr: tuple[str, int]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._close_pipe()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._close_pipe()

    def _close_pipe(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def spawn_worker(mesh: MeshFixture, tmp: Path, specs: list[str], netns: str | None = None, cpus: str | None = None,
                 **extra: Any) -> WorkerProc:
    """Start tests/experts_node.py (in network namespace ``netns`` if given; confined to the CPU list ``cpus``,
    e.g. ``"1"``, with taskset if given); returns once it listens. Raises RuntimeError with its error line."""
    ident = NodeIdentity.generate()
    creds = mesh.member(ident)
    cfg = {"key": ident.private_bytes().hex(), "genesis": base64.b64encode(creds.genesis.encoded).decode(),
           "cert": base64.b64encode(creds.cert.encoded).decode(), "specs": specs, **extra}
    path = tmp / f"node-{ident.node_id[:8]}.json"
    path.write_text(json.dumps(cfg))
    argv = [sys.executable, str(NODE_SCRIPT), str(path)]
    if cpus is not None:
        argv = ["taskset", "-c", cpus, *argv]
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=meshd_env())
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 30)
    line = proc.stdout.readline() if ready else b""
    if not line:
        proc.kill()
        raise RuntimeError("worker did not start")
    info = json.loads(line)
    if "error" in info:
        proc.wait(10)
        raise RuntimeError(info["error"])
    return WorkerProc(proc, info["node_id"], (info["addr"][0], int(info["addr"][1])))


@dataclass
class Coordinator:
    """A MeshTransport + ExpertsService on a background loop; the test thread is the engine thread."""

    mesh: MeshFixture
    config: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    lt: LoopThread = field(default_factory=LoopThread)
    lane: bool = False  # run a data lane (transport.lane) beside QUIC, as the daemon does
    host: str = "127.0.0.1"  # where its transport (and lane) listen

    def __post_init__(self) -> None:
        from transport.quic import MeshTransport, TransportConfig

        self.ident = NodeIdentity.generate()
        self.transport = MeshTransport(self.ident, self.mesh.member(self.ident), TransportConfig.loopback())
        self.service = ExpertsService(coordinator_config=self.config, probe_interval_s=3600)
        self.lt.run(self.transport.listen(self.host, 0))
        self.lanes = None
        if self.lane:
            from transport.lane import LaneManager

            async def lanes() -> LaneManager:
                m = LaneManager(self.transport)
                await m.listen(self.host, 0)
                return m

            self.lanes = self.lt.run(lanes())
        self.lt.run(self.service.start(self.transport))

    def connect(self, workers: list[WorkerProc]) -> None:
        for w in workers:
            self.lt.run(self.transport.connect(w.addr, w.node_id), timeout=15)

    def executor(self, path: Path, mode: str = "on", local_weights: Any = None) -> RemoteExecutor:
        return self.lt.run(self.service.coordinator(path, local_weights, mode), timeout=60)

    def wait_paths(self, workers: list[WorkerProc], path: str, timeout_s: float = 10.0) -> None:
        """Wait until every worker's peer uses ``path`` ("lane" or "quic") and its expert link does too."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            async def check() -> bool:
                for w in workers:
                    peer = self.transport.peer(w.node_id)
                    if peer is None or peer.path != path:
                        return False
                    for c in self.service._coordinated:
                        link = c.executor.links.get(w.node_id)
                        if link is None or getattr(link.channel, "path", None) != path:
                            return False
                return True

            if self.lt.run(check()):
                return
            time.sleep(0.02)
        raise AssertionError(f"workers not on the {path} path within {timeout_s}s")

    def probe(self) -> None:
        self.lt.run(self.service.probe_all(), timeout=30)

    def close(self) -> None:
        try:
            self.lt.run(self.service.stop(), timeout=10)
            if self.lanes is not None:
                self.lt.run(self.lanes.close(), timeout=10)
            self.lt.run(self.transport.close(), timeout=10)
        finally:
            self.lt.stop()
