"""Helpers for API tests: a background event loop, the stand-in server process, mesh node processes."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any


HERE = Path(__file__).resolve().parent


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
        self.state_dir = Path(info["state_dir"])
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

    def status(self) -> dict[str, Any]:
        """``meshd status --json`` of this node (its control socket)."""
        from meshd.control import call

        return call(self.state_dir / "control.sock", "status", timeout_s=10.0)

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
