"""mDNS discovery: TXT helpers, and three hosts in network namespaces on a bridge the test creates.

mDNS traffic only ever flows inside those namespaces; every other node in the suite runs --no-mdns.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from membership_nodes import Node, wait_for, write_token

from discovery.mdns import mesh_fingerprint, parse_txt, txt_for


def test_txt_reveals_only_id_version_and_a_fingerprint() -> None:
    mesh_id = "ab" * 16
    txt = txt_for("cd" * 16, mesh_id, 1)
    assert set(txt) == {"v", "p", "id", "mf"}
    assert mesh_id not in "".join(txt.values())
    assert txt["mf"] == mesh_fingerprint(mesh_id) != mesh_fingerprint("ef" * 16)
    assert parse_txt({k.encode(): v.encode() for k, v in txt.items()}) == ("cd" * 16, txt["mf"])


@pytest.mark.parametrize("props", [
    {}, {b"v": b"2", b"id": b"cd" * 16, b"mf": b"0" * 16}, {b"v": b"1", b"id": b"xyz", b"mf": b"0" * 16},
    {b"v": b"1", b"id": b"cd" * 16, b"mf": b"short"}, {b"v": b"1", b"id": b"\xff", b"mf": b"0" * 16},
])
def test_foreign_or_malformed_txt_is_ignored(props: dict[bytes, bytes]) -> None:
    assert parse_txt(props) is None


def _can_netns() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and subprocess.run(
        ["ip", "netns", "list"], capture_output=True).returncode == 0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def lan() -> Iterator[list[str]]:
    """Three namespaces h1..h3 (10.231.x.1..3/24) on a bridge that lives in a fourth namespace."""
    if not _can_netns():
        pytest.skip("needs root and ip netns")
    tag = f"{os.getpid() % 100000}"
    br = f"mshbr{tag}"
    hosts = [f"msh{tag}h{i}" for i in (1, 2, 3)]
    subnet = f"10.231.{os.getpid() % 250}"
    try:
        _ip("netns", "add", br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, h in enumerate(hosts, 1):
            _ip("netns", "add", h)
            _ip("-n", h, "link", "set", "lo", "up")
            _ip("-n", h, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", br)
            _ip("-n", br, "link", "set", f"p{i}", "master", "br0")
            _ip("-n", br, "link", "set", f"p{i}", "up")
            _ip("-n", h, "addr", "add", f"{subnet}.{i}/24", "dev", "eth0")
            _ip("-n", h, "link", "set", "eth0", "up")
            _ip("-n", h, "route", "add", "224.0.0.0/4", "dev", "eth0")
        yield hosts
    finally:
        for h in [*hosts, br]:
            subprocess.run(["ip", "netns", "del", h], capture_output=True)


@pytest.mark.netns
@pytest.mark.timeout(240)
def test_three_hosts_token_join_mdns_reconnect_and_foreign_mesh(lan: list[str], tmp_path: Path) -> None:
    h1, h2, h3 = lan
    nodes: list[Node] = []
    try:
        a = Node(tmp_path, "a", listen="0.0.0.0:0", mdns=True, netns=h1).start().wait_ready()
        nodes.append(a)
        tok = a.invite()
        assert "10.231." in str(__import__("discovery.invite", fromlist=["x"]).InviteToken.decode(tok).addrs)
        b = Node(tmp_path, "b", listen="0.0.0.0:0", mdns=True, netns=h2)
        b.start(join_file=write_token(tmp_path / "b.tok", tok)).wait_ready()
        nodes.append(b)
        c = Node(tmp_path, "c", listen="0.0.0.0:0", mdns=True, netns=h3).start().wait_ready()  # another mesh
        nodes.append(c)
        assert wait_for(lambda: a.peer_states().get(b.node_id) == "alive"
                        and b.peer_states().get(a.node_id) == "alive", 15.0) is not None, "cross-host join failed"

        # b moves to a new port and forgets its remembered peers: only mDNS can bring it back
        b.signal(signal.SIGTERM)
        assert b.wait_exit() == 0
        (b.dir / "peers.json").unlink()
        b.listen = "0.0.0.0:0"
        b.start(join_file=None)
        b.wait_ready()
        took = wait_for(lambda: a.peer_states().get(b.node_id) == "alive"
                        and b.peer_states().get(a.node_id) == "alive", 30.0)
        assert took is not None, "no reconnection through mDNS"
        print(f"\nmDNS reconnection after a port change: {took:.2f} s")

        # the other mesh's node was seen on the LAN the whole time, and never became a peer
        time.sleep(2.0)
        for n in (a, b):
            assert c.node_id not in n.peer_states()
        assert a.node_id not in c.peer_states() and b.node_id not in c.peer_states()
    finally:
        for n in nodes:
            n.stop()
