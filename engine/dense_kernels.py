"""Compiled decode-step kernels for the work outside the packed products (numba: the optional ``[fast]``
extra; ``engine.dense`` imports this module only when numba is there and ``MESHD_KERNELS`` is not ``numpy``).

``f32_rows``: rows ``r0:r1`` of ``x @ W.T`` for an fp32 weight and a few activation rows (decode). BLAS'
sgemv streams the weights at ~28 GB/s on this VM with one or two threads; this loop, eight weight rows per
pass with one accumulator each, reads them at ~37 GB/s on one thread (a core's read bandwidth here is ~40
GB/s: bench/engine.py's probe). Every output element is computed by the same loop over ``k`` whatever T
is (the T rows of activations run one after the other over the same eight weight rows, which stay in L1),
and which loop computes a weight row depends only on its index and N, so a row's bits never depend on how
many activation rows are in the call. fastmath lets LLVM split each dot product into SIMD lanes (results
differ from BLAS by rounding, ~1e-7 relative), the same on every machine running the same compiled code.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_OPTS = dict(cache=True, fastmath=True, nogil=True, boundscheck=False, error_model="numpy")


@njit(**_OPTS)
def f32_rows(x: np.ndarray, w: np.ndarray, out: np.ndarray, r0: int, r1: int) -> None:
    """out[:, r0:r1] = x @ w[r0:r1].T; x [T, K], w [N, K], out [T, N], all fp32 C-contiguous. ``r0`` must be a
    multiple of 8 (so a row's loop depends on its index only)."""
    t, k = x.shape
    r = r0
    while r + 8 <= r1:
        for i in range(t):
            s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
            for j in range(k):
                xj = x[i, j]
                s0 += w[r, j] * xj
                s1 += w[r + 1, j] * xj
                s2 += w[r + 2, j] * xj
                s3 += w[r + 3, j] * xj
                s4 += w[r + 4, j] * xj
                s5 += w[r + 5, j] * xj
                s6 += w[r + 6, j] * xj
                s7 += w[r + 7, j] * xj
            out[i, r] = s0
            out[i, r + 1] = s1
            out[i, r + 2] = s2
            out[i, r + 3] = s3
            out[i, r + 4] = s4
            out[i, r + 5] = s5
            out[i, r + 6] = s6
            out[i, r + 7] = s7
        r += 8
    while r < r1:
        for i in range(t):
            s = np.float32(0.0)
            for j in range(k):
                s += w[r, j] * x[i, j]
            out[i, r] = s
        r += 1


def warm() -> None:
    """Load (or compile once into numba's cache) every kernel here."""
    x = np.zeros((1, 16), dtype=np.float32)
    out = np.empty((1, 9), dtype=np.float32)
    f32_rows(x, np.zeros((9, 16), dtype=np.float32), out, 0, 9)
