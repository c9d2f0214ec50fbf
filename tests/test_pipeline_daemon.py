"""``--stage`` / ``--pipeline`` as a user runs them: real daemons on loopback joined by invite, the OpenAI API
on the serving node, layers on stage nodes, output byte-identical to a node that runs the model alone."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("meshd.membership.service")

from conftest import meshd_cmd, meshd_env
from daemon_testlib import Node, start_node
from pipeline_mesh import (
    collect,
    invite,
    pipeline_status,
    post,
    same_as_ref,
    stage,
    stage_status,
    stream,
    wait_for,
    wait_plan,
    whole,
)

CHAT = (
    "/v1/chat/completions",
    {
        "model": "tiny",
        "messages": [{"role": "user", "content": "layers far away"}],
        "max_tokens": 24,
        "logprobs": True,
        "top_logprobs": 2,
    },
)
COMPLETION = (
    "/v1/completions",
    {"model": "tiny", "prompt": "The mesh holds", "max_tokens": 24, "logprobs": 2},
)


@pytest.fixture()
def ref(tmp_path: Path):
    node = start_node(tmp_path / "ref", "--model", "tiny")  # its own mesh: runs every layer itself
    yield node
    node.stop()


def test_plan_from_gossip_by_memory_and_pins_byte_identical(tmp_path: Path, ref: Node) -> None:
    # 0.7 MB here holds the embeddings and 2 of tiny's 4 layers (248 KB each); the stage the rest + head.
    srv = start_node(tmp_path / "s", "--model", "tiny", "--pipeline", "on", "--pipeline-memory", "0.7")
    nodes = [srv]
    try:
        code, err = post(srv.run["api"], *CHAT)
        assert code == 503 and "layers" in err["error"]["message"], err  # no stage yet: says what is missing
        token = invite(tmp_path / "s")
        nodes.append(stage(tmp_path, "a", token, "tiny", "--pipeline-memory", "0.7"))
        st = wait_plan(srv, [[0, 1], [2, 3]])
        assert st["plan"][1]["node_id"] == nodes[1].run["node_id"]
        same_as_ref(ref, srv, (CHAT, COMPLETION))
        a = stage_status(nodes[1])
        assert a["loaded"] == [[2, 3]] and a["steps"] > 0, a
        st = pipeline_status(srv)
        # one fingerprint for one checkpoint: the model's, with or without --pipeline, and the stage's
        fps = {n: [m["fingerprint"] for m in n.status()["models"]] for n in (ref, srv)}
        assert fps[ref] == fps[srv] == [st["fingerprint"]] == [a["fingerprint"]], (fps, st, a)
        # the serving node gossips its numerics tag like the stage does (status/console show both)
        tag = srv.status()["services"]["pipeline"]["pipeline"]["numerics"]

        def gossiped(of: Node, at: Node) -> Any:
            return next((p for p in at.status()["peers"] if p["node_id"] == of.run["node_id"]), {}).get("numerics")

        assert tag and wait_for(lambda: gossiped(srv, nodes[1]) == tag, 15, "the serving node's numerics tag")
        assert gossiped(nodes[1], srv) == tag
        run = st["runs"][st["run"]]
        assert run["stages"][0]["calls"] > 0 and run["stages"][0]["latency_ms_avg"] > 0, run
        text = subprocess.run(
            meshd_cmd("status", "--state-dir", str(tmp_path / "s")),
            env=meshd_env(),
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout  # the text form shows the plan with per-stage timings
        section = text.split("\npipeline  on\n", 1)[1].splitlines()
        row = next(x.split() for x in section if x.strip().startswith(nodes[1].run["node_id"]))
        # NODE LAYERS PATH RTT_MS CALLS DIRECT_CALLS LAT_MS ...
        assert row[1] == "2-3+head" and row[2] in ("lane", "quic", "lane+direct"), text
        assert int(row[4]) > 0 and float(row[6]) > 0, text
        assert run["stages"][0]["pings"] > 0 and run["stages"][0]["path_rtt_ms_avg"] > 0, run  # path round trip
        me = next(x.split() for x in section if x.strip().startswith(srv.run["node_id"]))
        assert me[1:4] == ["(this", "node)", "0-1"], text
        with urllib.request.urlopen(f"http://{srv.run['api']}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        count = [
            line
            for line in metrics.splitlines()
            if line.startswith("meshd_pipeline_stage_latency_seconds_count{") and 'layers="2-3"' in line
        ]
        assert count and float(count[0].rsplit(" ", 1)[1]) >= run["stages"][0]["calls"] > 0, count
        # every request is over: no sequence lives anywhere
        wait_for(lambda: stage_status(nodes[1])["live_sequences"] == 0, 10, "stage frees its caches")
        assert all(r["live_sequences"] == 0 for r in pipeline_status(srv)["runs"].values())
    finally:
        for n in reversed(nodes):
            n.stop()


@pytest.mark.parametrize("pin", ["1-3", "3-3"])
def test_pinned_two_stage_cuts_byte_identical(tmp_path: Path, ref: Node, pin: str) -> None:
    srv = start_node(tmp_path / "s", "--model", "tiny", "--pipeline", "on")
    nodes = [srv]
    try:
        nodes.append(stage(tmp_path, "a", invite(tmp_path / "s"), f"tiny@{pin}"))
        first, last = (int(x) for x in pin.split("-"))
        wait_plan(srv, [[0, first - 1], [first, last]])
        same_as_ref(ref, srv, (CHAT, COMPLETION))
    finally:
        for n in reversed(nodes):
            n.stop()


def _three(tmp_path: Path, spare: bool) -> list[Node]:
    srv = start_node(tmp_path / "s", "--model", "tiny", "--pipeline", "on", "--pipeline-memory", "0.5")
    nodes = [srv]
    token = invite(tmp_path / "s")
    nodes.append(stage(tmp_path, "b", token, "tiny@1-2"))
    nodes.append(stage(tmp_path, "c", token, "tiny@3-3"))
    if spare:  # unpinned, 0.7 MB: holds 2 layers; not needed while b is up
        nodes.append(stage(tmp_path, "d", token, "tiny", "--pipeline-memory", "0.7"))
    wait_plan(srv, [[0, 0], [1, 2], [3, 3]])
    # a node remembers its peers ~2 s after joining; one killed before that cannot find the mesh on restart
    wait_for(lambda: all((n.state_dir / "peers.json").exists() for n in nodes[1:]), 20, "peers remembered")
    return nodes


LONG = (
    "/v1/completions",
    {
        "model": "tiny",
        "prompt": "The mesh holds",
        "max_tokens": 2000,  # still running when the test acts on it: a tiny pipeline step is well under 1 ms
        "logprobs": 1,
        "temperature": 0.7,
        "seed": 6,
    },
)


def test_kill_middle_stage_mid_stream_recovers_byte_identical(tmp_path: Path, ref: Node) -> None:
    nodes = _three(tmp_path, spare=True)
    srv, b, c, d = nodes
    try:
        same_as_ref(ref, srv, (CHAT, COMPLETION))
        code, want = post(ref.run["api"], *LONG)
        assert code == 200
        events: list[dict[str, Any]] = []
        for ev in stream(srv.run["api"], *LONG):
            events.append(ev)
            if len(events) == 20:
                b.proc.send_signal(signal.SIGKILL)
        assert "error" not in events[-1], events[-1]
        assert len(events) > 20
        assert collect(events, "completion") == whole(want, "completion")
        st = pipeline_status(srv)
        assert st["recoveries"] == 1 and [s["layers"] for s in st["plan"]] == [[0, 0], [1, 2], [3, 3]], st
        assert st["plan"][1]["node_id"] == d.run["node_id"]
        # the survivor frees the failed run's sequences
        wait_for(lambda: stage_status(c)["live_sequences"] == 0, 10, "c frees its caches")
        # a restarted stage serves again (pinned: it takes its layers back once the plan is redone)
        b.proc.wait(timeout=10)
        nodes[1] = start_node(tmp_path / "b", "--stage", "tiny@1-2")
        wait_for(
            lambda: pipeline_status(srv)["plan"][1]["node_id"] == b.run["node_id"], 40, "b back in the plan"
        )
        same_as_ref(ref, srv, (CHAT, COMPLETION))
    finally:
        for n in reversed(nodes):
            n.stop()


def test_kill_without_spare_ends_stream_with_error_within_2s_and_restart_serves(
    tmp_path: Path, ref: Node
) -> None:
    nodes = _three(tmp_path, spare=False)
    srv, b, c = nodes
    try:
        killed = 0.0
        events: list[dict[str, Any]] = []
        for ev in stream(srv.run["api"], *LONG):
            events.append(ev)
            if len(events) == 10:
                c.proc.send_signal(signal.SIGKILL)
                killed = time.monotonic()
        ended = time.monotonic() - killed
        assert "error" in events[-1], events[-1]
        assert ended < 2.0, ended
        assert "layers 3-3" in events[-1]["error"]["message"], events[-1]  # names what is missing
        wait_for(lambda: stage_status(b)["live_sequences"] == 0, 10, "b frees its caches")
        code, err = post(srv.run["api"], *CHAT)
        assert code == 503 and "pipeline" in err["error"]["code"], err
        c.proc.wait(timeout=10)
        nodes[2] = start_node(tmp_path / "c", "--stage", "tiny@3-3")
        wait_plan(srv, [[0, 0], [1, 2], [3, 3]])
        same_as_ref(ref, srv, (CHAT, COMPLETION))
    finally:
        for n in reversed(nodes):
            n.stop()


def test_client_hang_up_frees_every_stage(tmp_path: Path) -> None:
    nodes = _three(tmp_path, spare=False)
    srv, b, c = nodes
    try:
        gen = stream(srv.run["api"], *LONG)
        for _ in range(5):
            next(gen)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both at once: the stream is still running
            live = list(pool.map(lambda n: stage_status(n)["live_sequences"], (b, c)))
        assert live == [1, 1], live
        gen.close()  # the client hangs up mid-stream
        wait_for(
            lambda: stage_status(b)["live_sequences"] == 0 and stage_status(c)["live_sequences"] == 0,
            10,
            "every stage frees the sequence",
        )
        assert all(r["live_sequences"] == 0 for r in pipeline_status(srv)["runs"].values())
    finally:
        for n in reversed(nodes):
            n.stop()


def test_refusals_by_name_overlapping_pins_and_prefer(tmp_path: Path, ref: Node) -> None:
    from engine.tiny import create_tiny

    other = create_tiny(tmp_path / "other-ckpt", seed=1)  # same shapes, other weights
    srv = start_node(tmp_path / "s", "--model", "tiny", "--pipeline", "on")
    nodes = [srv]
    try:
        token = invite(tmp_path / "s", uses=4)
        x = stage(tmp_path, "x", token, str(other))
        nodes.append(x)
        nodes.append(stage(tmp_path, "p", token, "tiny@1-2"))
        nodes.append(stage(tmp_path, "q", token, "tiny@2-3"))

        def refused() -> Any:
            st = pipeline_status(srv)
            return st if st["refused"] and st["unavailable"] and "overlap" in st["unavailable"] else None

        st = wait_for(refused, 40, "refusals")
        assert (
            st["refused"][0]["node_id"] == x.run["node_id"]
            and "holds checkpoint" in st["refused"][0]["reason"]
        )
        code, err = post(srv.run["api"], *CHAT)
        assert code == 503 and err["error"]["code"] == "pipeline_unavailable", err
        assert "pins overlap" in err["error"]["message"], err
    finally:
        for n in reversed(nodes):
            n.stop()
    # prefer: nothing offers layers, so the node runs the model alone (same bytes)
    alone = start_node(
        tmp_path / "alone", "--model", "tiny", "--pipeline", "prefer", "--pipeline-memory", "0.5"
    )
    try:
        same_as_ref(ref, alone, (CHAT, COMPLETION))
        st = pipeline_status(alone)
        assert st["plan"] == [{"node_id": alone.run["node_id"], "layers": [0, 3]}] and st["local_fallback"], (
            st
        )
    finally:
        alone.stop()


def test_stage_delegating_its_experts_byte_identical(tmp_path: Path, ref: Node) -> None:
    srv = start_node(tmp_path / "s", "--model", "tiny", "--pipeline", "on")
    nodes = [srv]
    try:
        token = invite(tmp_path / "s", uses=3)
        nodes.append(start_node(tmp_path / "w", "--experts", "tiny", "--join", token))
        a = stage(tmp_path, "a", token, "tiny@2-3", "--remote-experts", "on")
        nodes.append(a)
        wait_plan(srv, [[0, 1], [2, 3]])

        def linked() -> bool:  # the stage's layers have their expert worker
            cos = a.status()["services"]["experts"].get("coordinators") or []
            return bool(cos) and all(c.get("workers") for c in cos)

        wait_for(linked, 40, "the stage's expert worker link")
        same_as_ref(ref, srv, (CHAT, COMPLETION))
        co = a.status()["services"]["experts"]["coordinators"][0]
        assert co["layers_delegated"] > 0 and co["items_local"] == 0, co
    finally:
        for n in reversed(nodes):
            n.stop()
