"""Expert RPC over a direct channel (engine.experts.direct, transport.lane_direct) with a real worker
process: the layer calls go over it (counted), logits byte-identical to local; the channel killed in the
middle of a decode (its socket shut down under a blocked read, then its worker's end closed) falls back to
the stream with output still byte-identical, no call hanging, and the channel is dialled again at the next
probe; ``MESHD_EXPERTS_DIRECT=0`` dials none."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from experts_mesh import Coordinator, MeshFixture, WorkerProc, spawn_worker
from experts_util import make_moe_checkpoint
from test_experts_lane import _decode
from test_experts_parity import gate

from engine.experts.coordinator import CoordinatorConfig
from engine.model import Model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_moe_checkpoint(tmp_path_factory.mktemp("direct") / "q3", layers=3, experts=8, seed=11)



def _wait_direct(coord: Coordinator, ex: object, node: str, up: bool = True, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        link = ex.links.get(node)  # type: ignore[attr-defined]
        if (link is not None and link.direct is not None and not link.direct.closed) == up:
            return
        if up:
            coord.probe()  # dials a missing channel
        time.sleep(0.02)
    raise AssertionError(f"direct channel to {node} not {'up' if up else 'down'} within {timeout_s}s")


def test_decode_over_the_direct_channel_is_byte_identical(tmp_path: Path, ckpt: Path,
                                                          procs: list[WorkerProc]) -> None:
    mesh = MeshFixture()
    procs.append(spawn_worker(mesh, tmp_path, [str(ckpt)]))
    w = procs[0]
    coord = Coordinator(mesh, CoordinatorConfig(message_timeout_s=5.0, layer_timeout_s=10.0), lane=True)
    try:
        coord.connect(procs)
        model = Model.load(ckpt)
        ex = coord.executor(ckpt, "on")
        coord.wait_paths(procs, "lane")
        _wait_direct(coord, ex, w.node_id)
        assert gate(model, ex) == []
        st = ex.status()
        wst = st["workers"][w.node_id]
        assert st["items_local"] == 0 and wst["direct"] is True
        assert wst["direct_calls"] > 0  # decode layers went over the direct channel...
        assert st["passes_on_loop"] == 0  # ...from the engine thread, the pass never handed to the loop
        assert coord.lanes is not None and coord.lanes.status()["direct_channels"] == 1
        assert ex.echo_rtt(w.node_id, b"x" * 4096) > 0

        # the channel dies under a decode: byte-identical output, no call waits for a timeout
        ref = _decode(model, None, 30)
        calls = wst["direct_calls"]

        def kill() -> None:
            ex.links[w.node_id].direct.channel._sock.shutdown(2)  # the socket dies under the engine thread

        t0 = time.monotonic()
        got = _decode(model, ex, 30, at_third=kill)
        took = time.monotonic() - t0
        assert got == ref
        assert took < 4.0, took  # the message timeout is 5 s: nothing waited for it
        st = ex.status()
        assert ex.links[w.node_id].direct is None or ex.links[w.node_id].direct.closed
        assert st["items_local"] == 0 and st["workers"][w.node_id]["direct_calls"] > calls
        _wait_direct(coord, ex, w.node_id)  # dialled again at the next probe
        calls = ex.status()["workers"][w.node_id]["direct_calls"]
        assert _decode(model, ex, 4) == ref[:5]
        assert ex.status()["workers"][w.node_id]["direct_calls"] > calls
    finally:
        coord.close()


def test_no_direct_channel_when_switched_off(tmp_path: Path, ckpt: Path, procs: list[WorkerProc],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHD_EXPERTS_DIRECT", "0")
    mesh = MeshFixture()
    procs.append(spawn_worker(mesh, tmp_path, [str(ckpt)]))
    coord = Coordinator(mesh, lane=True)
    try:
        coord.connect(procs)
        model = Model.load(ckpt)
        ex = coord.executor(ckpt, "on")
        coord.wait_paths(procs, "lane")
        coord.probe()
        assert _decode(model, ex, 3) == _decode(model, None, 3)
        st = ex.status()["workers"][procs[0].node_id]
        assert st["direct"] is False and st["direct_calls"] == 0 and st["calls"] > 0
    finally:
        coord.close()
