"""Helpers for tests that run real meshd nodes: start one, wait for run.json, stop it with SIGTERM.

Usage::

    node = start_node(tmp_path / "a", "--api", "127.0.0.1:0")
    try:
        ...  # node.run (run.json contents), node.status() (meshd status --json)
    finally:
        node.stop()

Nodes listen on 127.0.0.1 port 0 and run with --no-mdns unless the caller passes its own --listen.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from conftest import meshd_cmd, meshd_env

START_TIMEOUT_S = 20.0


class Node:
    def __init__(self, proc: subprocess.Popen[bytes], state_dir: Path, stderr_path: Path) -> None:
        self.proc = proc
        self.state_dir = state_dir
        self.stderr_path = stderr_path
        self.run: dict[str, Any] = {}

    @property
    def run_path(self) -> Path:
        return self.state_dir / "run.json"

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"meshd exited with {self.proc.returncode}: {self.stderr()[-2000:]}")
            try:
                self.run = json.loads(self.run_path.read_text())
                return self.run
            except (OSError, ValueError):
                time.sleep(0.02)
        raise AssertionError(f"meshd not ready after {timeout_s} s: {self.stderr()[-2000:]}")

    def status(self) -> dict[str, Any]:
        out = subprocess.run(
            meshd_cmd("status", "--json", "--state-dir", str(self.state_dir)),
            env=meshd_env(),
            capture_output=True,
            timeout=20,
            check=True,
        )
        result: dict[str, Any] = json.loads(out.stdout)
        return result

    def terminate(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> tuple[int, float]:
        """Send ``sig`` and wait; returns (exit code, seconds it took)."""
        start = time.monotonic()
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout_s)
        return code, time.monotonic() - start

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_node(
    state_dir: Path, *args: str, command: str = "serve", env: dict[str, str] | None = None, wait: bool = True
) -> Node:
    """Start ``meshd <command> --state-dir state_dir --no-mdns [--listen 127.0.0.1:0] *args``."""
    state_dir.mkdir(parents=True, exist_ok=True)
    argv = [command, "--state-dir", str(state_dir), "--no-mdns", "--log-format", "json"]
    if "--listen" not in args:
        argv += ["--listen", "127.0.0.1:0"]
    if "--api" not in args:
        argv += ["--api", "127.0.0.1:0"]
    stderr_path = state_dir.parent / f"{state_dir.name}.stderr"
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            meshd_cmd(*argv, *args),
            env=env if env is not None else meshd_env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    node = Node(proc, state_dir, stderr_path)
    if wait:
        try:
            node.wait_ready()
        except BaseException:
            node.stop()
            raise
    return node
