"""The expert-worker parity gate (tests/test_experts_parity.py's) on the DeepSeek-V3-style families, over
real QUIC on loopback with real worker processes: ``glm4_moe`` and ``deepseek_v3`` tiny checkpoints
(dense layer 0, group-limited sigmoid routing with a correction bias, a shared expert, latent attention
for deepseek_v3), the deepseek_v3 one converted to FP8 with block scales (workers dequantize the
experts they hold), and both as Q8_0 GGUF files (glm4moe, deepseek2). Local and delegated runs must
be equal byte for byte; the dense layer and the shared experts stay on the routing node (the workers
hold routed experts only) and the routing runs there.
"""

from __future__ import annotations

import json
import shutil
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


def fp8_copy(src: Path, dst: Path, block: tuple[int, int] = (16, 16)) -> Path:
    """``src`` with every layer's ``*proj.weight`` as F8_E4M3 (nearest value, per-block absmax / 448 scale)
    plus its ``weight_scale_inv``; numpy only."""
    from safetensors.numpy import load_file, save_file

    from engine.fp8 import E4M3_TO_F32

    finite = np.flatnonzero(np.isfinite(E4M3_TO_F32))
    order = finite[np.argsort(E4M3_TO_F32[finite], kind="stable")]
    values = E4M3_TO_F32[order]
    shutil.copytree(src, dst)
    flat = load_file(src / "model.safetensors")
    out: dict[str, np.ndarray] = {}
    for key, w in flat.items():
        if not (key.startswith("model.layers.") and key.endswith("proj.weight")):
            out[key] = w
            continue
        bn, bk = block
        rows, cols = -(-w.shape[0] // bn), -(-w.shape[1] // bk)
        scale = np.ones((rows, cols), np.float32)
        for i in range(rows):
            for j in range(cols):
                scale[i, j] = max(float(np.abs(w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]).max()), 1e-12) / 448
        full = np.repeat(np.repeat(scale, bn, 0)[: w.shape[0]], bk, 1)[:, : w.shape[1]]
        pos = np.clip(np.searchsorted(values, w / full), 1, len(values) - 1)
        lower = np.abs(values[pos - 1] - w / full) <= np.abs(values[pos] - w / full)
        out[key] = order[np.where(lower, pos - 1, pos)].astype(np.uint8)
        out[key + "_scale_inv"] = scale
    save_file(out, str(dst / "model.safetensors"))
    raw = (dst / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].rstrip(b" ").replace(b'"U8"', b'"F8_E4M3"')
    header += b" " * (-len(header) % 8)
    (dst / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + raw[8 + n:])
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.mesh = MeshFixture()
        self.ckpts = {a: create_tiny(tmp / a, arch=a, seed=5) for a in ARCHES}
        self.ckpts["deepseek_v3-fp8"] = fp8_copy(self.ckpts["deepseek_v3"], tmp / "deepseek_v3-fp8")
        from engine.gguf_export import export_gguf

        for a in ARCHES:  # GGUF glm4moe / deepseek2 (kv_b split into attn_k_b/attn_v_b), Q8_0
            self.ckpts[f"gguf-{a}-Q8_0"] = tmp / f"{a}-q8.gguf"
            export_gguf(self.ckpts[a], self.ckpts[f"gguf-{a}-Q8_0"], "Q8_0")
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


def test_fp8_copy_is_fp8_and_close_to_the_original(setup: Setup) -> None:
    fp8, f32 = setup.models["deepseek_v3-fp8"], setup.models["deepseek_v3"]
    assert fp8.checkpoint["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == "F8_E4M3"
    a, b = fp8.forward(PROMPT, fp8.new_cache()), f32.forward(PROMPT, f32.new_cache())
    assert np.abs(a - b).max() > 0 and np.corrcoef(a.ravel(), b.ravel())[0, 1] > 0.95  # quantized, not garbled


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
