"""The API as a daemon service: real ``meshd serve`` / ``meshd client`` processes on loopback (--no-mdns).

Membership has not landed yet, so the test makes the second node a member the way an invite would: a
copy of the mesh's genesis and a certificate for the node's own key issued with the admin key, written
into its state dir before it starts; the API's interim ``api_connect`` control command then connects it.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from api_helpers import StandInProcess, wait_models
from api_standin import prompt_ids_of, standin_words
from daemon_testlib import Node, start_node
from meshd import control
from meshd.api.schema import parse_request
from meshd.state import StateDir
from transport.credentials import MemberCert, MeshCredentials

MSGS = [{"role": "user", "content": "daemon"}]


def _ref(seed: int, n: int) -> str:
    req = parse_request("chat", json.dumps({"model": "x", "messages": MSGS}).encode())
    return "".join(t for _, t, _ in standin_words(prompt_ids_of(req), seed, n))


def make_member(admin_state: Path, new_state: Path) -> None:
    """Give ``new_state`` a key and a certificate in the mesh ``admin_state`` founded."""
    a = StateDir(admin_state)
    ident = a.load_identity()
    assert ident is not None
    creds = a.load_credentials(ident)
    assert creds is not None and creds.admin is not None
    b = StateDir(new_state)
    b_ident, _ = b.load_or_create_identity()
    cert = MemberCert.issue(creds.admin, creds.genesis, b_ident.public_key, creds.genesis.created_at)
    b.store_credentials(MeshCredentials(genesis=creds.genesis, cert=cert))


def api_url(node: Node) -> str:
    return f"http://{node.run['api']}/v1"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Node, Node, Path]]:
    tmp = tmp_path_factory.mktemp("apid")
    ext = StandInProcess("ext-model")
    keyfile = tmp / "keys"
    keyfile.write_text("# comment\nkey-one\nkey-two\n")
    keyfile.chmod(0o600)  # a key file others can read is refused
    a = start_node(tmp / "a", "--model", f"openai:{ext.url}", "--model", f"alias=openai:{ext.url}",
                   "--model", "tiny")
    make_member(tmp / "a", tmp / "b")
    b = start_node(tmp / "b", "--api-key-file", str(keyfile), command="client")
    try:
        control.call(tmp / "b" / "control.sock", "api_connect", addr=a.run["quic"], node_id=a.run["node_id"])
        yield a, b, keyfile
    finally:
        b.stop()
        a.stop()
        ext.stop()


def test_daemon_serves_external_models_locally(pair: tuple[Node, Node, Path]) -> None:
    a, _, _ = pair
    assert wait_models(api_url(a), {"ext-model", "alias", "tiny"}) == {"ext-model", "alias", "tiny"}
    cl = openai.OpenAI(base_url=api_url(a), api_key="x", max_retries=0)
    raw = cl.chat.completions.with_raw_response.create(model="alias", messages=MSGS, max_tokens=4, seed=9)
    assert raw.headers["x-meshd-node"] == a.run["node_id"] and raw.headers["x-meshd-route"] == "local"
    r = raw.parse()
    assert r.model == "alias" and r.choices[0].message.content == _ref(9, 4)
    st = a.status()
    assert any(m["name"] == "alias" and m["kind"] == "openai" for m in st["models"])
    assert any(m["name"] == "tiny" and m["kind"] == "engine" for m in st["models"])
    assert st["api"] == a.run["api"] and "api" in st["services"]


def test_headless_client_daemon_tunnels_with_keys(pair: tuple[Node, Node, Path]) -> None:
    a, b, _ = pair
    cl = openai.OpenAI(base_url=api_url(b), api_key="key-two", max_retries=0)
    assert wait_models(api_url(b), {"ext-model", "alias", "tiny"}, headers={"Authorization": "Bearer key-two"}) == \
        {"ext-model", "alias", "tiny"}
    raw = cl.chat.completions.with_raw_response.create(model="ext-model", messages=MSGS, max_tokens=4, seed=9)
    assert raw.headers["x-meshd-node"] == a.run["node_id"] and raw.headers["x-meshd-route"] == "tunnel"
    assert raw.parse().choices[0].message.content == _ref(9, 4)
    text = "".join(ch.choices[0].delta.content or "" for ch in cl.chat.completions.create(
        model="auto", messages=MSGS, max_tokens=4, seed=9, stream=True) if ch.choices)
    assert text == _ref(9, 4)
    r = cl.chat.completions.with_raw_response.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0)
    assert r.headers["x-meshd-route"] == "tunnel" and r.parse().usage.completion_tokens == 4  # type: ignore[union-attr]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=api_url(b), api_key="key-three", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        cl.chat.completions.create(model="missing", messages=MSGS)
    health = json.loads(urllib.request.urlopen(f"http://{b.run['api']}/health").read())
    assert health["role"] == "client" and health["models"] == []


def test_non_loopback_api_without_key_is_refused(tmp_path: Path) -> None:
    node = start_node(tmp_path / "c", "--api", "0.0.0.0:0", wait=False)
    code = node.proc.wait(20)
    assert code == 2 and "api" in node.stderr().lower()


def test_three_daemons_and_serving_daemon_killed_mid_stream(tmp_path: Path) -> None:
    """a and b serve 'shared' (the same external server) and their own tiny; c is a headless client.

    A model of one node is used through the other and through the client; then the daemon serving a
    stream is killed (SIGKILL): the stream ends with an error event within 2.5 s, and the next request
    is served by the survivor."""
    ext = StandInProcess("up")
    a = start_node(tmp_path / "a", "--model", f"shared=openai:{ext.url}", "--model", "tiny-a=tiny")
    nodes = [a]
    try:
        make_member(tmp_path / "a", tmp_path / "b")
        make_member(tmp_path / "a", tmp_path / "c")
        b = start_node(tmp_path / "b", "--model", f"shared=openai:{ext.url}", "--model", "tiny-b=tiny")
        nodes.append(b)
        c = start_node(tmp_path / "c", command="client")
        nodes.append(c)
        control.call(tmp_path / "b" / "control.sock", "api_connect", addr=a.run["quic"], node_id=a.run["node_id"])
        for peer in (a, b):
            control.call(tmp_path / "c" / "control.sock", "api_connect", addr=peer.run["quic"],
                         node_id=peer.run["node_id"])
        want = {"shared", "tiny-a", "tiny-b"}
        for n in nodes:
            assert wait_models(api_url(n), want) == want
        cl_b = openai.OpenAI(base_url=api_url(b), api_key="x", max_retries=0)
        raw = cl_b.chat.completions.with_raw_response.create(model="tiny-a", messages=MSGS, max_tokens=3)
        assert raw.headers["x-meshd-node"] == a.run["node_id"] and raw.headers["x-meshd-route"] == "tunnel"
        cl = openai.OpenAI(base_url=api_url(c), api_key="x", max_retries=0, timeout=30)
        raw = cl.chat.completions.with_raw_response.create(model="tiny-b", messages=MSGS, max_tokens=3)
        assert raw.headers["x-meshd-node"] == b.run["node_id"]

        raw = cl.chat.completions.with_raw_response.create(
            model="shared", messages=MSGS, max_tokens=1000, stream=True,
            extra_body={"standin": {"token_delay_s": 0.05}})
        victim = a if raw.headers["x-meshd-node"] == a.run["node_id"] else b
        survivor = b if victim is a else a
        got, t_kill = 0, 0.0
        with pytest.raises(openai.APIError):
            for _ in raw.parse():
                got += 1
                if got == 5:
                    victim.proc.kill()
                    t_kill = time.monotonic()
        assert t_kill and time.monotonic() - t_kill < 2.5
        r = cl.chat.completions.with_raw_response.create(model="shared", messages=MSGS, max_tokens=4, seed=9)
        assert r.headers["x-meshd-node"] == survivor.run["node_id"]
        assert r.parse().choices[0].message.content == _ref(9, 4)
    finally:
        for n in nodes:
            n.stop()
        ext.stop()
