"""The AVX2 kernels (engine/kernels_avx2.py: Q4_K, Q6_K and Q8_0 on CPUs with AVX2 and no AVX-512) give the bits
of the generic kernels in engine/kernels.py, which every other CPU without the AVX-512 kernels runs: a mesh of
mixed machines stays byte-identical. And the kernel threads take them where they are available."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")

from engine import kernels, quant  # noqa: E402
from engine.gguf_export import quantize  # noqa: E402

avx2 = pytest.importorskip("engine.kernels_avx2") if kernels.AVAILABLE else None
pytestmark = pytest.mark.skipif(avx2 is None or not avx2.AVAILABLE,
                                reason="numba (the fast extra) not installed, or not an AVX2 CPU without AVX-512")

SHAPES = {  # (rows, K, activation rows): whole 256-blocks for the K-quants; odd and even 32-block counts for Q8_0
    "Q4_K": ((37, 256, 1), (300, 768, 3), (64, 1024, 4)),
    "Q6_K": ((37, 256, 1), (300, 768, 3), (64, 1024, 4)),
    "Q8_0": ((37, 32, 1), (300, 384, 3), (64, 416, 4), (5, 1024, 2)),
}


def _generic(qtype: str, x: np.ndarray, data: np.ndarray, out: np.ndarray) -> None:
    n = data.shape[0]
    if qtype == "Q6_K":
        kernels._q6_k(x, data, out, kernels.HALF, 0, n)
    elif qtype == "Q8_0":
        kernels._q8_0(x, data, out, kernels.HALF, 0, n)
    else:
        kernels._q45_k(x, data, out, kernels.HALF, 0, n, False)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q8_0"])
def test_avx2_kernels_give_the_generic_kernels_bits(qtype: str) -> None:
    from engine import kernel_pool

    rng = np.random.default_rng(7)
    for n, k, t in SHAPES[qtype]:
        # scales spanning orders of magnitude, and some all-zero and extreme blocks
        w = (rng.standard_normal((n, k)) * np.logspace(-3, 1, k)).astype(np.float32)
        w[3, :32] = 0
        w[4, : min(k, 256)] = 0
        w[2, -32:] *= 1e4
        data = quant.packed(quantize(w, qtype), qtype, (n, k)).data
        x = rng.standard_normal((t, k)).astype(np.float32)
        x[-1, :32] *= 1e-30  # tiny activations: products near the subnormal range
        want = np.empty((t, n), dtype=np.float32)
        _generic(qtype, x, data, want)
        got = np.full((t, n), np.nan, dtype=np.float32)
        getattr(avx2, qtype.lower())(x, data, got, kernels.HALF, 0, n)
        assert got.tobytes() == want.tobytes(), (qtype, n, k, t)
        part = np.full((t, n), np.nan, dtype=np.float32)  # a row range leaves the other rows alone
        getattr(avx2, qtype.lower())(x, data, part, kernels.HALF, 1, n - 1)
        assert part[:, 1:-1].tobytes() == want[:, 1:-1].tobytes() and np.isnan(part[:, [0, -1]]).all()
        pool = np.full((t, n), np.nan, dtype=np.float32)
        kernels.run(x, qtype, data, pool, 0, n)  # the kernel threads' path
        assert pool.tobytes() == want.tobytes()
    assert kernel_pool._ADDR[qtype] == int(kernel_pool._CFUNCS[qtype].address)
    assert kernel_pool._CFUNCS[qtype].__name__.endswith("_avx2")
