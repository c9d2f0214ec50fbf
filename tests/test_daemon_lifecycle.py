"""Real `meshd serve`/`client` processes: readiness, run.json, sd_notify, status, clean stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
from conftest import meshd_cmd, meshd_env
from daemon_testlib import start_node

SPEC_STATUS_KEYS = {
    "node_id",
    "mesh_id",
    "mesh_name",
    "state",
    "version",
    "protocol",
    "quic",
    "api",
    "models",
    "peers",
}


def _log_events(text: str) -> list[dict]:
    events = []
    for line in text.splitlines():
        events.append(json.loads(line))  # --log-format json: every line is one JSON object
    return events


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_within_5s_and_removes_run_json(tmp_path: Path, sig: int) -> None:
    node = start_node(tmp_path / "a")
    try:
        run = node.run
        assert set(run) == {"node_id", "mesh_id", "quic", "api", "pid"}
        assert run["pid"] == node.proc.pid
        assert len(run["node_id"]) == 32 and len(run["mesh_id"]) == 32
        assert (tmp_path / "a" / "control.sock").exists()
        code, took = node.terminate(sig)
    finally:
        node.stop()
    assert code == 0, node.stderr()
    assert took < 5.0
    assert not (tmp_path / "a" / "run.json").exists()
    assert not (tmp_path / "a" / "control.sock").exists()
    names = [e["event"] for e in _log_events(node.stderr())]
    assert names.index("daemon_ready") < names.index("daemon_stopping") < names.index("daemon_stopped")


def test_run_json_node_id_matches_identity_and_survives_restart(tmp_path: Path) -> None:
    state = tmp_path / "a"
    node = start_node(state)
    first = dict(node.run)
    node.stop()
    ident = subprocess.run(
        meshd_cmd("identity", "--state-dir", str(state)),
        env=meshd_env(),
        check=False,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert ident.returncode == 0 and ident.stdout.strip() == first["node_id"]
    node = start_node(state)
    try:
        assert node.run["node_id"] == first["node_id"]
        assert node.run["mesh_id"] == first["mesh_id"]  # same mesh, not a new one
        assert "mesh_created" not in node.stderr()
    finally:
        node.stop()


def _recv_all(sock: socket.socket, until: str, timeout_s: float) -> list[str]:
    msgs: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            msgs.append(sock.recv(4096).decode())
        except TimeoutError:
            break
        if any(until in m.split("\n") for m in msgs):
            break
    return msgs


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_sd_notify_ready_watchdog_status_stopping(tmp_path: Path, abstract: bool) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"@meshd-test-{os.getpid()}-{time.monotonic_ns()}"
        sock.bind("\0" + name[1:])
    else:
        name = str(tmp_path / "notify.sock")
        sock.bind(name)
    try:
        env = meshd_env(NOTIFY_SOCKET=name, WATCHDOG_USEC="400000")
        node = start_node(tmp_path / "a", env=env, wait=False)
        try:
            msgs = _recv_all(sock, "READY=1", 20.0)
            assert any("READY=1" in m.split("\n") for m in msgs), msgs
            assert msgs[0] == "STATUS=starting"
            ready = next(m for m in msgs if "READY=1" in m.split("\n"))
            assert any(line.startswith("STATUS=running: mesh meshd") for line in ready.split("\n"))
            # half of WATCHDOG_USEC = 0.2 s; several pings within a second
            pings = [m for m in _recv_all(sock, "never", 1.0) if m == "WATCHDOG=1"]
            assert len(pings) >= 2
            node.wait_ready()
            code, took = node.terminate()
            msgs = _recv_all(sock, "STOPPING=1", 5.0)
            assert any("STOPPING=1" in m.split("\n") for m in msgs), msgs
        finally:
            node.stop()
        assert code == 0 and took < 5.0
    finally:
        sock.close()


def test_status_json_shape_and_control_socket_mode(tmp_path: Path) -> None:
    node = start_node(tmp_path / "a")
    try:
        mode = stat.S_IMODE(os.stat(tmp_path / "a" / "control.sock").st_mode)
        assert mode == 0o600
        st = node.status()
        assert SPEC_STATUS_KEYS <= set(st)
        assert st["node_id"] == node.run["node_id"] and st["mesh_id"] == node.run["mesh_id"]
        assert st["mesh_name"] == "meshd" and st["state"] == "running"
        assert isinstance(st["protocol"], int) and isinstance(st["version"], str)
        assert st["models"] == [] and st["peers"] == []
        assert st["quic"] == node.run["quic"] and st["api"] == node.run["api"]
        human = subprocess.run(
            meshd_cmd("status", "--state-dir", str(tmp_path / "a")),
            env=meshd_env(),
            check=False,
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert human.returncode == 0
        assert node.run["node_id"] in human.stdout and "peers     0" in human.stdout
    finally:
        node.stop()


def test_status_without_daemon_is_one_line_exit_1(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    out = subprocess.run(
        meshd_cmd("status", "--json", "--state-dir", str(tmp_path / "a")),
        env=meshd_env(),
        check=False,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 1
    assert out.stdout == ""
    assert len(out.stderr.splitlines()) == 1 and "no meshd daemon is running" in out.stderr


def test_second_daemon_on_same_state_dir_is_refused(tmp_path: Path) -> None:
    node = start_node(tmp_path / "a")
    try:
        out = subprocess.run(
            meshd_cmd(
                "serve",
                "--state-dir",
                str(tmp_path / "a"),
                "--no-mdns",
                "--listen",
                "127.0.0.1:0",
                "--api",
                "127.0.0.1:0",
            ),
            env=meshd_env(),
            check=False,
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert out.returncode == 1
        assert len(out.stderr.splitlines()) == 1 and "already running" in out.stderr
        assert node.proc.poll() is None and node.status()["node_id"] == node.run["node_id"]
    finally:
        node.stop()


def test_client_role_serves_nothing(tmp_path: Path) -> None:
    node = start_node(tmp_path / "c", command="client")
    try:
        st = node.status()
        assert st["role"] == "client" and st["models"] == []
    finally:
        node.stop()


def test_join_token_without_credentials_waits_to_join(tmp_path: Path) -> None:
    node = start_node(tmp_path / "j", "--join", "meshd1notarealtokenyet")
    try:
        assert node.run["mesh_id"] is None
        st = node.status()
        assert st["state"] == "joining" and st["mesh_id"] is None
        assert not (tmp_path / "j" / "genesis.json").exists()  # no stray mesh founded
        assert "meshd1notarealtokenyet" not in node.stderr()  # never logged
    finally:
        node.stop()


def test_missing_join_file_without_credentials_is_exit_2(tmp_path: Path) -> None:
    out = subprocess.run(
        meshd_cmd(
            "serve",
            "--state-dir",
            str(tmp_path / "j"),
            "--no-mdns",
            "--listen",
            "127.0.0.1:0",
            "--api",
            "127.0.0.1:0",
        ),
        env=meshd_env(MESHD_JOIN_FILE=str(tmp_path / "absent.token")),
        check=False,
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert out.returncode == 2
    assert len(out.stderr.splitlines()) == 1 and "absent.token" in out.stderr
    assert not (tmp_path / "j" / "genesis.json").exists()
