"""Failures over real QUIC with worker processes: killed mid-request, workers gone (on / prefer), joins."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from experts_mesh import Coordinator, MeshFixture, WorkerProc, spawn_worker
from experts_util import make_moe_checkpoint
from test_experts_parity import PROMPT, gate

from engine.experts.coordinator import CoordinatorConfig, ExpertsUnavailable
from engine.model import Model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_moe_checkpoint(tmp_path_factory.mktemp("faults") / "q3", layers=3, experts=8, seed=5)


@pytest.fixture
def mesh() -> MeshFixture:
    return MeshFixture()



def _kill_when_hung(w: WorkerProc, delay_s: float) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay_s), w.kill()), daemon=True)
    t.start()
    return t


def test_worker_killed_mid_request_retries_on_the_other_holder(tmp_path: Path, ckpt: Path, mesh: MeshFixture,
                                                               procs: list[WorkerProc]) -> None:
    dying = spawn_worker(mesh, tmp_path, [str(ckpt)], hang_after=0)  # its first request never finishes
    ok = spawn_worker(mesh, tmp_path, [str(ckpt)])
    procs += [dying, ok]
    coord = Coordinator(mesh, CoordinatorConfig(message_timeout_s=1.5, layer_timeout_s=10))
    try:
        coord.connect([dying, ok])
        ex = coord.executor(ckpt, "on")
        assert len(ex.links) == 2
        model = Model.load(ckpt)
        killer = _kill_when_hung(dying, 0.3)
        t0 = time.monotonic()
        remote = model.forward(PROMPT, model.new_cache(), executor=ex)
        took = time.monotonic() - t0
        killer.join()
        assert remote.tobytes() == model.forward(PROMPT, model.new_cache()).tobytes()
        assert took < 5.0, took
        st = ex.status()
        assert dying.node_id not in ex.links and st["retries"] > 0
        assert gate(model, ex, PROMPT[:4]) == []  # and the survivor alone stays exact
    finally:
        coord.close()


def test_only_worker_killed_mid_request_fails_fast_in_on_mode(tmp_path: Path, ckpt: Path, mesh: MeshFixture,
                                                              procs: list[WorkerProc]) -> None:
    dying = spawn_worker(mesh, tmp_path, [str(ckpt)], hang_after=1)
    procs.append(dying)
    coord = Coordinator(mesh, CoordinatorConfig(message_timeout_s=1.5, layer_timeout_s=10))
    try:
        coord.connect([dying])
        ex = coord.executor(ckpt, "on")
        model = Model.load(ckpt)
        killer = _kill_when_hung(dying, 0.3)
        t0 = time.monotonic()
        with pytest.raises(ExpertsUnavailable, match="no live expert worker holds layer/expert"):
            model.forward(PROMPT, model.new_cache(), executor=ex)
        assert time.monotonic() - t0 < 5.0
        killer.join()
        assert ex.status()["unavailable"] >= 1
    finally:
        coord.close()


def test_workers_gone_on_fails_and_prefer_falls_back_counted(tmp_path: Path, ckpt: Path, mesh: MeshFixture,
                                                             procs: list[WorkerProc]) -> None:
    w = spawn_worker(mesh, tmp_path, [str(ckpt)])
    procs.append(w)
    coord = Coordinator(mesh, CoordinatorConfig(message_timeout_s=1.5, layer_timeout_s=5))
    try:
        coord.connect([w])
        model = Model.load(ckpt)
        on = coord.executor(ckpt, "on")
        prefer = coord.executor(ckpt, "prefer", model.expert_weights)
        ref = model.forward(PROMPT, model.new_cache())
        assert model.forward(PROMPT, model.new_cache(), executor=prefer).tobytes() == ref.tobytes()
        assert prefer.status()["items_local"] == 0
        w.stop()  # a clean stop: the connection closes, the peer goes down
        deadline = time.monotonic() + 10
        while (on.links or prefer.links) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ExpertsUnavailable):
            model.forward(PROMPT, model.new_cache(), executor=on)
        assert model.forward(PROMPT, model.new_cache(), executor=prefer).tobytes() == ref.tobytes()
        st = prefer.status()
        assert st["local_fallback_layers"] == 3 and st["items_local"] > 0
    finally:
        coord.close()


def test_worker_joining_mid_forward_is_used_only_from_the_next_forward(tmp_path: Path, ckpt: Path,
                                                                       mesh: MeshFixture,
                                                                       procs: list[WorkerProc]) -> None:
    a = spawn_worker(mesh, tmp_path, [str(ckpt)])
    late = spawn_worker(mesh, tmp_path, [str(ckpt)])
    procs += [a, late]
    coord = Coordinator(mesh)
    try:
        coord.connect([a])
        ex = coord.executor(ckpt, "on")
        model = Model.load(ckpt)
        joined: list[bool] = []

        def joining(layer: int, x: np.ndarray, work: list) -> list[np.ndarray]:  # type: ignore[type-arg]
            if layer == 1 and not joined:
                coord.connect([late])  # the new worker joins between two layers of this forward
                coord.probe()
                joined.append(late.node_id in ex.links)
            return ex(layer, x, work)

        ref = model.forward(PROMPT, model.new_cache())
        assert model.forward(PROMPT, model.new_cache(), executor=joining).tobytes() == ref.tobytes()
        assert joined == [True]
        assert ex.status()["workers"][late.node_id]["calls"] == 0  # type: ignore[index]
        assert model.forward(PROMPT, model.new_cache(), executor=ex).tobytes() == ref.tobytes()
        assert ex.status()["workers"][late.node_id]["calls"] > 0  # type: ignore[index]
    finally:
        coord.close()


def test_peer_without_experts_is_passed_over_quickly_not_hung(ckpt: Path, mesh: MeshFixture) -> None:
    a, b = Coordinator(mesh), Coordinator(mesh)  # b serves no experts: no EXPERT stream handler
    try:
        host, port = b.lt.run(b.transport.listen("127.0.0.1", 0))
        t0 = time.monotonic()
        a.lt.run(a.transport.connect((host, port), b.ident.node_id), timeout=15)
        ex = a.executor(ckpt, "on")
        assert ex.links == {} and time.monotonic() - t0 < 5.0
        st = a.service.status()["coordinators"][0]
        assert st["refused"] == {} and b.ident.node_id not in st["workers"], st  # no worker: not listed
        assert ex.unavailable_reason() == "no expert workers hold this model's routed experts"
        # It is asked again later (it may start serving experts), not written off.
        c = a.service._coordinated[0]
        first = c.retry_at[b.ident.node_id]
        a.probe()
        assert c.retry_at[b.ident.node_id] == first  # not before its time
        c.retry_at[b.ident.node_id] = 0.0
        a.probe()
        assert c.retry_at[b.ident.node_id] > first and b.ident.node_id in c.plain and not c.refused
    finally:
        a.close()
        b.close()


def test_coordinator_finds_workers_through_gossiped_records(tmp_path: Path, ckpt: Path, mesh: MeshFixture,
                                                            procs: list[WorkerProc]) -> None:
    """With a membership service (here a stand-in with its public API), advertised workers are dialled
    and probed without anyone connecting to them first."""
    from dataclasses import dataclass as dc

    from engine.experts.fingerprint import model_fingerprint

    w = spawn_worker(mesh, tmp_path, [str(ckpt)])
    procs.append(w)

    @dc
    class Shard:
        model_fingerprint: str

    @dc
    class Record:
        experts: tuple[Shard, ...]
        addrs: tuple[str, ...]

    @dc
    class View:
        node_id: str
        record: Record

    class Membership:
        def __init__(self) -> None:
            self.callbacks: list[object] = []
            self.published: list[object] = []

        def set_local_experts(self, experts: list[object]) -> None:
            self.published = experts

        def alive_peers(self) -> list[View]:
            fp = model_fingerprint(ckpt).hex()
            return [View(w.node_id, Record((Shard(fp),), (f"{w.addr[0]}:{w.addr[1]}",)))]

        def on_change(self, cb: object) -> None:
            self.callbacks.append(cb)

    class FakeDaemon:
        def __init__(self, transport: object) -> None:
            self.transport = transport
            self.services = [Membership()]

    coord = Coordinator(mesh)
    try:
        coord.lt.run(coord.service.stop())
        coord.lt.run(coord.service.start(FakeDaemon(coord.transport)))
        ex = coord.executor(ckpt, "on")
        deadline = time.monotonic() + 15
        while not ex.links and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list(ex.links) == [w.node_id]
        model = Model.load(ckpt)
        assert model.forward(PROMPT, model.new_cache(), executor=ex).tobytes() == \
            model.forward(PROMPT, model.new_cache()).tobytes()
    finally:
        coord.close()
