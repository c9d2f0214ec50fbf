"""``--remote-experts`` as a user runs it: real daemons on loopback joined by invite, the OpenAI API on the
coordinator, routed experts computed by a worker daemon (``--experts tiny``), output identical to a node
that computes everything itself, and 503 once the only worker is gone (``on`` mode)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("meshd.membership.service")

import urllib.error  # noqa: E402
import urllib.request  # noqa: E402

from conftest import meshd_cmd, meshd_env  # noqa: E402
from daemon_testlib import start_node  # noqa: E402

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "experts far away"}], "max_tokens": 6,
        "temperature": 0, "logprobs": True, "top_logprobs": 3}


def _post(api: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(f"http://{api}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def _status(state_dir: Path) -> dict[str, Any]:
    out = subprocess.run(meshd_cmd("status", "--json", "--state-dir", str(state_dir)), env=meshd_env(),
                         capture_output=True, text=True, timeout=20, check=True)
    return json.loads(out.stdout)


def _metrics(api: str) -> dict[str, float]:
    """A node's /metrics samples: ``name{labels}`` -> value."""
    with urllib.request.urlopen(f"http://{api}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_remote_experts_on_matches_local_and_503s_without_workers(tmp_path: Path) -> None:
    ref = start_node(tmp_path / "ref", "--model", "tiny")  # its own mesh, computes every expert itself
    coord = start_node(tmp_path / "c", "--model", "tiny", "--remote-experts", "on")
    nodes = [ref, coord]
    try:
        token = subprocess.run(meshd_cmd("invite", "--state-dir", str(tmp_path / "c")), env=meshd_env(),
                               capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        worker = start_node(tmp_path / "w", "--experts", "tiny", "--join", token)
        nodes.append(worker)

        code, want, _ = _post(ref.run["api"], BODY)
        assert code == 200, want
        deadline = time.monotonic() + 30
        while True:  # 503 until the worker has joined and answered the coordinator's hello
            code, got, headers = _post(coord.run["api"], BODY)
            if code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert code == 200, got
        assert headers["x-meshd-route"] == "local" and headers["x-meshd-node"] == coord.run["node_id"]
        # Same tokens and the same log-probabilities, to the last bit, as the all-local node.
        assert got["choices"][0]["message"] == want["choices"][0]["message"]
        assert got["choices"][0]["logprobs"] == want["choices"][0]["logprobs"]

        st = _status(tmp_path / "c")["services"]["experts"]["coordinators"][0]
        assert st["layers_delegated"] > 0 and st["items_local"] == 0, st  # the worker did the expert work
        # Decode steps went over the direct channel beside the data lane (engine thread, no polling), or,
        # before it was dialled, ran on the loop over the lane's stream; never handed back.
        link = st["workers"][worker.run["node_id"]]
        assert link["direct_calls"] > 0 or st["passes_on_loop"] > 0, st
        assert st["passes_handed_back"] == 0, st
        wst = _status(tmp_path / "w")["services"]["experts"]["worker"]
        assert wst["requests"] > 0 and wst["pairs"] > 0, wst
        # One worker on this machine's loopback: the stream path polls (coordinator for replies, worker for
        # the next request) when it and the coordinator have a core each; the direct path never does.
        polling = len(os.sched_getaffinity(0)) >= 2
        assert st["polling"] is polling, st
        if not polling:
            assert wst["polls"] == 0, wst
        elif st["passes_on_loop"] > 0:
            assert wst["polls"] > 0, (st, wst)
        # The daemons' direct channel (beside their data lane) carries the next request's decode layers,
        # with the same bits.
        wid = worker.run["node_id"]
        deadline = time.monotonic() + 10
        while not _status(tmp_path / "c")["services"]["experts"]["coordinators"][0]["workers"][wid]["direct"]:
            assert time.monotonic() < deadline, "no direct channel to the worker"
            time.sleep(0.1)
        def direct_calls() -> int:
            return _status(tmp_path / "c")["services"]["experts"]["coordinators"][0]["workers"][wid]["direct_calls"]

        before = direct_calls()
        code, again, _ = _post(coord.run["api"], BODY)
        assert code == 200 and again["choices"][0]["logprobs"] == want["choices"][0]["logprobs"], again
        assert direct_calls() > before
        # The same counters on each node's /metrics (the API's registry carries the experts service's).
        cm, wm = _metrics(coord.run["api"]), _metrics(worker.run["api"])
        delegated = [v for k, v in cm.items() if k.startswith("meshd_experts_layers_delegated_total{model=")]
        assert delegated and delegated[0] >= st["layers_delegated"] > 0, cm
        assert any(k.startswith("meshd_experts_worker_link_calls_total{") and worker.run["node_id"] in k
                   and v > 0 for k, v in cm.items()), cm
        assert wm["meshd_experts_worker_requests_total"] >= wst["requests"] > 0, wm
        assert wm["meshd_experts_worker_polls_total"] >= wst["polls"], wm

        worker.proc.send_signal(signal.SIGKILL)
        worker.proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        while True:  # `on` with no live holder: a clear 503 naming what is missing, never a hang
            code, err, headers = _post(coord.run["api"], BODY)
            if code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert code == 503, err
        assert "expert" in err["error"]["message"] and "Retry-After" in headers
    finally:
        for n in reversed(nodes):
            n.stop()


@pytest.mark.parametrize(("failures", "delay_s"), [(1, 0.5), (2, 1.0), (3, 2.0), (6, 16.0), (7, 30.0), (50, 30.0)])
def test_unanswered_hello_retry_delay_doubles_to_a_cap(failures: int, delay_s: float) -> None:
    from meshd.experts_service import refusal_retry_delay_s

    assert refusal_retry_delay_s(failures) == delay_s


def test_workers_lost_mid_request_answer_503_not_500(tmp_path: Path) -> None:
    """A request accepted while its worker looked alive, whose worker then stops answering: the layer times
    out, no other holder is left, and the request fails with the documented 503 naming what is missing
    (it was a 500 'generation failed' when the engine failed mid-generation)."""
    coord = start_node(tmp_path / "c", "--model", "tiny", "--remote-experts", "on",
                       "--experts-message-timeout", "1", "--experts-layer-timeout", "2")
    nodes = [coord]
    try:
        token = subprocess.run(meshd_cmd("invite", "--state-dir", str(tmp_path / "c")), env=meshd_env(),
                               capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        worker = start_node(tmp_path / "w", "--experts", "tiny", "--join", token)
        nodes.append(worker)
        deadline = time.monotonic() + 30
        while True:
            code, got, _ = _post(coord.run["api"], BODY)
            if code != 503 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert code == 200, got
        worker.proc.send_signal(signal.SIGSTOP)  # alive to the transport for a while, but silent
        try:
            t0 = time.monotonic()
            code, err, headers = _post(coord.run["api"], BODY)
            took = time.monotonic() - t0
        finally:
            worker.proc.send_signal(signal.SIGKILL)
            worker.proc.send_signal(signal.SIGCONT)
        assert code == 503, err
        assert err["error"]["code"] == "experts_unavailable" and "Retry-After" in headers, err
        assert "expert" in err["error"]["message"], err
        assert took < 10, took
        st = _status(tmp_path / "c")["services"]["experts"]["coordinators"][0]
        assert st["unavailable"] >= 1, st
    finally:
        for n in reversed(nodes):
            n.stop()
