"""A web page attacking a node's loopback API without a key, over real sockets to a real ``meshd serve``.

With no API key, a loopback bind is the API's only protection. A page on any site the operator visits can
defeat it two ways: DNS rebinding (its own name resolves to 127.0.0.1, so the browser lets it read the
answers; the request carries ``Host: its.name``) and plain cross-site requests (a ``text/plain`` POST needs
no CORS preflight, so it runs a generation; it carries ``Origin: https://its.site``). Before, both got 200
(the mesh view, completions). Now both get a 403 in OpenAI's shape, while requests with a loopback Host or
Origin (curl, SDKs, the console page itself) are served as before, and a node with an API key leaves
Host alone (the key protects it; a reverse proxy may rewrite Host).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_testlib import Node, start_node

BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    n = start_node(tmp_path_factory.mktemp("browser") / "a", "--model", "tiny")
    yield n
    n.stop()


def _request(node: Node, head: str, body: bytes = b"") -> tuple[int, bytes]:
    host, _, port = node.run["api"].rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=60) as s:
        s.sendall(head.encode() + body)
        buf = b""
        while chunk := s.recv(65536):
            buf += chunk
    status_line, _, rest = buf.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def _get(node: Node, path: str, **headers: str) -> tuple[int, bytes]:
    lines = [f"GET {path} HTTP/1.1", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items()),
             "Connection: close", ""]
    return _request(node, "\r\n".join(lines) + "\r\n")


def _post(node: Node, **headers: str) -> tuple[int, bytes]:
    lines = ["POST /v1/chat/completions HTTP/1.1", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items()),
             "Content-Type: text/plain", f"Content-Length: {len(BODY)}", "Connection: close", ""]
    return _request(node, "\r\n".join(lines) + "\r\n", BODY)


@pytest.mark.parametrize("path", ["/meshd/v1/mesh", "/v1/models", "/"])
def test_a_rebound_host_name_is_refused(node: Node, path: str) -> None:
    status, body = _get(node, path, Host="attacker.example:9337")
    assert status == 403, body[:200]
    err = json.loads(body)["error"]
    assert "attacker.example" in err["message"] and err["code"] == "forbidden_host"


def test_a_cross_site_post_does_not_run_a_generation(node: Node) -> None:
    status, body = _post(node, Host=node.run["api"], Origin="https://attacker.example")
    assert status == 403 and json.loads(body)["error"]["code"] == "forbidden_origin", body[:200]
    status, body = _post(node, Host=node.run["api"], Origin="null")  # a sandboxed frame, a file: page
    assert status == 403, body[:200]


@pytest.mark.parametrize("host", ["127.0.0.1:9337", "localhost", "localhost:1", "[::1]:9337", "127.9.9.9"])
def test_loopback_hosts_and_origins_are_served(node: Node, host: str) -> None:
    status, body = _get(node, "/meshd/v1/mesh", Host=host)
    assert status == 200 and "nodes" in json.loads(body), body[:200]
    status, body = _post(node, Host=node.run["api"], Origin=f"http://{node.run['api']}")
    assert status == 200 and json.loads(body)["choices"], body[:200]


def test_with_an_api_key_host_is_left_to_the_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1\n")
    keys.chmod(0o600)
    n = start_node(tmp_path / "k", "--model", "tiny", "--api-key-file", str(keys))
    try:
        assert _get(n, "/v1/models", Host="proxy.example")[0] == 401
        assert _get(n, "/v1/models", Host="proxy.example", Authorization="Bearer k1")[0] == 200
    finally:
        n.stop()
