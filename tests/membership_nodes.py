"""Real meshd processes for membership end-to-end tests (loopback, --no-mdns unless in a namespace)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from conftest import meshd_cmd, meshd_env

from meshd.control import NoDaemon, call
from meshd.errors import RuntimeFailure


class Node:
    def __init__(self, root: Path, name: str, *extra: str, join_file: Path | None = None,
                 listen: str = "127.0.0.1:0", mdns: bool = False, netns: str | None = None) -> None:
        self.name = name
        self.dir = root / name
        self.log_path = root / f"{name}.log"
        self.extra = list(extra)
        self.join_file = join_file
        self.listen = listen
        self.mdns = mdns
        self.netns = netns
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.node_id: str | None = None

    def start(self, join_file: Path | None = None, **env: str) -> Node:
        args = ["client", "--state-dir", str(self.dir), "--listen", self.listen, "--api", "127.0.0.1:0",
                "--log-format", "json", *self.extra]
        if not self.mdns:
            args.append("--no-mdns")
        jf = join_file or self.join_file
        if jf is not None:
            args += ["--join-file", str(jf)]
        cmd = meshd_cmd(*args)
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        self.started_at = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=meshd_env(**env), stdout=log, stderr=log)
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> Node:
        deadline = time.monotonic() + timeout_s
        run = self.dir / "run.json"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited {self.proc.returncode}: {self.stderr_tail()}")
            try:
                info = json.loads(run.read_text())
                if info.get("mesh_id") and info.get("quic"):
                    self.node_id = info["node_id"]
                    return self
            except (OSError, ValueError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"{self.name} not ready: {self.stderr_tail()}")

    def stderr_tail(self) -> str:
        try:
            return self.log_path.read_text()[-2000:]
        except OSError:
            return ""

    def ctl(self, cmd: str, timeout_s: float = 10.0, **params: Any) -> dict[str, Any]:
        return call(self.dir / "control.sock", cmd, timeout_s=timeout_s, **params)

    def status(self) -> dict[str, Any] | None:
        try:
            return self.ctl("status", timeout_s=5.0)
        except (NoDaemon, RuntimeFailure, OSError):
            return None

    def peer_states(self) -> dict[str, str]:
        st = self.status()
        return {} if st is None else {p["node_id"]: p["state"] for p in st["peers"]}

    def invite(self, uses: int = 1, ttl: str = "1h") -> str:
        out = subprocess.run(meshd_cmd("invite", "--state-dir", str(self.dir), "--uses", str(uses), "--ttl", ttl),
                             env=meshd_env(), capture_output=True, timeout=30)
        assert out.returncode == 0, out.stderr.decode()
        return out.stdout.decode().strip()

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float = 15.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout_s)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=8)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def has_credentials(self) -> bool:
        return (self.dir / "genesis.json").exists() or (self.dir / "member-cert.json").exists()


def wait_for(cond: Any, timeout_s: float, step_s: float = 0.05) -> float | None:
    """Poll ``cond()`` until true; returns the seconds it took, or None on timeout."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(step_s)
    return None


def write_token(path: Path, token: str) -> Path:
    path.write_text(token + "\n")
    os.chmod(path, 0o600)
    return path
