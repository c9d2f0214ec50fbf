"""Relay through a member with real daemons in network namespaces the test creates.

A (10.201.1.1) and C (10.201.2.3) share no network; B has a leg in each (10.201.1.2, 10.201.2.2) and
forwards no IP. A serves `tiny` with `--remote-experts on`; C serves it as `c-tiny` and holds its experts.
Through B: A's API serves C's model (x-meshd-node is C), A's own generation with every expert on C gives
the same text as C's local generation, status says `relay` on both ends, B counts what it forwarded (the
relayed bytes being ciphertext is asserted in tests/test_transport_relay.py, where the relay can be
tapped). Then a direct link appears between A and C: A's direct retry finds it and the traffic moves
(B forwards nothing more).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from membership_nodes import Node, wait_for, write_token

NS = {"a": "lane-ra", "b": "lane-rb", "c": "lane-rc"}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _can_netns() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and subprocess.run(
        ["ip", "netns", "list"], capture_output=True, check=False).returncode == 0


@pytest.fixture
def nets() -> Iterator[None]:
    if not _can_netns():
        pytest.skip("needs root and ip netns")
    for ns in NS.values():
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    try:
        for ns in NS.values():
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for (x, y, net, hx, hy) in (("a", "b", "10.201.1", 1, 2), ("c", "b", "10.201.2", 3, 2)):
            dx, dy = f"lane-r{x}{y}", f"lane-r{y}{x}"
            _ip("link", "add", dx, "netns", NS[x], "type", "veth", "peer", "name", dy, "netns", NS[y])
            _ip("-n", NS[x], "addr", "add", f"{net}.{hx}/24", "dev", dx)
            _ip("-n", NS[y], "addr", "add", f"{net}.{hy}/24", "dev", dy)
            _ip("-n", NS[x], "link", "set", dx, "up")
            _ip("-n", NS[y], "link", "set", dy, "up")
        yield
    finally:
        for ns in NS.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def _direct_link() -> None:
    """A veth between A and C, with routes so that each one's address is reached over it."""
    _ip("link", "add", "lane-rac", "netns", NS["a"], "type", "veth", "peer", "name", "lane-rca", "netns", NS["c"])
    _ip("-n", NS["a"], "addr", "add", "10.201.3.1/24", "dev", "lane-rac")
    _ip("-n", NS["c"], "addr", "add", "10.201.3.3/24", "dev", "lane-rca")
    _ip("-n", NS["a"], "link", "set", "lane-rac", "up")
    _ip("-n", NS["c"], "link", "set", "lane-rca", "up")
    _ip("-n", NS["a"], "route", "add", "10.201.2.0/24", "via", "10.201.3.3")
    _ip("-n", NS["c"], "route", "add", "10.201.1.0/24", "via", "10.201.3.1")


def _chat(ns: str, api: str, model: str) -> tuple[dict[str, str], str]:
    """POST a chat completion from inside namespace ``ns``; (headers, content)."""
    code = (
        "import json, sys, urllib.error, urllib.request\n"
        "req = urllib.request.Request(sys.argv[1], data=json.dumps({'model': sys.argv[2], 'max_tokens': 12,"
        " 'temperature': 0, 'messages': [{'role': 'user', 'content': 'relay me'}]}).encode(),"
        " headers={'content-type': 'application/json'})\n"
        "import time\n"
        "deadline = time.monotonic() + 45\n"
        "while True:\n"
        "    try:\n"
        "        r = urllib.request.urlopen(req, timeout=60)\n"
        "        break\n"
        "    except urllib.error.HTTPError as e:  # the router learns the peer's models within seconds\n"
        "        if e.code not in (404, 503) or time.monotonic() > deadline:\n"
        "            raise\n"
        "        time.sleep(0.5)\n"
        "print(json.dumps({'headers': dict(r.headers), 'body': json.loads(r.read())}))\n"
    )
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code,
                          f"http://{api}/v1/chat/completions", model], capture_output=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    res = json.loads(out.stdout)
    headers = {k.lower(): v for k, v in res["headers"].items()}
    return headers, res["body"]["choices"][0]["message"]["content"]


def _peer(node: Node, other: Node) -> dict[str, Any]:
    st = node.status() or {}
    return next((p for p in st.get("peers", []) if p["node_id"] == other.node_id), {})


def _relay_stats(b: Node) -> dict[str, int]:
    st = b.status() or {}
    return st.get("services", {}).get("lane", {}).get("relay", {}).get("stats", {})


@pytest.mark.netns
def test_members_without_a_shared_network_talk_through_a_relay(tmp_path: Path, nets: None) -> None:
    b = Node(tmp_path, "b", listen="0.0.0.0:0", netns=NS["b"]).start().wait_ready()
    nodes = [b]
    try:
        tok = write_token(tmp_path / "tok", b.invite(uses=2))
        c = Node(tmp_path, "c", "--model", "c-tiny=tiny", "--experts", "tiny", listen="10.201.2.3:0",
                 join_file=tok, netns=NS["c"])
        a = Node(tmp_path, "a", "--model", "tiny", "--remote-experts", "on", listen="10.201.1.1:0",
                 join_file=tok, netns=NS["a"])
        for n in (c, a):
            _serve(n)
            nodes.append(n)
        for n in (c, a):
            n.wait_ready(60)
        # A learns C from gossip, its direct dial fails, and it goes through B
        assert wait_for(lambda: _peer(a, c).get("path") == "relay" and _peer(c, a).get("path") == "relay", 60), (
            a.status(), c.status(), a.stderr_tail())
        sa, sc = a.status(), c.status()
        assert sa is not None and sc is not None
        assert wait_for(lambda: "c-tiny" in _models(a), 30), _models(a)
        headers, via_relay = _chat(NS["a"], sa["api"], "c-tiny")
        assert headers["x-meshd-node"] == c.node_id and headers["x-meshd-route"] == "tunnel"
        _, at_c = _chat(NS["c"], sc["api"], "c-tiny")
        assert via_relay == at_c
        # A's own model with every routed expert computed on C, reachable only through B
        assert wait_for(lambda: _expert_links(a).get(c.node_id, {}).get("connected"), 60), a.status()
        headers, remote_experts = _chat(NS["a"], sa["api"], "tiny")
        assert headers["x-meshd-node"] == a.node_id
        assert remote_experts == at_c  # same weights, same greedy text: byte-identical through the relay
        assert _expert_links(a)[c.node_id]["calls"] > 0
        relayed = _relay_stats(b)
        assert relayed.get("relays_opened", 0) >= 1 and relayed.get("relay_bytes", 0) > 10_000, relayed
        # a direct path appears: traffic moves to it
        _direct_link()
        assert wait_for(lambda: _peer(a, c).get("path") in ("quic", "lane"), 60), (a.status(), a.stderr_tail())
        assert wait_for(lambda: _expert_links(a).get(c.node_id, {}).get("connected"), 30)
        time.sleep(1.0)  # the replaced relayed connection's close may still pass B
        before = _relay_stats(b).get("relay_frames", 0)
        _, direct = _chat(NS["a"], sa["api"], "c-tiny")
        _, direct_experts = _chat(NS["a"], sa["api"], "tiny")
        assert direct == at_c and direct_experts == at_c
        assert _relay_stats(b).get("relay_frames", 0) == before
    finally:
        for n in nodes:
            n.stop()


def _serve(n: Node) -> None:
    """Start ``n`` as ``meshd serve`` (membership_nodes.Node starts clients)."""
    import membership_nodes

    orig = membership_nodes.meshd_cmd

    def serve_cmd(*args: str) -> list[str]:
        args = ("serve", *args[1:]) if args and args[0] == "client" else args
        return orig(*args)

    membership_nodes.meshd_cmd = serve_cmd  # type: ignore[assignment]
    try:
        n.start()
    finally:
        membership_nodes.meshd_cmd = orig  # type: ignore[assignment]


def _models(node: Node) -> list[str]:
    st = node.status() or {}
    names = [m["name"] for m in st.get("models", [])]
    for p in st.get("peers", []):
        names += [m["name"] for m in p.get("models", [])]
    return names


def _expert_links(node: Node) -> dict[str, Any]:
    st = node.status() or {}
    coords = st.get("services", {}).get("experts", {}).get("coordinators", [])
    return coords[0].get("workers", {}) if coords else {}
