"""A bare expert-worker node process for the expert tests and bench/experts.py.

Usage: ``python tests/experts_node.py CONFIG.json``. CONFIG: ``key`` (hex private key), ``genesis`` and
``cert`` (base64), ``specs`` (``--experts`` specs), optional ``capacity``, and test hooks:
``perturb`` (add this relative amount to the first output of the first reply: the negative control),
``hang_after`` (after answering this many requests, the next one never finishes: a hung worker), and
``trace`` (a file: record ``tests/experts_trace.py``'s timestamps and write them there as JSON at exit),
``listen`` (host, default 127.0.0.1) and ``lane`` (default true: run a data lane on TCP with the QUIC
port's number, as the daemon does; false: QUIC only).
Runs a real ``MeshTransport`` and the real ``ExpertsService``. Prints one JSON line
``{"node_id", "addr", "pid"}`` when listening (or ``{"error"}`` and exit 2 if the shards are refused),
then serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import structlog  # noqa: E402

from meshd.experts_service import ExpertsService, ExpertsStartError  # noqa: E402
from transport.credentials import Genesis, MemberCert, MeshCredentials  # noqa: E402
from transport.errors import TransportError  # noqa: E402
from transport.identity import NodeIdentity  # noqa: E402
from transport.lane import LaneManager  # noqa: E402
from transport.quic import MeshTransport, TransportConfig  # noqa: E402


def make_hook(config: dict) -> object:
    perturb = config.get("perturb")
    hang_after = config.get("hang_after")
    count = [0]
    lock = threading.Lock()

    def hook(layer: int, out: np.ndarray) -> None:
        with lock:
            count[0] += 1
            n = count[0]
        if perturb is not None and n == 1:
            out[0, 0] += np.float32(perturb) * max(np.float32(1.0), abs(out[0, 0]))
        if hang_after is not None and n > hang_after:
            threading.Event().wait(3600)

    return hook if (perturb is not None or hang_after is not None) else None


async def main(path: str) -> int:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    config = json.loads(Path(path).read_text())
    recorder = None
    if config.get("trace"):
        import experts_trace

        recorder = experts_trace.Recorder()
        experts_trace.install(recorder)
    identity = NodeIdentity.from_private_bytes(bytes.fromhex(config["key"]))
    genesis = Genesis.decode(base64.b64decode(config["genesis"]))
    creds = MeshCredentials(genesis, MemberCert.decode(base64.b64decode(config["cert"]), genesis))
    mesh = MeshTransport(identity, creds, TransportConfig.loopback())
    addr = await mesh.listen(config.get("listen", "127.0.0.1"), 0)
    lanes = LaneManager(mesh)
    if config.get("lane", True):
        try:
            await lanes.listen(addr[0], addr[1])
        except TransportError:
            await lanes.listen(addr[0], 0)
    svc = ExpertsService(config["specs"], capacity=float(config.get("capacity", 1.0)),
                         reply_hook=make_hook(config))  # type: ignore[arg-type]
    try:
        await svc.start(mesh)
    except ExpertsStartError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        await mesh.close()
        return 2
    print(json.dumps({"node_id": identity.node_id, "addr": list(addr), "pid": os.getpid()}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await svc.stop()
    await lanes.close()
    await mesh.close()
    if recorder is not None:
        Path(config["trace"]).write_text(json.dumps(list(recorder.events)))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(sys.argv[1])))
