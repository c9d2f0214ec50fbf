"""The daemon's QUIC wiring: a real `meshd serve` process, dialled by an in-test MeshTransport."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import meshd_cmd, meshd_env
from daemon_testlib import start_node

from meshd.state import StateDir
from transport.credentials import MemberCert, MeshCredentials, create_mesh
from transport.errors import HandshakeRefused
from transport.identity import NodeIdentity
from transport.quic import MeshTransport, TransportConfig


def _addr(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def test_quic_bound_address_in_run_json_and_status(tmp_path: Path) -> None:
    node = start_node(tmp_path / "a")
    try:
        assert re.fullmatch(r"127\.0\.0\.1:\d+", node.run["quic"])
        assert _addr(node.run["quic"])[1] != 0  # port 0 became the real ephemeral port
        st = node.status()
        assert st["quic"] == node.run["quic"]
        assert st["services"]["transport"]["connected_peers"] == 0
    finally:
        node.stop()


def test_quic_port_in_use_is_exit_1_one_line(tmp_path: Path) -> None:
    node = start_node(tmp_path / "a")
    try:
        out = subprocess.run(
            meshd_cmd(
                "serve",
                "--state-dir",
                str(tmp_path / "b"),
                "--no-mdns",
                "--listen",
                node.run["quic"],
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
        lines = out.stderr.splitlines()
        assert lines[-1].startswith("meshd: cannot listen on 127.0.0.1:") and "(UDP)" in lines[-1]
        assert not (tmp_path / "b" / "run.json").exists() and not (tmp_path / "b" / "control.sock").exists()
    finally:
        node.stop()


def test_member_is_admitted_stranger_refused_and_stop_closes_with_reason(tmp_path: Path) -> None:
    node = start_node(tmp_path / "a")
    try:
        state = StateDir(tmp_path / "a")
        daemon_id = state.load_identity()
        assert daemon_id is not None
        daemon_creds = state.load_credentials(daemon_id)
        assert daemon_creds is not None and daemon_creds.admin is not None
        # A second member: its certificate issued with the daemon's admin key (what an invite does).
        me = NodeIdentity.generate()
        cert = MemberCert.issue(daemon_creds.admin, daemon_creds.genesis, me.public_key, int(time.time()))
        member = MeshCredentials(genesis=daemon_creds.genesis, cert=cert)
        stranger = NodeIdentity.generate()
        stranger_creds = create_mesh(stranger, "other", int(time.time()), 1, 1)
        addr = _addr(node.run["quic"])

        async def main() -> str | None:
            cfg = TransportConfig.loopback()
            bad = MeshTransport(stranger, stranger_creds, cfg)
            try:
                with pytest.raises(HandshakeRefused):
                    await bad.connect(addr, expected_node_id=daemon_id.node_id)
            finally:
                await bad.close()
            good = MeshTransport(me, member, cfg)
            down = asyncio.Event()
            good.on_peer_down.append(lambda p: down.set())
            try:
                peer = await good.connect(addr, expected_node_id=daemon_id.node_id)
                assert peer.node_id == daemon_id.node_id
                conn = peer._conn  # the connection, to read how it was closed (cleared on close)
                assert node.status()["services"]["transport"]["connected_peers"] == 1
                code, took = node.terminate()
                assert code == 0 and took < 5.0
                await asyncio.wait_for(down.wait(), 5.0)
                return conn.close_reason if conn is not None else None
            finally:
                await good.close()

        reason = asyncio.run(main())
        assert reason == "node shutting down"  # closed by the daemon with a reason, not timed out
    finally:
        node.stop()
