"""The compiled decode kernels (engine/kernels.py, the optional ``fast`` extra): every packed type against the
numpy tiles, row splits over threads giving the same bits, and a decode whose bytes do not depend on the
kernel thread count. Without numba these tests are skipped; the numpy tiles are then what every other test
(test_gguf.py parity, experts/pipeline parity) exercises."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")

from engine import kernels, quant  # noqa: E402
from engine.gguf_export import export_gguf, quantize  # noqa: E402
from gguf_helpers import decode_hash  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.AVAILABLE, reason="numba (the fast extra) not installed")

# (type, K): K a whole number of blocks; BF16's 520 leaves an 8-element tail after the 32-lane blocks
SHAPES = [("BF16", 520), ("Q8_0", 512), ("Q4_0", 512), ("Q4_K", 512), ("Q5_K", 768), ("Q6_K", 512)]


def _packed(qtype: str, n: int, k: int, seed: int) -> quant.Packed:
    w = (np.random.default_rng(seed).standard_normal((n, k)) * np.linspace(0.05, 2, k)).astype(np.float32)
    p = quant.packed(quantize(w, qtype), qtype, (n, k))
    assert isinstance(p, quant.Packed)
    return p


@pytest.mark.parametrize("qtype,k", SHAPES)
@pytest.mark.parametrize("t", [1, 3, 4])
def test_kernel_matches_the_dequantized_product(qtype: str, k: int, t: int) -> None:
    p = _packed(qtype, 300, k, 1)
    x = np.random.default_rng(2).standard_normal((t, k)).astype(np.float32)
    got = kernels.gemm(x, qtype, p.data)
    ref = x.astype(np.float64) @ p.widen().astype(np.float64).T
    assert got is not None and got.dtype == np.float32 and got.shape == (t, 300)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
    # the engine's product takes the kernel for decode-sized T
    np.testing.assert_array_equal(p.matmul(x), got)


@pytest.mark.parametrize("qtype,k", SHAPES)
@pytest.mark.parametrize("helpers", [1, 2])
def test_threads_split_rows_without_changing_a_bit(qtype: str, k: int, helpers: int) -> None:
    from engine import kernel_pool

    p = _packed(qtype, 1500, k, 3)
    x = np.random.default_rng(4).standard_normal((2, k)).astype(np.float32)
    one = np.empty((2, 1500), dtype=np.float32)
    kernels.run(x, qtype, p.data, one, 0, 1500)  # all rows, one call, this thread
    serial = np.full((2, 1500), np.nan, dtype=np.float32)
    kernel_pool.run_serial([(x, qtype, p.data, serial)])
    np.testing.assert_array_equal(serial, one)
    _, total, _, _ = kernel_pool.table([(x, qtype, p.data, serial)])
    assert total > 1
    pool = kernel_pool.Pool(helpers)
    out = np.full((2, 1500), np.nan, dtype=np.float32)
    for i in range(200):  # many rounds, some after a pause (helpers asleep): none may lose or repeat work
        out[:] = np.nan
        pool.run([(x, qtype, p.data, out)])
        np.testing.assert_array_equal(out, one)
        if i % 50 == 49:
            time.sleep(0.002)


@pytest.mark.parametrize("qtype,k", SHAPES)
def test_a_row_does_not_depend_on_the_other_rows_in_the_call(qtype: str, k: int) -> None:
    p = _packed(qtype, 700, k, 7)
    x = np.random.default_rng(8).standard_normal((4, k)).astype(np.float32)
    got = kernels.gemm(x, qtype, p.data)
    for t in range(4):
        np.testing.assert_array_equal(kernels.gemm(x[t:t + 1], qtype, p.data)[0], got[t])
        np.testing.assert_array_equal(kernels.gemm(x[t:t + 3], qtype, p.data)[0], got[t])


def test_gemm_many_equals_one_gemm_each() -> None:
    ps = [_packed(q, 400, k, 5 + i) for i, (q, k) in enumerate(SHAPES)]
    xs = [np.random.default_rng(6 + i).standard_normal((1, k)).astype(np.float32) for i, (_, k) in enumerate(SHAPES)]
    many = kernels.gemm_many([(x, p.qtype, p.data) for x, p in zip(xs, ps)])
    for x, p, got in zip(xs, ps, many):
        np.testing.assert_array_equal(got, kernels.gemm(x, p.qtype, p.data))
    pairs = [(x, p) for x, p in zip(xs, ps)] + [(xs[0], p.widen()) for p in ps[:1]]  # an fp32 weight mixed in
    for (x, w), got in zip(pairs, quant.matmul_many(pairs)):
        np.testing.assert_array_equal(got, quant.matmul(x, w))


@pytest.fixture(scope="module")
def wide_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Q4_K_M GGUF whose products are big enough (1 Mi weights) for the kernel threads to split them."""
    from experts_util import make_moe_checkpoint

    tmp = tmp_path_factory.mktemp("wide")
    src = make_moe_checkpoint(tmp / "src", family="qwen3_moe", layers=2, experts=4, hidden=1024, inter=512,
                              top_k=2, vocab=256)
    g = tmp / "m.gguf"
    export_gguf(src, g, "Q4_K_M")
    return g


def test_decode_bytes_do_not_depend_on_the_kernel_thread_count(wide_gguf: Path) -> None:
    one = decode_hash(wide_gguf, MESHD_KERNEL_THREADS="1")
    assert decode_hash(wide_gguf, MESHD_KERNEL_THREADS="2") == one
    assert decode_hash(wide_gguf, MESHD_KERNEL_THREADS="3") == one


def test_kernels_can_be_turned_off(wide_gguf: Path) -> None:
    """MESHD_KERNELS=numpy takes the numpy tiles (what a node without numba computes): other bits, the same
    values within rounding."""
    assert decode_hash(wide_gguf, MESHD_KERNELS="numpy") != decode_hash(wide_gguf)
    probe = "from engine import kernels; print(kernels.AVAILABLE)"
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "MESHD_KERNELS": "numpy"})
    assert p.stdout.strip() == "False", p.stderr

