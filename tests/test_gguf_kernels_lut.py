"""The table-lookup K-quant kernels (engine/kernels_lut.py, AVX-512 with numba) give the bits of the generic
kernels in engine/kernels.py, which every other CPU runs: a mesh of mixed machines stays byte-identical. And the
kernel threads take them where they are available."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")

from engine import kernels, quant  # noqa: E402
from engine.gguf_export import quantize  # noqa: E402

lut = pytest.importorskip("engine.kernels_lut") if kernels.AVAILABLE else None
pytestmark = pytest.mark.skipif(lut is None or not lut.AVAILABLE,
                                reason="numba (the fast extra) not installed, or no AVX-512")


def _generic(qtype: str, x: np.ndarray, data: np.ndarray, out: np.ndarray) -> None:
    n = data.shape[0]
    if qtype == "Q6_K":
        kernels._q6_k(x, data, out, kernels.HALF, 0, n)
    else:
        kernels._q45_k(x, data, out, kernels.HALF, 0, n, qtype == "Q5_K")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_lookup_kernels_give_the_generic_kernels_bits(qtype: str) -> None:
    from engine import kernel_pool, kernels_int

    integer = kernels_int.AVAILABLE and qtype in kernels_int.POOL_TYPES
    rng = np.random.default_rng(5)
    for n, k, t in ((37, 256, 1), (300, 768, 3), (64, 1024, 4)):
        # scales spanning orders of magnitude, and some all-zero and extreme blocks
        w = (rng.standard_normal((n, k)) * np.logspace(-3, 1, k)).astype(np.float32)
        w[3, :256] = 0
        w[5, :256] *= 1e4
        data = quant.packed(quantize(w, qtype), qtype, (n, k)).data
        x = rng.standard_normal((t, k)).astype(np.float32)
        want = np.empty((t, n), dtype=np.float32)
        _generic(qtype, x, data, want)
        got = np.full((t, n), np.nan, dtype=np.float32)
        getattr(lut, qtype.lower())(x, data, got, kernels.HALF, 0, n)
        assert got.tobytes() == want.tobytes(), (qtype, n, k, t)
        if not integer:  # else the threads run engine/kernels_int.py's kernel (tests/test_gguf_kernels_int.py)
            pool = np.full((t, n), np.nan, dtype=np.float32)
            kernels.run(x, qtype, data, pool, 0, n)  # the kernel threads' path
            assert pool.tobytes() == want.tobytes()
    assert kernel_pool._ADDR[qtype] == int(kernel_pool._CFUNCS[qtype].address)
    assert kernel_pool._CFUNCS[qtype].__name__.endswith("_int" if integer else "_lut")
