"""Expert RPC over the data lane, with real worker processes: parity with local over the lane and over
QUIC, a lane cut in the middle of a decode (output still byte-identical, no call hanging, the links
back on QUIC, then on the lane again once it is redialled), and a lane whose packets are dropped with
iptables inside a namespace the test creates (the silent lane is given up, QUIC carries on)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from experts_mesh import Coordinator, MeshFixture, WorkerProc, spawn_worker
from experts_util import make_moe_checkpoint
from test_experts_parity import PROMPT, gate

from engine.experts.coordinator import CoordinatorConfig
from engine.model import Model
from transport.lane import LaneConfig


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_moe_checkpoint(tmp_path_factory.mktemp("lane") / "q3", layers=3, experts=8, seed=7)



@pytest.mark.parametrize("path", ["lane", "quic"])
def test_parity_over_the_lane_and_over_quic(tmp_path: Path, ckpt: Path, procs: list[WorkerProc], path: str) -> None:
    mesh = MeshFixture()
    lane = path == "lane"
    procs += [spawn_worker(mesh, tmp_path, [str(ckpt)], lane=lane) for _ in range(2)]
    coord = Coordinator(mesh, lane=lane)
    try:
        coord.connect(procs)
        ex = coord.executor(ckpt, "on")
        coord.wait_paths(procs, path)
        model = Model.load(ckpt)
        assert gate(model, ex) == []
        st = ex.status()
        assert st["items_local"] == 0 and st["layers_delegated"] == st["layers"] > 0
        for w in procs:
            assert ex.links[w.node_id].channel.path == path
    finally:
        coord.close()


def _decode(model: Model, ex: object, steps: int, between: threading.Event | None = None,
            at_third: Callable[[], object] | None = None) -> list[bytes]:
    """Greedy decode; a third of the way in, set ``between`` (another thread acts meanwhile) and/or call
    ``at_third`` (the decode goes on once it returned)."""
    cache = model.new_cache()
    logits = model.forward(PROMPT, cache, executor=ex)[-1]
    out = [logits.tobytes()]
    for step in range(steps):
        if between is not None and step == steps // 3:
            between.set()
        if at_third is not None and step == steps // 3:
            at_third()
        logits = model.forward([int(np.argmax(logits))], cache, executor=ex)[-1]
        out.append(logits.tobytes())
    return out


def test_lane_cut_mid_decode_falls_back_byte_identical_without_hanging(tmp_path: Path, ckpt: Path,
                                                                       procs: list[WorkerProc]) -> None:
    mesh = MeshFixture()
    procs.append(spawn_worker(mesh, tmp_path, [str(ckpt)]))
    w = procs[0]
    coord = Coordinator(mesh, CoordinatorConfig(message_timeout_s=2.0, layer_timeout_s=5.0), lane=True)
    try:
        coord.connect(procs)
        model = Model.load(ckpt)
        ex = coord.executor(ckpt, "prefer", model.expert_weights)
        coord.wait_paths(procs, "lane")
        steps = 40
        ref = _decode(model, None, steps)
        cut = threading.Event()

        def cutter() -> None:
            cut.wait(30)

            async def abort() -> None:
                peer = coord.transport.peer(w.node_id)
                assert peer is not None and peer._lane is not None
                peer._lane._transport.abort()  # the TCP connection dies under the decode

            coord.lt.run(abort())
            cut_at.append(time.monotonic())

        cut_at: list[float] = []
        t = threading.Thread(target=cutter, daemon=True)
        t.start()
        t0 = time.monotonic()
        got = _decode(model, ex, steps, cut)
        took = time.monotonic() - t0
        t.join(5)
        assert cut_at and cut_at[0] < t0 + took  # the lane died while the decode ran
        assert got == ref  # byte-identical through the cut
        assert took < 10.0, took  # no call waited for a timeout of its own
        # the link is back on QUIC at once, then on the lane again when it is redialled
        coord.wait_paths(procs, "lane", timeout_s=15.0)
        on = coord.executor(ckpt, "on")
        assert _decode(model, on, 4) == ref[:5]
        assert on.status()["items_local"] == 0
    finally:
        coord.close()


def test_links_move_to_quic_at_once_when_the_lane_dies(tmp_path: Path, ckpt: Path, procs: list[WorkerProc]) -> None:
    mesh = MeshFixture()
    procs.append(spawn_worker(mesh, tmp_path, [str(ckpt)]))
    w = procs[0]
    coord = Coordinator(mesh, lane=True)
    try:
        coord.connect(procs)
        ex = coord.executor(ckpt, "on")
        coord.wait_paths(procs, "lane")
        assert coord.lanes is not None
        coord.lanes.config = LaneConfig(retry_min_s=30.0, retry_max_s=30.0)  # keep it down for a while

        async def abort() -> None:
            peer = coord.transport.peer(w.node_id)
            assert peer is not None and peer._lane is not None
            peer._lane._transport.abort()

        coord.lt.run(abort())
        coord.wait_paths(procs, "quic", timeout_s=5.0)
        model = Model.load(ckpt)
        assert gate(model, ex, PROMPT[:3]) == []  # "on" mode: no local compute, all over QUIC now
        assert ex.status()["items_local"] == 0
    finally:
        coord.close()


# -- a lane whose packets are dropped (iptables in a namespace the test creates) ----------------------

NS_W, VETH_HOST, VETH_NS = "lane-tw", "lane-tv0", "lane-tv1"
HOST_ADDR, NS_ADDR = "10.202.0.1", "10.202.0.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def worker_ns() -> Iterator[str]:
    """Namespace lane-tw reached from here over a veth pair (10.202.0.1 here, 10.202.0.2 there)."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("iptables") is None:
        pytest.skip("needs root, ip and iptables")
    subprocess.run(["ip", "netns", "del", NS_W], capture_output=True, check=False)
    subprocess.run(["ip", "link", "del", VETH_HOST], capture_output=True, check=False)
    try:
        _ip("netns", "add", NS_W)
        _ip("-n", NS_W, "link", "set", "lo", "up")
        _ip("link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS, "netns", NS_W)
        _ip("addr", "add", f"{HOST_ADDR}/30", "dev", VETH_HOST)
        _ip("link", "set", VETH_HOST, "up")
        _ip("-n", NS_W, "addr", "add", f"{NS_ADDR}/30", "dev", VETH_NS)
        _ip("-n", NS_W, "link", "set", VETH_NS, "up")
        yield NS_W
    finally:
        subprocess.run(["ip", "netns", "del", NS_W], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", VETH_HOST], capture_output=True, check=False)


@pytest.mark.netns
def test_lane_packets_dropped_mid_decode_fall_back_byte_identical(tmp_path: Path, ckpt: Path, worker_ns: str,
                                                                  procs: list[WorkerProc]) -> None:
    mesh = MeshFixture()
    procs.append(spawn_worker(mesh, tmp_path, [str(ckpt)], netns=worker_ns, listen=NS_ADDR))
    coord = Coordinator(mesh, CoordinatorConfig(message_timeout_s=1.0, layer_timeout_s=3.0), lane=True,
                        host=HOST_ADDR)
    try:
        coord.connect(procs)
        model = Model.load(ckpt)
        ex = coord.executor(ckpt, "prefer", model.expert_weights)
        coord.wait_paths(procs, "lane")
        steps = 30
        ref = _decode(model, None, steps)

        def drop() -> None:
            # every TCP packet of the worker's namespace vanishes; UDP flows. In place before the decode goes on
            # (from another thread, the rest of the decode could finish first on a loaded machine: it did)
            for chain in ("INPUT", "OUTPUT"):
                subprocess.run(["ip", "netns", "exec", worker_ns, "iptables", "-A", chain, "-p", "tcp", "-j", "DROP"],
                               check=True, capture_output=True)

        t0 = time.monotonic()
        got = _decode(model, ex, steps, at_third=drop)
        took = time.monotonic() - t0
        assert got == ref  # byte-identical through the silent lane
        assert took < 20.0, took  # at most a message timeout per layer until the link is given up, no hang
        assert ex.status()["local_fallback_layers"] + ex.status()["retries"] >= 1
        coord.wait_paths(procs, "quic", timeout_s=20.0)  # the dead lane is noticed; the worker is back on QUIC
        on = coord.executor(ckpt, "on")
        assert _decode(model, on, 3) == ref[:4]
        assert on.status()["items_local"] == 0
    finally:
        coord.close()
