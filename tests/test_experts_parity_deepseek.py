"""The expert-worker parity gate (tests/test_experts_parity.py's) on the DeepSeek-V3-style families, over
real QUIC on loopback with real worker processes: ``glm4_moe`` and ``deepseek_v3`` tiny checkpoints
(dense layer 0, group-limited sigmoid routing with a correction bias, a shared expert, latent attention
for deepseek_v3). Local and delegated runs must be equal byte for byte; the dense layer and the shared
experts stay on the routing node (the workers hold routed experts only) and the routing runs there.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from experts_mesh import Coordinator, MeshFixture, WorkerProc, spawn_worker
from test_experts_parity import PROMPT, ExpertFfnCounter, gate

from engine.experts.coordinator import RemoteExecutor
from engine.model import Model
from engine.tiny import create_tiny

ARCHES = ("glm4_moe", "deepseek_v3")


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.mesh = MeshFixture()
        self.ckpts = {a: create_tiny(tmp / a, arch=a, seed=5) for a in ARCHES}
        specs = [str(p) for p in self.ckpts.values()]
        self.workers: list[WorkerProc] = [spawn_worker(self.mesh, tmp, specs) for _ in range(2)]
        self.models = {a: Model.load(p) for a, p in self.ckpts.items()}

    def close(self) -> None:
        for w in self.workers:
            w.stop()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    s = Setup(tmp_path_factory.mktemp("parity-ds"))
    yield s
    s.close()


@pytest.mark.parametrize("n_workers", [1, 2])
def test_parity_gate_over_quic(setup: Setup, n_workers: int) -> None:
    coord = Coordinator(setup.mesh)
    try:
        coord.connect(setup.workers[:n_workers])
        for arch, path in setup.ckpts.items():
            model = setup.models[arch]
            ex: RemoteExecutor = coord.executor(path, "on")
            bad = gate(model, ex)
            assert bad == [], f"{arch} with {n_workers} workers: {bad[:5]}"
            st = ex.status()
            assert st["items_local"] == 0 and st["layers_delegated"] == st["layers"] > 0, st
            assert model.sparse_layers == [1, 2, 3]  # layer 0 is dense, it never leaves this node
            with pytest.MonkeyPatch.context() as mp:
                counter = ExpertFfnCounter(mp)
                model.forward(PROMPT, model.new_cache(), executor=ex)
                assert counter.calls == 0  # no routed expert ran here
                model.forward(PROMPT, model.new_cache())
                assert counter.calls > 0
    finally:
        coord.close()


def test_parity_with_workers_combining(setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers combining whole rows use the routing node's weights (routed_scaling_factor included)."""
    monkeypatch.setattr(RemoteExecutor, "_combining_pays", staticmethod(lambda *a: True))
    coord = Coordinator(setup.mesh)
    try:
        coord.connect(setup.workers[:1])
        for arch, path in setup.ckpts.items():
            ex: RemoteExecutor = coord.executor(path, "on")
            bad = gate(setup.models[arch], ex)
            assert bad == [], f"{arch} combining: {bad[:5]}"
            assert ex.status()["rows_combined"] > 0
    finally:
        coord.close()


def test_batched_decode_with_workers(setup: Setup) -> None:
    """forward_batch (the scheduler's batched step) through the workers equals it locally."""
    coord = Coordinator(setup.mesh)
    try:
        coord.connect(setup.workers)
        for arch, path in setup.ckpts.items():
            model = setup.models[arch]
            ex = coord.executor(path, "on")
            out = []
            for executor in (None, ex):
                caches = [model.new_cache() for _ in range(3)]
                for c, n in zip(caches, (2, 5, 8)):
                    model.forward(PROMPT[:n], c, executor=executor)
                out.append(model.forward_batch([7, 8, 9], caches, executor=executor))
            assert out[0].tobytes() == out[1].tobytes(), arch
            assert np.isfinite(out[0]).all()
    finally:
        coord.close()
