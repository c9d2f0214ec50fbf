"""`meshd doctor` against real meshd processes on loopback (--no-mdns): what it finds on a healthy pair,
a state dir others can read, a stopped daemon, and a refused join (with its reason and fix)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from conftest import meshd_cmd, meshd_env
from membership_nodes import Node, wait_for, write_token

from meshd.mesh.doctor import Check, check_clock, check_daemon, check_ports, check_versions


def _doctor(node: Node) -> tuple[int, dict[str, Check], str]:
    out = subprocess.run(meshd_cmd("doctor", "--json", "--state-dir", str(node.dir)), env=meshd_env(),
                         capture_output=True, text=True, timeout=60)
    checks = {c["name"]: Check(**c) for c in json.loads(out.stdout)}
    text = subprocess.run(meshd_cmd("doctor", "--state-dir", str(node.dir)), env=meshd_env(),
                          capture_output=True, text=True, timeout=60).stdout
    return out.returncode, checks, text


def test_doctor_on_real_nodes(tmp_path: Path) -> None:
    a = Node(tmp_path, "a").start().wait_ready()
    nodes = [a]
    try:
        b = Node(tmp_path, "b", join_file=write_token(tmp_path / "tok", a.invite())).start().wait_ready()
        nodes.append(b)
        assert wait_for(lambda: b.peer_states().get(a.node_id) == "alive", 15.0) is not None
        code, checks, text = _doctor(b)
        assert code == 0, text
        assert checks["daemon"].level == "ok" and checks["state dir"].level == "ok"
        # "running, client node ID, mesh NAME (ID)": the phase once (it said "running, running" before)
        assert checks["daemon"].detail.startswith(f"running, client node {b.node_id}, mesh "), checks["daemon"].detail
        assert checks["identity.key"].level == "ok"
        assert checks["peers"].level == "ok" and "1 alive" in checks["peers"].detail
        assert checks["mdns"].level == "warn" and "--no-mdns" in checks["mdns"].detail
        assert checks["udp port"].level == "warn" and "only this machine" in checks["udp port"].detail
        assert checks["tcp api port"].level == "ok"
        assert checks["versions"].level == "ok"
        assert checks["clock"].level == "ok", checks["clock"]  # a's API answered with its Date header
        assert "fix: " in text and "WARN" in text
        # a state dir others can read: a failure with the command that fixes it, exit 1
        os.chmod(b.dir, 0o755)
        code, checks, text = _doctor(b)
        assert code == 1 and checks["state dir"].level == "fail" and f"chmod 700 {b.dir}" in checks["state dir"].fix
        os.chmod(b.dir, 0o700)
        # stopped daemon
        b.stop()
        code, checks, _ = _doctor(b)
        assert code == 1 and checks["daemon"].level == "fail" and "meshd serve" in checks["daemon"].fix
        # a refused join is remembered with its reason
        used = a.invite(ttl="1s")
        time.sleep(1.2)
        c = Node(tmp_path, "c", join_file=write_token(tmp_path / "c.tok", used)).start()
        nodes.append(c)
        assert c.wait_exit(30) == 1
        code, checks, text = _doctor(c)
        assert checks["last join"].level == "fail" and "expired" in checks["last join"].detail, text
        assert "meshd invite" in checks["last join"].fix
    finally:
        for n in nodes:
            n.stop()


def test_doctor_checks_from_tables() -> None:
    st = {"quic": "10.0.0.2:9336", "api": "10.0.0.2:9337", "version": "0.1.0", "protocol": 1,
          "peers": [{"node_id": "a" * 32, "state": "alive", "protocol": 3, "version": "0.2.0"}],
          "services": {"membership": {"links": {"inbound": 0}}}}
    udp = check_ports(st, True)[0]
    assert udp.level == "warn" and "9336/udp" in udp.fix
    st["services"]["membership"]["links"]["inbound"] = 2  # type: ignore[index]
    assert check_ports(st, True)[0].level == "ok"
    assert check_ports(st, False)[1].level == "fail"
    v = check_versions(st, (1, 2))
    assert v[0].level == "fail" and "aaaaaaaaaaaa (3)" in v[0].detail
    assert v[1].level == "warn" and "0.2.0" in v[1].detail
    assert check_clock({"b" * 32: 5.2})[0].level == "warn"
    assert check_clock({"b" * 32: -0.4})[0].level == "ok"
    assert check_clock({})[0].level == "warn"


def test_no_daemon_is_said_once(tmp_path: Path) -> None:
    """Without a daemon, doctor says so once: "no running daemon: no control socket in DIR" (before: "no
    running daemon (no meshd daemon is running (no control socket in DIR))")."""
    state = tmp_path / "s"
    state.mkdir(mode=0o700)
    out = subprocess.run(meshd_cmd("doctor", "--state-dir", str(state)), env=meshd_env(), capture_output=True,
                         check=False, text=True, timeout=60)
    assert out.returncode == 1
    line = next(x for x in out.stdout.splitlines() if " daemon " in x)
    assert line.split(None, 2)[2] == f"no running daemon: no control socket in {state}", out.stdout
    [c] = check_daemon(None, None)
    assert c.detail == "no running daemon: its control socket does not answer"
