"""Helpers for API tests: a background event loop, the stand-in server process, in-memory mesh links.

``MemoryLink`` is an in-process implementation of the transport's Stream/Peer interface (bounded queues,
so ``send`` awaits when the peer does not read: real backpressure; ``reset`` makes the peer's ``recv``
raise). It lets the tunnel and the router run end to end before ``transport.quic`` is merged.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from meshd.api.backends import Backend
from meshd.api.directory import TunnelDirectory
from meshd.api.server import ApiConfig, ApiServer
from meshd.api.tunnel import TunnelClient, TunnelConfig, TunnelServer

HERE = Path(__file__).resolve().parent
HTTP_TUNNEL = 3


class LoopThread:
    """An asyncio loop in a daemon thread; ``run(coro)`` waits for the result from sync test code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class StandInProcess:
    """``tests/api_standin.py`` as a real server process on loopback."""

    def __init__(self, models: str = "standin", max_active: int = 64, token_delay: float = 0.0) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "api_standin.py"), "--models", models, "--max-active", str(max_active),
             "--token-delay", str(token_delay)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        line = ""
        for _ in range(50):
            line = self.proc.stdout.readline()
            if not line or line.startswith("PORT "):
                break
        if not line.startswith("PORT "):
            self.proc.kill()
            raise RuntimeError("stand-in server did not start")
        self.port = int(line.split()[1])
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self.proc.poll() is None:
            self.proc.kill()


class _Closed(Exception):
    pass


class StreamReset(Exception):
    pass


class MemoryStream:
    def __init__(self, limit: int = 8) -> None:
        self.inbox: asyncio.Queue[Any] = asyncio.Queue(limit)
        self.other: MemoryStream | None = None
        self.reset_code: int | None = None

    async def send(self, payload: bytes, end: bool = False) -> None:
        assert self.other is not None
        if self.reset_code is not None:
            raise StreamReset(self.reset_code)
        await self.other.inbox.put(bytes(payload))
        if end:
            await self.other.inbox.put(None)

    async def recv(self) -> bytes | None:
        item = await self.inbox.get()
        if isinstance(item, StreamReset):
            raise item
        return item

    def reset(self, code: int) -> None:
        self.reset_code = code
        assert self.other is not None
        other = self.other
        other.reset_code = code
        # Deliver the reset past a full queue (QUIC RESET_STREAM is not flow-controlled).
        while other.inbox.full():
            other.inbox.get_nowait()
        other.inbox.put_nowait(StreamReset(code))


class MemoryPeer:
    """The far side of a link as seen from one node: ``open_stream`` runs the far node's handler."""

    def __init__(self, node_id: str, handler: Any) -> None:
        self.node_id = node_id
        self.rtt_ms = 0.1
        self.handler = handler
        self.alive = True
        self.tasks: set[asyncio.Task[Any]] = set()

    async def open_stream(self, stream_type: Any) -> MemoryStream:
        if not self.alive:
            raise ConnectionError("peer is down")
        a, b = MemoryStream(), MemoryStream()
        a.other, b.other = b, a
        t = asyncio.create_task(self.handler(self, b))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        return a

    def kill(self) -> None:
        """The far node dies: its handlers stop mid-way, its streams go silent."""
        self.alive = False
        for t in list(self.tasks):
            t.cancel()


class MemNode:
    """An ApiServer plus tunnel server, linked in memory to other MemNodes."""

    def __init__(self, node_id: str, backends: list[Backend], role: str = "serve",
                 tunnel_config: TunnelConfig | None = None, keys: list[bytes] | None = None) -> None:
        self.node_id = node_id
        self.links: dict[str, MemoryPeer] = {}
        cfg = tunnel_config or TunnelConfig()
        self.tunnel_client = TunnelClient(HTTP_TUNNEL, cfg)
        self.directory = TunnelDirectory(lambda: [p for p in self.links.values() if p.alive],
                                         self.tunnel_client, interval_s=0.2, timeout_s=2.0)
        self.server = ApiServer(ApiConfig(node_id, role=role, api_keys=keys or []), backends,
                                mesh=self.directory, tunnel=self.tunnel_client)
        self.tunnel_client.count = self.server.metrics.count_tunnel
        self.tunnel_server = TunnelServer(lambda m, p, b: self.server.dispatch(m, p, b, local_only=True), cfg,
                                          self.server.metrics.count_tunnel)
        self.port = 0

    def link(self, other: MemNode) -> None:
        self.links[other.node_id] = MemoryPeer(other.node_id, other.tunnel_server.handle)
        other.links[self.node_id] = MemoryPeer(self.node_id, self.tunnel_server.handle)

    async def start(self) -> None:
        _, self.port = await self.server.start("127.0.0.1", 0)
        await self.directory.start()

    async def stop(self) -> None:
        await self.directory.stop()
        await self.server.stop()

    def kill(self, peers: list[MemNode]) -> None:
        for p in peers:
            link = p.links.get(self.node_id)
            if link is not None:
                link.kill()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


class NodeProcess:
    """``tests/api_node.py`` as a real process (QUIC + API on loopback)."""

    def __init__(self, creds: Path, *args: str) -> None:
        import json as _json

        self.proc = subprocess.Popen([sys.executable, str(HERE / "api_node.py"), "--creds", str(creds), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.proc.kill()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"node did not start: {err[-2000:]}")
        info = _json.loads(line[6:])
        self.node_id: str = info["node_id"]
        self.quic: int = info["quic"]
        self.api: int = info["api"]
        self.url = f"http://127.0.0.1:{self.api}/v1"

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.quic}@{self.node_id}"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def wait_models(url: str, want: set[str], timeout: float = 10.0, headers: dict[str, str] | None = None) -> set[str]:
    """Poll ``url/models`` until it lists exactly ``want``; returns the last listing."""
    import json as _json
    import time as _time
    import urllib.request

    deadline = _time.monotonic() + timeout
    got: set[str] = set()
    while _time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            req = urllib.request.Request(url + "/models", headers=headers or {})
            data = _json.loads(urllib.request.urlopen(req, timeout=2).read())
            got = {m["id"] for m in data["data"]}
            if got == want:
                return got
        _time.sleep(0.1)
    return got
