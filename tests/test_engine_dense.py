"""The compiled fp32 decode products (engine.dense / engine.dense_kernels): accuracy against a float64
reference, bits independent of the number of activation rows and of how the rows are split, the dispatch
rule, and a model large enough to use them against transformers (within 1e-4, as every family's parity)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from engine import dense
from engine.limits import DENSE_KERNEL_MIN_WEIGHTS, KERNEL_MAX_ROWS

kern = dense._kernels()
needs_numba = pytest.mark.skipif(kern is None, reason="numba not installed (the [fast] extra)")


def _rand(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@needs_numba
@pytest.mark.parametrize("n,k", [(1, 16), (7, 33), (8, 64), (203, 300), (520, 768)])
def test_rows_match_float64(n: int, k: int) -> None:
    w, x = _rand((n, k), 1), _rand((KERNEL_MAX_ROWS, k), 2)
    out = np.empty((KERNEL_MAX_ROWS, n), dtype=np.float32)
    kern.f32_rows(x, w, out, 0, n)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
    assert np.all(np.abs(out - ref) <= 1e-6 * scale + 1e-30)


@needs_numba
def test_bits_do_not_depend_on_rows_in_the_call_or_the_split() -> None:
    n, k = 203, 300
    w, x = _rand((n, k), 3), _rand((KERNEL_MAX_ROWS, k), 4)
    full = np.empty((KERNEL_MAX_ROWS, n), dtype=np.float32)
    kern.f32_rows(x, w, full, 0, n)
    for t in range(1, KERNEL_MAX_ROWS):
        part = np.empty((t, n), dtype=np.float32)
        kern.f32_rows(np.ascontiguousarray(x[-t:]), w, part, 0, n)
        assert part.tobytes() == full[-t:].tobytes()
    split = np.empty_like(full)
    for a, b in ((0, 8), (8, 64), (64, 200), (200, n)):  # chunk starts on multiples of 8
        kern.f32_rows(x, w, split, a, b)
    assert split.tobytes() == full.tobytes()


@needs_numba
def test_dispatch_rule() -> None:
    side = math.isqrt(DENSE_KERNEL_MIN_WEIGHTS - 1) + 1
    big, small = _rand((side, side), 5), _rand((side // 2, side), 6)
    x = _rand((1, side), 7)
    assert dense._f32_kernel(x, big) and not dense._f32_kernel(x, small)
    assert not dense._f32_kernel(_rand((KERNEL_MAX_ROWS + 1, side), 8), big)  # prefill: BLAS
    assert not dense._f32_kernel(x, np.asfortranarray(big))
    got = dense.matmul_many([(x, big), (x, small), (x, big.astype(np.float16))])
    assert got[1].tobytes() == (x @ small.T).tobytes()
    np.testing.assert_allclose(got[0], x @ big.T, rtol=1e-4, atol=1e-4)
    assert got[0].tobytes() == dense.matmul(x, big).tobytes()
    np.testing.assert_allclose(got[2], x @ big.astype(np.float16).T, rtol=1e-4, atol=1e-3)


@needs_numba
def test_model_on_the_kernel_matches_transformers(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from test_engine_parity import _build, _check

    m = _build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", seed=11, vocab_size=512, hidden_size=512,
               intermediate_size=512, moe_intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)
    m.save_pretrained(tmp_path)
    eng = _check(m, tmp_path)
    lay = eng.layers[0]
    assert dense.uses_kernel([lay.q, *lay.experts[0]])  # the products above ran on the kernel
    # a two-stage split (what pipeline stages run: span_steps over their layers) gives the whole model's bits
    from engine.moe import drive

    first, second = eng.part(0, 0), eng.part(1, 1)
    whole, c0, c1 = eng.new_cache(), first.new_cache(), second.new_cache()
    for ids in ([5, 9, 77, 300, 2], [41], [7], [8]):
        want = eng.forward(ids, whole)
        past = c0.length
        c0.reserve(past + len(ids))
        c1.reserve(past + len(ids))
        x = drive(first.span_steps(first.embed(np.asarray(ids)), c0, past), first.local_executor)
        x = drive(second.span_steps(x, c1, past), second.local_executor)
        c0.length = c1.length = past + len(ids)
        assert second.logits(x).tobytes() == want.tobytes()


@needs_numba
def test_expert_worker_over_quic_gives_the_local_bits_on_the_kernels(tmp_path: Path) -> None:
    """A real worker process (QUIC, its own numba) computes the routed experts of a model big enough for the
    compiled step (fp32 experts on the kernel, compiled SwiGLU): every prefix and decode step equals the
    local pass byte for byte (test_experts_parity's gate), with every layer delegated."""
    from experts_mesh import Coordinator, MeshFixture, spawn_worker
    from experts_util import make_moe_checkpoint
    from test_experts_parity import gate

    from engine.model import Model

    ck = make_moe_checkpoint(tmp_path / "src", family="qwen3_moe", layers=2, experts=4, hidden=512, inter=512,
                             top_k=2, vocab=256, seed=3)
    model = Model.load(ck)
    assert model._step and dense.uses_kernel(list(model.expert_weights(0, 0)))
    mesh = MeshFixture()
    worker = spawn_worker(mesh, tmp_path, [str(ck)])
    coord = Coordinator(mesh)
    try:
        coord.connect([worker])
        ex = coord.executor(ck, "on")
        assert gate(model, ex) == []
        st = ex.status()
        assert st["items_local"] == 0 and st["layers_delegated"] == st["layers"] > 0, st
    finally:
        coord.close()
        worker.stop()


@needs_numba
def test_glm4_moe_on_the_compiled_step_matches_transformers(tmp_path: Path) -> None:
    """The compiled attention with q/k/v bias, per-head q/k norm and half rotary (GLM-4 MoE), and a dense
    first layer, sigmoid routing and shared experts around the compiled step: within 1e-4 of transformers."""
    pytest.importorskip("transformers")
    from test_engine_parity import _build, _check

    m = _build("Glm4MoeConfig", "Glm4MoeForCausalLM", seed=22, vocab_size=256, hidden_size=512,
               intermediate_size=512, moe_intermediate_size=512, num_hidden_layers=3, num_attention_heads=8,
               num_key_value_heads=2, head_dim=64, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
               topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=512,
               first_k_dense_replace=1, use_qk_norm=True, attention_bias=True, norm_topk_prob=True)
    m.save_pretrained(tmp_path)
    eng = _check(m, tmp_path)
    assert eng._step and eng.config.rotary_dim == 32 and eng.config.qk_norm == "head"


@needs_numba
def test_expert_shard_warm_loads_the_compiled_kernels(tmp_path: Path) -> None:
    """A worker loads what its experts' decode uses at start (``ExpertShard.warm``, called by the experts
    service), so its first request pays no numba import or compile; checked in a fresh interpreter."""
    import subprocess
    import sys

    from experts_util import make_moe_checkpoint

    ck = make_moe_checkpoint(tmp_path / "src", family="qwen3_moe", layers=2, experts=4, hidden=512, inter=512,
                             top_k=2, vocab=256, seed=3)
    probe = ("import sys; from engine.experts.shard import load_shard; s = load_shard(sys.argv[1]); "
             "before = 'engine.dense_kernels' in sys.modules; s.warm(); "
             "print(before, 'engine.dense_kernels' in sys.modules, 'engine.kernel_pool' in sys.modules or 'numba' "
             "in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe, str(ck)], capture_output=True, text=True, timeout=300,
                         check=True).stdout.split()
    assert out == ["False", "True", "True"], out
