"""A ``--stage`` node joins its mesh before its checkpoints are mapped and checked (the first start hashes
every weight byte: tens of seconds for a big file). Meanwhile it gossips ``stages_loading``, offers nothing
(so no plan uses it), and answers an OPEN with the typed error LOADING; the serving node answers a request
in that window with a 503 naming the stage that is still loading (before: "0 stage node(s) offer 0.0 MB",
as if there were no stage), and uses the stage once its offer is in."""

from __future__ import annotations

import asyncio
import json
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("meshd.membership.service")

from conftest import meshd_cmd, meshd_env
from daemon_testlib import start_node
from pipeline_mesh import invite, pipeline_status, post, wait_for, wait_plan

from engine.experts.channel import LoopThread, socketpair_channels
from engine.pipeline import wire
from engine.pipeline.link import StageFailed, StageLink
from meshd.pipeline_service import PipelineService

PAD_BYTES = 6 * 10**9  # a sparse weight file: no disk, but hashing it takes seconds (~0.4-1.5 GB/s)


def _slow_checkpoint(tmp: Path) -> Path:
    """tiny's files plus a sparse 6 GB ``.safetensors`` file the model never reads: the fingerprint hashes it."""
    from engine.tiny import ensure_tiny

    src = ensure_tiny(tmp / "src")
    dst = tmp / "big"
    shutil.copytree(src, dst)
    header = json.dumps({"pad.weight": {"dtype": "U8", "shape": [PAD_BYTES], "data_offsets": [0, PAD_BYTES]}})
    raw = header.encode() + b" " * (-len(header) % 8)
    with open(dst / "zz-pad.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + PAD_BYTES)
    return dst


def _status_text(state_dir: Path) -> str:
    return subprocess.run(meshd_cmd("status", "--state-dir", str(state_dir)), env=meshd_env(),
                          capture_output=True, text=True, timeout=20, check=True).stdout


def test_stage_still_loading_is_not_planned_and_named_in_the_503(tmp_path: Path) -> None:
    big = _slow_checkpoint(tmp_path)
    # 0.001 MB: the serving node holds no layer itself, so every request needs the stage
    srv = start_node(tmp_path / "s", "--model", "tiny", "--pipeline", "on", "--pipeline-memory", "0.001")
    nodes = [srv]
    try:
        token = invite(srv.state_dir)
        # the stage offers tiny (quick) and the big checkpoint (slow to check): it offers neither until both
        # are loaded, and is not ready (no run.json) until then
        st = start_node(tmp_path / "st", "--stage", "tiny", "--stage", str(big), "--join", token, wait=False)
        nodes.append(st)

        def loading() -> bool:
            return bool(pipeline_status(srv).get("loading"))

        wait_for(loading, 60, "the serving node to see the stage loading")
        node = pipeline_status(srv)["loading"][0]
        assert pipeline_status(srv)["plan"] is None
        t0 = time.monotonic()
        code, body = post(srv.run["api"], "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        took = time.monotonic() - t0
        assert code == 503 and body["error"]["code"] == "pipeline_unavailable", body
        assert "still loading their --stage weights" in body["error"]["message"], body
        assert node[:12] in body["error"]["message"], body
        assert took < 10, took  # an answer, not a wait for the load
        assert st.proc.poll() is None and not st.run_path.exists(), "the stage finished loading too soon"
        text = _status_text(srv.state_dir)
        assert f"loading {node}: its --stage weights are not loaded yet" in text, text
        assert "--stage" in _status_text(st.state_dir)  # the stage says what it is loading

        st.wait_ready(240)  # loaded: it advertises its offers, the serving node plans on it and serves
        wait_plan(srv, [None, [0, 3]], 60)
        assert pipeline_status(srv)["loading"] == []
        code, body = post(srv.run["api"], "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert code == 200, body
    finally:
        for n in reversed(nodes):
            n.stop()


def test_open_while_loading_is_answered_loading() -> None:
    """A serving node with an older view of gossip (a stage that restarted and is loading again) opens a run:
    the stage answers LOADING at once, by name, instead of leaving the stream without a handler."""
    svc = PipelineService(["/models/m"])
    svc._loading = "--stage /models/m: the weights are still being mapped and checked"
    lt = LoopThread()
    try:

        async def open_run() -> StageFailed:
            a, b = await socketpair_channels()
            peer = type("P", (), {"node_id": "c" * 32})()
            task = asyncio.get_running_loop().create_task(svc._serve(peer, b))
            link = StageLink("s" * 32, a, 0, 3)
            try:
                await link.open(7, bytes(32), 4, silence_s=5.0)
            except StageFailed as e:
                await task
                return e
            raise AssertionError("READY from a stage still loading")

        err = lt.run(open_run())
        assert err.code == wire.ErrorCode.LOADING, err
        assert "still loading" in err.reason and "/models/m" in err.reason, err
    finally:
        lt.stop()
