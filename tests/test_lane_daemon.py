"""The data lane in real meshd daemons: on by default (status `lane`, peers' `path`), `--lane-listen off`,
and bad `--lane-listen` values."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Any

from conftest import meshd_cmd, meshd_env
from membership_nodes import Node, wait_for, write_token


def _path_of(node: Node, other: Node) -> Any:
    st = node.status() or {}
    return next((p.get("path") for p in st.get("peers", []) if p["node_id"] == other.node_id), None)


def test_members_use_a_lane_by_default_and_quic_with_a_node_that_has_none(tmp_path: Path) -> None:
    a = Node(tmp_path, "a").start().wait_ready()
    nodes = [a]
    try:
        tok = write_token(tmp_path / "tok", a.invite(uses=2))
        b = Node(tmp_path, "b", join_file=tok).start().wait_ready()
        nodes.append(b)
        c = Node(tmp_path, "c", "--lane-listen", "off", join_file=tok).start().wait_ready()
        nodes.append(c)
        assert wait_for(lambda: _path_of(a, b) == "lane" and _path_of(b, a) == "lane", 20), (
            a.status(), b.status())
        assert wait_for(lambda: _path_of(a, c) == "quic" and _path_of(c, a) == "quic", 20), (a.status(), c.status())
        sa, sc = a.status(), c.status()
        assert sa is not None and sc is not None
        # TCP on the QUIC port's number, unless another program of this shared machine holds that TCP port
        assert sa["lane"] is not None and sa["lane"].startswith("127.0.0.1:")
        assert sc["lane"] is None
        assert b.node_id in sa["services"]["lane"]["lanes"] and c.node_id not in sa["services"]["lane"]["lanes"]
    finally:
        for n in nodes:
            n.stop()


def test_lane_listen_values_are_checked(tmp_path: Path) -> None:
    out = subprocess.run(meshd_cmd("client", "--state-dir", str(tmp_path / "x"), "--no-mdns", "--listen",
                                   "127.0.0.1:0", "--api", "127.0.0.1:0", "--lane-listen", "nowhere"),
                         env=meshd_env(), capture_output=True, timeout=60, check=False)
    assert out.returncode == 2 and "lane-listen" in out.stderr.decode() and b"Traceback" not in out.stderr
    with socket.socket() as s:  # an explicit lane address that is taken: the start fails, naming it
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(meshd_cmd("client", "--state-dir", str(tmp_path / "y"), "--no-mdns", "--listen",
                                       "127.0.0.1:0", "--api", "127.0.0.1:0", "--lane-listen", f"127.0.0.1:{port}"),
                             env=meshd_env(), capture_output=True, timeout=60, check=False)
    err = out.stderr.decode()
    assert out.returncode == 1 and "--lane-listen" in err and "Traceback" not in err, err[-2000:]


def test_help_names_lane_listen_and_its_default() -> None:
    out = subprocess.run(meshd_cmd("serve", "--help"), env=meshd_env(), capture_output=True, timeout=60, check=False)
    text = " ".join(out.stdout.decode().split())
    assert "--lane-listen HOST:PORT|off" in text and "default: TCP on the --listen host and port" in text
    assert "--relay {on,off}" in text and "(default on)" in text
